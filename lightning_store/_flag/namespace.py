"""A Trainer given a LightningModule of the other Lightning namespace refuses it with the import to use instead."""

import functools
import sys
from collections.abc import Callable
from typing import Any

# each namespace, and the lightning-store Trainer for its modules
_TRAINERS = {"pytorch_lightning": "lightning_store.Trainer", "lightning.pytorch": "lightning_store.lightning.Trainer"}
_IMPORTS = {
    "pytorch_lightning": "from lightning_store import Trainer",
    "lightning.pytorch": "from lightning_store.lightning import Trainer",
}


def _refusing_the_other_namespace(method: Callable[..., Any], namespace: str) -> Callable[..., Any]:
    """``method`` (``fit``, ``validate``, ``test`` or ``predict`` of a Trainer of ``namespace``), checking its model.

    Lightning refuses a LightningModule of the other namespace with "`model` must be a `LightningModule`", which
    does not say that the module is one, of the other namespace, nor which import to use: this says both.
    """

    @functools.wraps(method)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = args[0] if args else kwargs.get("model")
        if model is not None:
            _check_namespace(model, namespace)
        return method(self, *args, **kwargs)

    return checked


def _check_namespace(model: Any, namespace: str) -> None:
    """Raise a ``TypeError`` with a HINT if ``model`` is a LightningModule of the other namespace than ``namespace``.

    Raises:
        TypeError: naming the import of the Trainer for ``model``'s namespace.
    """
    other = "lightning.pytorch" if namespace == "pytorch_lightning" else "pytorch_lightning"
    other_module = sys.modules.get(other)  # a module of the other namespace has imported it
    if other_module is None:
        return
    module = getattr(model, "_orig_mod", model)  # `torch.compile(model)`
    if isinstance(module, other_module.LightningModule):
        raise TypeError(
            f"`{_TRAINERS[namespace]}` is a `{namespace}.Trainer`, and `{type(module).__qualname__}` is a"
            f" `{other}.LightningModule`: a Trainer takes the LightningModules of its own Lightning namespace only."
            f" HINT: `{_IMPORTS[other]}`, the same Trainer for `{other}`."
        )

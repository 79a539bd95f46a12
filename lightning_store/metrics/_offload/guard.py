"""What the worker refuses while it runs an update: a draw from a global torch generator, an op under another dtype."""

import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SEEDED = torch.Tag.nondeterministic_seeded
_UNSEEN = object()


class _Refused(Exception):
    """An op the worker stopped before it ran: raised in the worker, raised again at the next call (``_queue``).

    Args:
        reason: what the update was about to do, and why it must not, in the background.
        hint: how to fix it.
        held: what the Metric's state holds.

    """

    def __init__(
        self, reason: str, hint: str, held: str = "The Metric's state holds what the update changed before it."
    ) -> None:
        super().__init__(reason, hint, held)
        self.reason = reason
        self.hint = hint
        self.held = held


class _Draws:
    """How to tell whether a call of one seeded op draws from a global generator: from its schema, read once.

    An op tagged ``nondeterministic_seeded`` draws unless it is given a generator of its own, or its arguments say
    it draws nothing: ``train=False`` (dropout), or a dropout probability of zero (attention, recurrent layers).
    """

    __slots__ = ("generator", "probability", "train")

    def __init__(self, op: torch._ops.OpOverload) -> None:
        arguments = list(op._schema.arguments)
        self.generator = _argument(arguments, ("generator",))
        self.train = _argument(arguments, ("train", "training"))
        self.probability = _argument(arguments, ("dropout_p", "dropout"))

    def generator_drawn(self, args: tuple, kwargs: dict) -> str | None:
        """The global generator the call would draw from (``"CPU"``, ``"CUDA"``...), or ``None`` if it draws none."""
        if self.train is not None and _value(self.train, args, kwargs) is False:
            return None
        if self.probability is not None and _value(self.probability, args, kwargs) == 0:
            return None
        generator = _value(self.generator, args, kwargs) if self.generator is not None else None
        if generator is not None and generator._cdata not in _default_generators():
            return None  # a generator of the Metric's own
        device = generator.device if generator is not None else _device_of(args, kwargs)
        return device.type.upper() if device.type in ("cpu", "cuda") else str(device)


def _argument(arguments: list, names: tuple[str, ...]) -> tuple[int, str, Any] | None:
    for index, argument in enumerate(arguments):
        if argument.name in names:
            default = argument.default_value if argument.has_default_value() else None
            return index, argument.name, default
    return None


def _value(argument: tuple[int, str, Any], args: tuple, kwargs: dict) -> Any:
    index, name, default = argument
    if index < len(args):
        return args[index]
    return kwargs.get(name, default)


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    """The device of the op's first tensor argument, or its ``device=`` (a factory's), else the CPU."""
    if "device" in kwargs and kwargs["device"] is not None:
        return torch.device(kwargs["device"])
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _default_generators() -> set[int]:
    generators = {torch.default_generator._cdata}  # type: ignore[attr-defined]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators.update(g._cdata for g in torch.cuda.default_generators)  # type: ignore[attr-defined]
    return generators


_rules: dict[Any, Any] = {}  # op overload -> its `_Draws`, or None for an op that draws nothing


class _WorkerGuard(TorchDispatchMode):
    """The dispatch mode every update runs under in the worker (a mode of this thread only).

    - It refuses an op that would draw from a global generator (torch's on the CPU, or CUDA's), before it draws:
      run later than the plain Metric's, the draw would change the Metric's values and move the random numbers the
      model draws. An op given a generator of its own draws from that and is run.
    - It refuses any op while torch's default dtype (a setting of the process) is not the caller's: Lightning's
      ``"bf16-true"`` and ``"64-true"`` precisions set it around each step, and an op creating a tensor would
      give it another dtype than in the plain Metric's update.

    It also times the ops it lets run (``ops_s``, this thread's CPU time in them): the update's work that leaves
    Python's interpreter to the other threads, against the Python time around it (``payoff._Payoff``).

    Args:
        default_dtype: torch's default dtype at the update's call.

    """

    def __init__(self, default_dtype: torch.dtype) -> None:
        super().__init__()
        self.default_dtype = default_dtype
        self.ops_s = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.get_default_dtype() is not self.default_dtype:
            raise _default_dtype_changed(func, self.default_dtype)
        rule = _rules.get(func, _UNSEEN)
        if rule is _UNSEEN:
            rule = _rules[func] = _Draws(func) if _SEEDED in func.tags else None
        if rule is not None:
            generator = rule.generator_drawn(args, kwargs)
            if generator is not None:
                raise _global_draw(func, generator)
        started = time.thread_time()  # CPU time: a wait for the interpreter, after the op, is not the op's work
        try:
            return func(*args, **kwargs)
        finally:
            self.ops_s += time.thread_time() - started


def _global_draw(func: Any, generator: str) -> _Refused:
    return _Refused(
        f"it was about to draw random numbers from torch's global {generator} generator ({func}), and was stopped"
        " before it drew. Run in the background, it would draw them at another time than the plain Metric,"
        " changing both its values and the random numbers your model draws.",
        "keep this Metric as it is (not offloaded), or give its update a `torch.Generator` of its own, seeded once.",
    )


def _default_dtype_changed(func: Any, expected: torch.dtype) -> _Refused:
    return _Refused(
        f"torch's default dtype was {torch.get_default_dtype()} when it was about to run {func}, but"
        f" {expected} when `update` was called. The default dtype is a setting of the whole process, which"
        " another thread changed meanwhile (Lightning's 'bf16-true', '16-true' and '64-true' precisions set it"
        " around each step); run then, the update could make tensors of another dtype than the plain Metric's.",
        "keep this Metric as it is (not offloaded) under a precision that sets the default dtype, or do not change"
        " the default dtype while offloaded updates run.",
    )

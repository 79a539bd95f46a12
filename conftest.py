"""The doctests of a module written for a package that is not installed (``lightning``) skip, with the reason."""

import importlib
import importlib.util
from pathlib import Path

import pytest

# module file -> (its import name, the distribution it is for)
_NEEDS = {
    Path(__file__).parent / "lightning_store" / "lightning.py": ("lightning_store.lightning", "lightning"),
}


class _Skipped(pytest.File):
    """Stands in for the doctests of a module that cannot be imported here; collecting it is a skip."""

    reason = ""

    def collect(self):
        raise pytest.skip.Exception(self.reason)


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    """The doctests of a module in ``_NEEDS`` whose package is not installed become one skip, with the reason."""
    collectors = yield
    needs = _NEEDS.get(file_path)
    if needs is None or importlib.util.find_spec(needs[1]) is not None:
        return collectors  # an installed package that fails to import still fails the collection
    module, package = needs
    try:
        importlib.import_module(module)
    except ImportError as err:
        skipped = _Skipped.from_parent(parent, path=file_path)
        skipped.reason = f"needs the `{package}` package, which is not installed ({err})"
        return [skipped]
    return collectors

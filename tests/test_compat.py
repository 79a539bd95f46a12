import re

import pytest

from lightning_store import _compat


@pytest.mark.parametrize("installed", ["2.1.1", "2.4.0", "2.6.6", "2.6.6.post1"])
def test_tested_releases_pass(installed, monkeypatch):
    monkeypatch.setattr(_compat, "version", lambda distribution: installed)
    _compat._check_lightning_version("pytorch-lightning")


@pytest.mark.parametrize("installed", ["2.0.9", "2.1.0", "1.9.5", "2.7.0rc1", "2.7.0", "3.0.0"])
def test_other_releases_get_an_error_that_says_how_to_fix_it(installed, monkeypatch):
    monkeypatch.setattr(_compat, "version", lambda distribution: installed)
    expected = (
        f"lightning-store supports lightning>=2.1.1,<2.7, but lightning {installed} is installed: Lightning's"
        " logging internals differ outside that range, so stored values could be wrong."
        " HINT: pip install 'lightning>=2.1.1,<2.7'"
    )
    with pytest.raises(ImportError, match=re.escape(expected)):
        _compat._check_lightning_version("lightning")


def test_the_installed_release_is_in_range():
    _compat._check_lightning_version("pytorch-lightning")

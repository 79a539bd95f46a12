"""Sphinx configuration: the Markdown (MyST) pages, and the API from the docstrings."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).parent / "_ext")]

import lightning_store  # noqa: E402

project = "lightning-store"
author = "lightning-store developers"
copyright = "lightning-store developers"
release = version = lightning_store.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "command_output",
]
source_suffix = {".md": "markdown"}
# the benchmarks' tables are included by the performance pages
exclude_patterns = ["_build", "performance/results/*"]
root_doc = "index"

myst_heading_anchors = 3  # `page.md#a-heading` links, checked like the others
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
# the Trainers' `fit`, `validate`, `test` and `predict` are Lightning's (with a check
# of the model's namespace): their docstrings are Lightning's
autodoc_default_options = {"exclude-members": "fit, validate, test, predict"}
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"  # a dataclass's fields once
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

# `-n` checks every reference; those into other projects are not resolved here (no
# intersphinx: the build has no network)
_OTHERS = "torch|torchmetrics|(pytorch_)?lightning|lightning_fabric|lightning_utilities"
nitpick_ignore_regex = [
    (r"py:.*", rf"({_OTHERS}|collections|typing|datetime|pathlib)(\..*)?"),
    (
        r"py:.*",
        r"Tensor|Metric(Collection|Tracker)?|Module|LightningModule|Callable|Any|Iterable|Mapping|Sequence",
    ),
]

html_theme = "furo"
html_title = f"lightning-store {release}"
html_show_sourcelink = False

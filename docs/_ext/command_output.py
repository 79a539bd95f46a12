"""``command-output``: a command of the repository, run as the docs build; its output.

Sample outputs in the docs come from a run when they are built, never from a paste::

    ```{command-output} examples/quickstart.py
    :columns: 80
    ```

The command runs as ``python ARGS`` (the Python that builds the docs) from the
repository's root, with ``COLUMNS`` set. The root's path is shown as relative, a
virtual environment elsewhere as ``<venv>``. A command that fails or times out fails
the build.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]


class CommandOutput(SphinxDirective):
    """The directive: its argument is the command line after ``python``."""

    required_arguments = 1
    final_argument_whitespace = True
    option_spec: ClassVar[dict[str, Any]] = {
        "columns": directives.positive_int,
        "timeout": directives.positive_int,
    }

    def run(self) -> list[nodes.Node]:
        command = self.arguments[0]
        env = {
            **os.environ,
            "COLUMNS": str(self.options.get("columns", 80)),
            "PYTHONPATH": str(ROOT),
        }
        timeout = self.options.get("timeout", 600)
        try:
            done = subprocess.run(
                [sys.executable, *shlex.split(command)],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as err:
            raise self.error(
                f"`python {command}` did not end within {timeout} s"
            ) from err
        if done.returncode != 0:
            output = f"{done.stdout}\n{done.stderr}"
            raise self.error(
                f"`python {command}` exited with {done.returncode}:\n{output}"
            )
        # rebuilt when the example changes
        self.env.note_dependency(str(ROOT / shlex.split(command)[-1]))
        # paths as a reader's checkout would show them
        text = done.stdout.replace(f"{ROOT}{os.sep}", "").replace(str(ROOT), ".")
        text = text.replace(sys.prefix, "<venv>").strip("\n")
        shown = f"$ python {command}\n{text}"
        return [nodes.literal_block(shown, shown, language="text")]


def setup(app: Any) -> dict[str, Any]:
    """Register the directive (Sphinx calls this for each extension)."""
    app.add_directive("command-output", CommandOutput)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

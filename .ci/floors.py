"""Print the floors of pyproject.toml: the lowest Python, then one ``name==floor`` pin per dependency.

The runtime dependencies and the ``test`` extra each must declare a floor (``>=``): CI installs exactly those
releases, so the declared range and the tested one cannot disagree. Usage: ``python .ci/floors.py pyproject.toml``.
"""

import re
import sys

import tomllib
from packaging.requirements import Requirement


def main(path: str) -> None:
    """Print the floors of the pyproject.toml at ``path``, or exit with what is missing."""
    with open(path, "rb") as file:
        project = tomllib.load(file)["project"]
    python = re.fullmatch(r">=\s*(\d+\.\d+)", project["requires-python"].strip())
    if python is None:
        sys.exit(f"requires-python must be '>=X.Y', got {project['requires-python']!r}")
    print(f"python {python.group(1)}")
    own = project["name"]
    for text in project["dependencies"] + project["optional-dependencies"]["test"]:
        requirement = Requirement(text)
        if requirement.name == own:
            continue
        floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        if len(floors) != 1:
            sys.exit(f"{text!r} in {path} declares no floor ('>='): CI could not test its lowest release")
        print(f"{requirement.name}=={floors[0]}")  # constraints take no extras


if __name__ == "__main__":
    main(sys.argv[1])

"""Fail when sibling requirements disagree with the siblings' versions.

Leaf packages require a sibling with a floor at or below its version and a cap
at the next minor; ascend-plugin pins every sibling with ``==`` its version.
"""

from __future__ import annotations

import pathlib
import re
import sys

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]
META = "ascend-plugin"


def package_versions(root: pathlib.Path) -> dict[str, Version]:
    versions = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        name = data["project"]["name"]
        version_file = pyproject.parent / data["tool"]["hatch"]["version"]["path"]
        match = re.search(r'__version__\s*=\s*"([^"]+)"', version_file.read_text())
        if not match:
            raise SystemExit(f"{version_file}: no __version__ = \"...\" line")
        versions[name] = Version(match.group(1))
    return versions


def problems(root: pathlib.Path = ROOT) -> list[str]:
    versions = package_versions(root)
    found = []
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        name = data["project"]["name"]
        for text in data["project"].get("dependencies", []):
            req = Requirement(text)
            if req.name not in versions:
                continue
            sibling = versions[req.name]
            if name == META:
                pins = [s for s in req.specifier if s.operator == "=="]
                if len(pins) != 1 or Version(pins[0].version) != sibling:
                    found.append(f"{name}: requires {text!r}, must pin =={sibling}")
                continue
            cap = Version(f"{sibling.major}.{sibling.minor + 1}")
            floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
            caps = [Version(s.version) for s in req.specifier if s.operator == "<"]
            if sibling not in req.specifier or not floors or caps != [cap]:
                found.append(
                    f"{name}: requires {text!r}; {req.name} is {sibling}: need a floor "
                    f"<= {sibling} and the cap <{cap}"
                )
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    print(f"pin check: {len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

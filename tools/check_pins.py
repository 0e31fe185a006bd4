"""Fail when sibling requirements disagree with the siblings' versions.

Leaf packages require a sibling with a floor at or below its version and a cap
at the next minor; ascend-plugin pins every sibling (all five) with ``==`` its version;
the noxfile's ``SIBLINGS`` table (which siblings each package's test venv gets) lists
exactly the siblings each pyproject requires.
"""

from __future__ import annotations

import ast
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


def noxfile_siblings(root: pathlib.Path) -> dict[str, list[str]] | None:
    """The noxfile's ``SIBLINGS = {...}`` literal, or None without a noxfile."""
    noxfile = root / "noxfile.py"
    if not noxfile.is_file():
        return None
    for node in ast.parse(noxfile.read_text()).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "SIBLINGS"):
            return ast.literal_eval(node.value)
    raise SystemExit(f"{noxfile}: no SIBLINGS = {{...}} table")


def problems(root: pathlib.Path = ROOT) -> list[str]:
    versions = package_versions(root)
    found = []
    required: dict[str, list[str]] = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        name = data["project"]["name"]
        siblings = [Requirement(text).name for text in data["project"].get("dependencies", [])]
        required[name] = sorted(s for s in siblings if s in versions)
        if name == META:
            for missing in sorted(set(versions) - {META} - set(siblings)):
                found.append(f"{name}: does not pin {missing}; add {missing}=={versions[missing]}")
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
    table = noxfile_siblings(root)
    if table is not None:
        for name in sorted(set(required) - {META} | set(table)):
            listed, needed = sorted(table.get(name, [])), _closure(required, name)
            if listed != needed:
                found.append(f"noxfile.py: SIBLINGS[{name!r}] is {listed}, but its pyproject "
                             f"requires {needed} (with what those require)")
    return found


def _closure(required: dict[str, list[str]], name: str) -> list[str]:
    """The siblings ``name`` needs installed: those it requires and theirs, and so on (pip
    cannot fetch them from an index, so a test venv gets each one from its folder)."""
    seen: set[str] = set()
    pending = list(required.get(name, []))
    while pending:
        sibling = pending.pop()
        if sibling not in seen:
            seen.add(sibling)
            pending += required.get(sibling, [])
    return sorted(seen)


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    print(f"pin check: {len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

"""The lint checks catch what they are for, on small trees made here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import check_imports  # noqa: E402
import check_pins  # noqa: E402

PYPROJECT = """[project]
name = "{name}"
dependencies = [{deps}]
[tool.hatch.version]
path = "src/{module}/__about__.py"
"""


def write_package(root: Path, name: str, version: str, deps: list[str], code: str = "") -> None:
    module = name.replace("-", "_")
    src = root / "packages" / name / "src" / module
    src.mkdir(parents=True)
    (src / "__about__.py").write_text(f'__version__ = "{version}"\n')
    (src / "__init__.py").write_text(code)
    quoted = ", ".join(f'"{d}"' for d in deps)
    (root / "packages" / name / "pyproject.toml").write_text(
        PYPROJECT.format(name=name, deps=quoted, module=module))


def test_import_against_the_package_order_is_reported(tmp_path):
    write_package(tmp_path, "ascend-kernels", "0.1.0", [], "import ascend_core\n")
    write_package(tmp_path, "ascend-quant", "0.1.0", [], "from ascend_specdec import x\n")
    write_package(tmp_path, "ascend-core", "0.1.0", [], "import ascend_kernels\n")
    problems = check_imports.violations(tmp_path)
    assert any("ascend_kernels must not import ascend_core" in p for p in problems)
    assert any("ascend_quant must not import ascend_specdec" in p for p in problems)
    assert len(problems) == 2


def test_module_level_vllm_import_outside_the_glue_is_reported(tmp_path):
    write_package(tmp_path, "ascend-eplb", "0.1.0", [],
                  "import vllm\n\ndef f():\n    import vllm.config\n")
    (problem,) = check_imports.violations(tmp_path)
    assert "ascend_eplb/__init__.py:1: imports vllm at module level" in problem


def test_pins_must_match_versions(tmp_path):
    write_package(tmp_path, "ascend-kernels", "0.2.0", [])
    write_package(tmp_path, "ascend-core", "0.1.0", ["ascend-kernels>=0.1.0,<0.2"])
    write_package(tmp_path, "ascend-plugin", "0.1.0",
                  ["ascend-kernels==0.1.0", "ascend-core==0.1.0"])
    problems = check_pins.problems(tmp_path)
    assert any(p.startswith("ascend-core: requires 'ascend-kernels>=0.1.0,<0.2'")
               for p in problems)
    assert any("ascend-plugin: requires 'ascend-kernels==0.1.0', must pin ==0.2.0" in p
               for p in problems)
    assert len(problems) == 2


def test_consistent_pins_pass(tmp_path):
    write_package(tmp_path, "ascend-kernels", "0.2.3", [])
    write_package(tmp_path, "ascend-core", "0.1.0", ["ascend-kernels>=0.2.0,<0.3"])
    write_package(tmp_path, "ascend-plugin", "0.1.0",
                  ["ascend-kernels==0.2.3", "ascend-core==0.1.0"])
    assert check_pins.problems(tmp_path) == []


def test_the_meta_package_must_pin_every_sibling(tmp_path):
    write_package(tmp_path, "ascend-kernels", "0.2.3", [])
    write_package(tmp_path, "ascend-core", "0.1.0", ["ascend-kernels>=0.2.0,<0.3"])
    write_package(tmp_path, "ascend-plugin", "0.1.0", ["ascend-core==0.1.0"])
    assert check_pins.problems(tmp_path) == [
        "ascend-plugin: does not pin ascend-kernels; add ascend-kernels==0.2.3"]


def test_the_noxfile_sibling_table_must_match_the_pyprojects(tmp_path):
    write_package(tmp_path, "ascend-kernels", "0.2.3", [])
    write_package(tmp_path, "ascend-core", "0.1.0", ["ascend-kernels>=0.2.0,<0.3"])
    write_package(tmp_path, "ascend-plugin", "0.1.0",
                  ["ascend-kernels==0.2.3", "ascend-core==0.1.0"])
    (tmp_path / "noxfile.py").write_text(
        'SIBLINGS = {"ascend-kernels": [], "ascend-core": []}\n')
    assert check_pins.problems(tmp_path) == [
        "noxfile.py: SIBLINGS['ascend-core'] is [], but its pyproject requires "
        "['ascend-kernels'] (with what those require)"]
    # A sibling's own requirements count: eplb requires core, which requires kernels.
    write_package(tmp_path, "ascend-eplb", "0.1.0", ["ascend-core>=0.1.0,<0.2"])
    (tmp_path / "noxfile.py").write_text(
        'SIBLINGS = {"ascend-kernels": [], "ascend-core": ["ascend-kernels"],\n'
        '            "ascend-eplb": ["ascend-kernels", "ascend-core"]}\n')
    assert check_pins.problems(tmp_path) == [
        "ascend-plugin: does not pin ascend-eplb; add ascend-eplb==0.1.0"]


def test_the_repository_itself_passes():
    assert check_imports.violations() == []
    assert check_pins.problems() == []

"""Fail on an import that goes against the package order of DESIGN.md section 2.

Also fails if a module that must stay usable without vLLM (everything outside
the vLLM-facing folders) imports vLLM at module level.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

ALLOWED = {
    "ascend_kernels": set(),
    "ascend_core": {"ascend_kernels"},
    "ascend_quant": {"ascend_core", "ascend_kernels"},
    "ascend_specdec": {"ascend_core", "ascend_kernels"},
    "ascend_eplb": {"ascend_core", "ascend_kernels"},
    "ascend_plugin": {"ascend_core", "ascend_kernels", "ascend_quant", "ascend_specdec",
                      "ascend_eplb"},
}
# Modules allowed to import vLLM at import time: the vLLM-facing glue.
VLLM_FACING = ("ascend_core/platform/", "ascend_core/worker/", "ascend_core/ops/",
               "ascend_core/distributed/", "ascend_core/attention/", "ascend_core/lora/",
               "ascend_plugin/",
               "ascend_quant/vllm/", "ascend_specdec/vllm/", "ascend_eplb/vllm/")


def imported_top_level(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """(line, top-level module, at module level?) for every import in the tree."""
    found = []
    top_level_nodes = {id(node) for node in getattr(tree, "body", [])}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            found.append((node.lineno, name.split(".")[0], id(node) in top_level_nodes))
    return found


def violations(root: pathlib.Path = ROOT) -> list[str]:
    problems = []
    for package, allowed in ALLOWED.items():
        src = root / "packages" / package.replace("_", "-") / "src" / package
        for path in sorted(src.rglob("*.py")):
            rel = path.relative_to(src.parent).as_posix()
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, module, module_level in imported_top_level(tree):
                if module in ALLOWED and module != package and module not in allowed:
                    problems.append(
                        f"{rel}:{line}: {package} must not import {module} "
                        f"(allowed: {sorted(allowed) or 'no sibling'})"
                    )
                if (module == "vllm" and module_level
                        and not rel.startswith(VLLM_FACING)):
                    problems.append(
                        f"{rel}:{line}: imports vllm at module level outside the "
                        f"vLLM-facing modules {VLLM_FACING}"
                    )
    return problems


def main() -> int:
    problems = violations()
    for problem in problems:
        print(problem)
    print(f"import contract: {len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""Triton kernels, one module per area, and the launch arithmetic they share.

Importing a module here imports triton, and Triton decides at that moment whether its
kernels run compiled or in the interpreter (``TRITON_INTERPRET``); the op modules
therefore import these lazily, on the first Triton call.

Everything stays within the language of Triton 3.2, which triton-ascend is based on:
masked ``tl.load``/``tl.store``, ``tl.program_id``, ``tl.arange``, reductions, ``tl.where``,
elementwise math and casts; no block pointers, descriptors or newer features.
"""

from __future__ import annotations

from dataclasses import dataclass

# Largest row a row kernel holds in one block; longer rows go to the reference.
MAX_ROW_BLOCK = 65536
# Elements a row-kernel program holds at once when it takes several short rows.
ROW_TILE_ELEMENTS = 4096


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class RowLaunch:
    """How a row kernel covers ``[rows, cols]``: ``block_rows`` whole rows per program."""

    block_cols: int
    block_rows: int
    num_warps: int

    def grid(self, rows: int) -> tuple[int]:
        return ((rows + self.block_rows - 1) // self.block_rows,)


def row_launch(cols: int, elements_per_warp: int = 512, max_warps: int = 16) -> RowLaunch:
    """One program per row with the whole row in one block, or several short rows per
    program so that each program still moves a useful amount of data.

    Warps grow with the row so that each thread keeps ``elements_per_warp / 32`` values:
    the norms (512: 8 warps at 4096, 16 at 8192; with a residual 256, up to 32
    warps) and the quant kernels (1024, at most 8:
    their extra arithmetic per value pays for fewer, busier threads) were tuned on an H200
    (benchmarks/bench_kernels_gpu.py); triton-ascend ignores ``num_warps``.
    """
    block_cols = next_power_of_2(max(cols, 1))
    block_rows = max(1, ROW_TILE_ELEMENTS // block_cols)
    num_warps = min(max_warps, max(4, block_cols * block_rows // elements_per_warp))
    return RowLaunch(block_cols, block_rows, num_warps)


def row_block_problem(cols: int) -> str | None:
    """Why a row of ``cols`` elements is too long for one block, or None."""
    if cols > MAX_ROW_BLOCK:
        return f"rows of {cols} elements exceed the Triton kernel's block of {MAX_ROW_BLOCK}"
    return None

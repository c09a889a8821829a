"""Tile sizes of the softmax-statistics kernel."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StatsConfig:
  """One program walks tiles_per_program tiles of [block_rows, block_cols] f32 logits (128 KiB at
  16 x 2048) in a loop, writes their exponentials and one partial sum, max and argmax per row.
  Sizes are powers of two (Triton's block shapes); edges are masked, so C and V need not be
  multiples of them."""
  block_rows: int = 16
  block_cols: int = 2048
  tiles_per_program: int = 4
  num_warps: int = 8
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_rows", "block_cols", "tiles_per_program", "num_warps"):
      v = getattr(self, name)
      if v < 1 or v & (v - 1):
        raise ValueError(f"StatsConfig.{name}={v} must be a power of two")

"""Tile configurations of the DFlash Pallas-Triton kernels, with presets per GPU family.

Letters as in reference.py; R = query rows of a tile = query tokens x G (the query heads of one
KV head are folded into the rows, so one K/V tile load serves the whole group).

Each kernel has its own tiles because they stress different resources:
  fwd: R rows x `fwd_keys` context keys per step; holds q [R, D] and the f32 accumulator [R, D].
  dq:  same shape as fwd, plus dO [R, D]; also computes the block-key gradients of its blocks.
  dkv: `dkv_keys` context keys x R rows per step; holds k, v [keys, D] and f32 dk, dv [keys, D].
Shared memory per stage is roughly (keys x D x 2 bytes) x 2 (K and V) for fwd/dq and
(R x D x 2) x 2 (q and dO) for dkv, times num_stages, plus the operand tiles held for the loop.
"""

from __future__ import annotations

import dataclasses


def is_pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """Tile sizes (powers of two, >= 16) and Triton launch parameters of the three kernels."""
  fwd_rows: int = 128
  fwd_keys: int = 64
  fwd_warps: int = 8
  fwd_stages: int = 3
  dq_rows: int = 128
  dq_keys: int = 32
  dq_warps: int = 8
  dq_stages: int = 3
  dkv_rows: int = 64
  dkv_keys: int = 128
  dkv_warps: int = 8
  dkv_stages: int = 3

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{f.name}={v!r} must be a positive int")
      if f.name.endswith(("_rows", "_keys")) and (not is_pow2(v) or v < 16):
        raise ValueError(f"{f.name}={v} must be a power of two >= 16 (Triton tile dims)")
      if f.name.endswith("_warps") and not is_pow2(v):
        raise ValueError(f"{f.name}={v} must be a power of two")


# H200 / H100 (228 KB shared memory per SM): 128-row forward tiles over 64 keys, 3 stages; the
# dK/dV kernel keeps 128 keys resident and streams 64-row query tiles, 8 warps, 3 stages
# (measured on the H200 at S=8192/N=1024 sliding, fwd+bwd: 6.7 ms; 64 keys x 4 warps 7.5 ms,
# 128 keys x 4 warps 12.2 ms; the forward tiles were within noise of 128 keys x 2 stages).
# The dQ kernel streams 32-key tiles over 3 stages (6.31 ms in the same run as 6.73 ms for 64
# keys x 2 stages, 6.92 ms for 64 keys x 3 stages, 7.77 ms for 64 keys x 4 warps).
H200 = DFlashConfig()

# ~100 KB of shared memory per SM (RTX PRO 6000 / RTX 5090 class, sm_120): halve the streamed
# tiles and use 2 stages so that K/V (fwd, dq) and q/dO (dkv) double buffers fit.
# (Estimated for bf16 x 128, not measured on such a GPU: fwd ~80 KB, dq ~64 KB, dkv ~80 KB.)
SMEM_100KB = DFlashConfig(fwd_rows=64, fwd_keys=64, fwd_warps=4, fwd_stages=2,
                          dq_rows=64, dq_keys=32, dq_warps=4, dq_stages=2,
                          dkv_rows=32, dkv_keys=32, dkv_warps=4, dkv_stages=2)

# Interpret mode (CPU tests): small tiles so that tiny problems still span several key tiles and
# exercise masked edge tiles, unmasked interior tiles and multiple query tiles.
INTERPRET = DFlashConfig(fwd_rows=16, fwd_keys=16, dq_rows=16, dq_keys=16, dkv_rows=16,
                         dkv_keys=16)


def default_config(*, head_dim: int, dtype_bytes: int = 2, interpret: bool = False,
                   device_kind: str | None = None) -> DFlashConfig:
  """Heuristic: the preset of the GPU family, tuned for bf16 rows of head_dim 128 (256 bytes);
  wider rows (head_dim 256, or f32 inputs) shrink the tiles so shared memory per stage stays
  the same (f32 x 128 with the H200 tiles needs ~256 KB and failed on the H200)."""
  if interpret:
    return INTERPRET
  if device_kind is None:
    import jax
    device_kind = jax.devices()[0].device_kind
  kind = device_kind.upper()
  big_smem = any(name in kind for name in ("H100", "H200", "H800", "H20", "GH200", "A100", "B200"))
  cfg = SMEM_100KB if not big_smem else H200
  # f32 (tests only) also runs its dots on FMA units, whose operand layouts go through shared
  # memory: halve once more.
  factor = max(1, head_dim * dtype_bytes // 256) * (2 if dtype_bytes >= 4 else 1)
  if factor > 1:
    shrink = lambda v: max(16, v // factor)
    cfg = dataclasses.replace(
        cfg, fwd_rows=shrink(cfg.fwd_rows), fwd_keys=shrink(cfg.fwd_keys),
        dq_rows=shrink(cfg.dq_rows), dq_keys=shrink(cfg.dq_keys),
        dkv_rows=shrink(cfg.dkv_rows), dkv_keys=shrink(cfg.dkv_keys),
        fwd_stages=min(cfg.fwd_stages, 2), dq_stages=min(cfg.dq_stages, 2),
        dkv_stages=min(cfg.dkv_stages, 2))
  return cfg

"""Softmax-statistics kernel vs the jnp reference: one suite, run natively on a GPU (`gpu` marker)
and in interpret mode on CPU (a one-line subclass each). Fresh random logits per case; edges that
are not multiples of the tile, ties across and within tiles, shifts far above and below the max;
a second run must be bitwise equal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.softmax_stats import api, config, reference

# e is compared after rounding to out_dtype: the kernel and the reference round the same f32
# value, but their exp may differ by an ulp, which bf16 rounding can turn into one bf16 ulp.
TOLERANCES = {"float32": dict(rtol=2e-6, atol=0.0), "bfloat16": dict(rtol=1e-2, atol=0.0)}
SUM_RTOL = 2e-6     # f32 sums of up to a few thousand terms in another order

# (C, V, block_rows, block_cols): edges that are not multiples of the tile in both directions
CASES = [(16, 1024, 16, 256), (37, 3000, 16, 1024), (5, 700, 8, 128), (24, 4096, 8, 2048),
         (9, 5000, 8, 256)]


def _inputs(seed, C, V, scale=4.0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(C, V)) * scale, jnp.float32)
  shift = x[jnp.arange(C), jnp.asarray(rng.integers(0, V, C))]    # a label's logit, as the CE
  return x, shift


class SoftmaxStatsSuite:
  implementation: str

  def run(self, x, shift, out_dtype, block_rows=16, block_cols=1024):
    cfg = config.StatsConfig(block_rows=block_rows, block_cols=block_cols)
    f = jax.jit(lambda x, s: api.shifted_softmax_stats(
        x, s, out_dtype=out_dtype, implementation=self.implementation, config=cfg))
    return f(x, shift)

  def check(self, got, x, shift, out_dtype):
    e, s, m, i = got
    re, rs, rm, ri = reference.shifted_softmax_stats(x, shift, out_dtype=out_dtype)
    assert e.dtype == jnp.dtype(out_dtype) and s.dtype == m.dtype == jnp.float32
    assert i.dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(e, np.float32), np.asarray(re, np.float32),
                               **TOLERANCES[jnp.dtype(out_dtype).name])
    np.testing.assert_allclose(s, rs, rtol=SUM_RTOL)
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_array_equal(i, ri)

  @pytest.mark.parametrize("case", CASES, ids=str)
  @pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
  def test_matches_reference(self, case, out_dtype):
    C, V, br, bc = case
    x, shift = _inputs(C * 7 + V, C, V)
    got = self.run(x, shift, out_dtype, br, bc)
    self.check(got, x, shift, out_dtype)
    again = self.run(x, shift, out_dtype, br, bc)
    for a, b in zip(got, again):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

  def test_ties_go_to_the_first_index_across_and_within_tiles(self):
    C, V = 8, 1000
    x, shift = _inputs(3, C, V)
    top = float(jnp.max(x)) + 1.0
    ties = [(0, [5, 900]), (1, [130, 131]), (2, [999, 128]), (3, [256, 257, 600]),
            (4, [300, 5])]
    for r, cols in ties:   # tiles of 128 columns, 4 a program: 5 | 900 across programs, 300 | 5
                          # across the tiles of one program, 130 = 131 within a tile
      x = x.at[r, jnp.asarray(cols)].set(top)
    got = self.run(x, shift, "float32", block_rows=8, block_cols=128)
    self.check(got, x, shift, "float32")
    assert np.asarray(got[3])[:5].tolist() == [5, 130, 128, 256, 5]

  def test_shift_above_and_far_below_the_max(self):
    C, V = 16, 2048
    x, _ = _inputs(4, C, V)
    shift = jnp.max(x, axis=1) + jnp.linspace(-55.0, 30.0, C)    # e up to e^55, down to e^-30
    got = self.run(x, shift, "bfloat16", block_cols=512)
    self.check(got, x, shift, "bfloat16")
    assert np.isfinite(np.asarray(got[1])).all()


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
class TestSoftmaxStatsGPU(SoftmaxStatsSuite):
  implementation = "triton"


class TestSoftmaxStatsInterpret(SoftmaxStatsSuite):
  implementation = "interpret"


def test_bad_shapes_and_implementation_are_refused():
  x, s = _inputs(0, 4, 10)
  with pytest.raises(ValueError, match="must be \\[C, V\\]"):
    api.shifted_softmax_stats(x, s[:3])
  with pytest.raises(ValueError, match="implementation="):
    api.shifted_softmax_stats(x, s, implementation="cuda")
  with pytest.raises(ValueError, match="power of two"):
    config.StatsConfig(block_cols=1000)

"""Benchmark of the softmax-statistics kernel against XLA's form of the same work, on a GPU.

  python -m pallas_kernels.softmax_stats.bench [--shapes 1920x248320,8192x49152] [--tiles 16x1024x4,...]

Shapes are LM-head chunks of f32 logits: 1920 x 248320 (the 27b-8k bench case, a Qwen3.6-sized
vocabulary) and 8192 x 49152 (the SmolLM2 GPU recipe). "xla" is what the CE does without the
kernel: the argmax with the row max in one reduction, then exp(logits - max) to bf16 with its row
sum in a second; the kernel reads the logits once (shift = a label's logit). Both rows are
checked against each other first (same argmax and max, sums within 1e-5). GB/s counts the
logits read once and the bf16 exponentials written, the least either form must move.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.softmax_stats import api
from pallas_kernels.softmax_stats import config as config_lib
from pallas_kernels.timing import median_seconds


def xla_form(x_CxV):
  pred = jnp.argmax(x_CxV, axis=-1).astype(jnp.int32)
  top = jnp.take_along_axis(x_CxV, pred[:, None], axis=-1)[:, 0]
  e = jnp.exp(x_CxV - top[:, None])
  return e.astype(jnp.bfloat16), jnp.sum(e, axis=-1), top, pred


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shapes", default="1920x248320,8192x49152")
  ap.add_argument("--tiles", default="16x2048x1x8x1,16x2048x4x8x2,16x2048x8x8x3,8x4096x4x8x2,"
                  "32x1024x4x8x2,16x1024x8x4x2",
                  help="block_rows x block_cols x tiles_per_program x num_warps x num_stages, "
                  "comma-separated")
  a = ap.parse_args(argv)
  for shape in a.shapes.split(","):
    C, V = map(int, shape.split("x"))
    x = jax.random.normal(jax.random.PRNGKey(0), (C, V), jnp.float32) * 4
    shift = x[:, 7]
    moved = C * V * (4 + 2)
    ref = jax.jit(xla_form)
    want = ref(x)
    t = median_seconds(lambda: ref(x))
    print(f"{shape} xla: {t * 1e3:.3f} ms, {moved / t / 1e9:.0f} GB/s", flush=True)
    for tile in a.tiles.split(","):
      br, bc, tp, nw, ns = map(int, tile.split("x"))
      cfg = config_lib.StatsConfig(block_rows=br, block_cols=bc, tiles_per_program=tp,
                                   num_warps=nw, num_stages=ns)
      f = jax.jit(lambda x, s, cfg=cfg: api.shifted_softmax_stats(
          x, s, out_dtype=jnp.bfloat16, implementation="triton", config=cfg))
      got = f(x, shift)
      np.testing.assert_array_equal(got[3], want[3])
      np.testing.assert_array_equal(got[2], want[2])
      lse_got = np.log(np.asarray(got[1], np.float64)) + np.asarray(shift, np.float64)
      lse_want = np.log(np.asarray(want[1], np.float64)) + np.asarray(want[2], np.float64)
      np.testing.assert_allclose(lse_got, lse_want, rtol=1e-5)
      t = median_seconds(lambda: f(x, shift))
      print(f"{shape} kernel {tile}: {t * 1e3:.3f} ms, {moved / t / 1e9:.0f} GB/s", flush=True)


if __name__ == "__main__":
  main()

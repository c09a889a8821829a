import sys, re, jax, jax.numpy as jnp
sys.path.insert(0, '.')
import jax.experimental.mosaic.gpu.core as mcore
from pallas_kernels.dflash_attention import mosaic_gpu as mg
from tests.pallas_kernels.test_mosaic_gpu import _args
def smem_of(fn, args):
  """SMEM of each Mosaic GPU kernel in fn's program, in program order."""
  found, bound = [], 0
  while True:
    mcore._SMEM_SIZE_BOUND = bound
    try:
      jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
      return found
    except Exception as e:
      m = re.search(r"smem_bytes=(\d+)", str(e))
      if not m: raise
      x = int(m.group(1)); found.append(x); bound = max(bound, x)
for D in (128, 64):
  for tiles in (mg.MosaicConfig(), mg.MosaicConfig(fwd_keys=128, dq_keys=128), mg.MosaicConfig(fwd_stages=3, dq_stages=3, dkv_stages=3)):
    def loss(*x):
      return jnp.sum(mg.dflash_attention_mosaic(*x, block_size=16, window=2048, backward="mosaic", tiles=tiles).astype(jnp.float32))
    g = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    print(D, tiles, [round(v / 1024, 1) for v in smem_of(g, _args(16, D, 32, 8, S=1024))], "KiB")

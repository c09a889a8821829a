"""The DFlash attention benchmark with its PyTorch alternatives: compiled flex_attention rows.

  python -m bridge.twin.bench_attention [pallas_kernels.dflash_attention.bench options] [--no-torch]

The kernel's own benchmark (pallas_kernels/dflash_attention/bench.py) imports nothing of the
project above the kernel; this module runs it with the flex rows, built on the twin's attention.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU

import jax.numpy as jnp
import numpy as np

from pallas_kernels.dflash_attention import bench as kernel_bench
from pallas_kernels.dflash_attention.bench import BLOCK, GIB, Row
from pallas_kernels.timing import median_seconds


def bench_flex(xs, idx, *, window, flops_fwd, shape, reps):
  """torch flex_attention (compiled) on the identical mask, through bridge.twin.torch_attention."""
  try:
    import torch
    from bridge.twin import torch_attention
  except ImportError as e:
    return [Row("flex", "-", shape, note=f"bridge.twin.torch_attention unavailable: {e}")]
  dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  layer = "full" if window is None else f"w{window}"
  tq, tkc, tvc, tkb, tvb = (torch.from_numpy(np.array(x.astype(jnp.float32))).to(dev)
                            .to(torch.bfloat16).requires_grad_() for x in xs)
  anchors, doc_start, valid = (torch.from_numpy(np.array(v)).to(dev) for v in idx)
  S = tkc.shape[1]
  kw = dict(block_size=BLOCK, window=window, scale=tq.shape[-1] ** -0.5)

  def timed(fn, backward: bool):
    """Wall time with a device sync, as the JAX rows are timed (launch overhead included)."""
    ct = torch.randn_like(fn()) if backward else None

    def once():
      out = fn()
      if backward:
        torch.autograd.grad(out, (tq, tkc, tvc, tkb, tvb), ct)
    return median_seconds(once, sync=lambda _: torch.cuda.synchronize(), reps=reps)

  from torch.nn.attention.flex_attention import flex_attention
  compiled = torch.compile(flex_attention, dynamic=False)
  block_mask = torch_attention.flex_block_mask(anchors, doc_start, valid, seq_len=S, **{
      k: kw[k] for k in ("block_size", "window")})

  def kernel_only():
    k = torch.cat([tkc, tkb], 1).transpose(1, 2)
    v = torch.cat([tvc, tvb], 1).transpose(1, 2)
    # Back to [B, Q, H, D] as the bridge's call returns it (a cotangent in flex's own [B, H, Q, D]
    # output layout failed compiled flex's backward on the H200: "Mismatch in shape: grad_output").
    return compiled(tq.transpose(1, 2), k, v, block_mask=block_mask, scale=kw["scale"],
                    enable_gqa=True).transpose(1, 2)

  def whole_call():
    return torch_attention.dflash_attention_torch(tq, tkc, tvc, tkb, tvb, anchors, doc_start,
                                                  valid, backend="flex", **kw)
  rows = []
  for name, fn in (("flex", kernel_only), ("flex+mask", whole_call)):
    row = Row(name, layer, shape)
    try:
      cuda = dev.type == "cuda"
      if cuda:
        torch.cuda.reset_peak_memory_stats()
      base = torch.cuda.memory_allocated() if cuda else 0
      t = timed(fn, False)
      row.fwd_ms, row.fwd_tflops = t * 1e3, flops_fwd / t / 1e12
      t = timed(fn, True)
      row.step_ms, row.step_tflops = t * 1e3, 3.5 * flops_fwd / t / 1e12
      if cuda:  # peak over the timed calls, plus the inputs allocated before the reset
        row.mem_gib = (torch.cuda.max_memory_allocated() - base) / GIB + sum(
            x.numel() * x.element_size() for x in (tq, tkc, tvc, tkb, tvb)) / GIB
    except Exception as e:  # noqa: BLE001
      row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    rows.append(row)
  return rows


if __name__ == "__main__":
  kernel_bench.main(torch_rows=bench_flex)

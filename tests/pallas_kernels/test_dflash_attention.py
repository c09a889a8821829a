"""DFlash attention kernel vs the dense-mask reference: one suite, run natively on a GPU (`gpu`
marker) and in interpret mode on CPU (a one-line subclass each).

Each case checks, in one jitted forward + jax.vjp (random cotangent): the output and the five
input gradients against the reference in f32 at HIGHEST precision; gradients w.r.t. keys that no
query may see (and dq of invalid blocks) are exactly zero; a second run is bitwise equal.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dflash_attention import api, config, reference
from pallas_kernels.dflash_attention import triton as dflash_triton
from pallas_kernels.dflash_attention.reference import visible_pairs

# One place for tolerances, compared after dividing by max(1, max|expected|). bf16 inputs: the
# kernel rounds p and ds to bf16 for the MMAs and writes bf16 outputs, like any flash kernel.
TOLERANCES = {
    "float32": dict(atol=5e-5, rtol=5e-5),
    "bfloat16": dict(atol=3e-2, rtol=3e-2),
}


@dataclasses.dataclass(frozen=True)
class Case:
  block_size: int = 16
  window: int | None = None
  hq: int = 4
  hkv: int = 2
  head_dim: int = 64
  dtype: str = "float32"
  batch: int = 1
  blocks: int = 4
  seq_len: int = 80
  anchors: str = "random"   # random | edges (0, equal, row end, overlapping)
  invalid_row: bool = False  # last row has no valid block
  docs: int = 3              # documents packed in a row

  def __str__(self):
    w = "full" if self.window is None else f"w{self.window}"
    return (f"K{self.block_size}-{w}-g{self.hq // self.hkv}-d{self.head_dim}-{self.dtype}"
            f"-B{self.batch}N{self.blocks}S{self.seq_len}-{self.anchors}"
            f"{'-invalidrow' if self.invalid_row else ''}-docs{self.docs}")


# Small on purpose: interpret mode compiles every case (CI is a 2-core CPU).
CASES = [
    Case(),
    Case(window=24, hq=4, hkv=1, dtype="bfloat16", anchors="edges"),
    Case(block_size=8, window=1, hq=2, hkv=2, batch=2, invalid_row=True),
    Case(block_size=10, window=1000, hq=4, hkv=2, head_dim=128, docs=1),
    Case(block_size=10, hq=4, hkv=1, dtype="bfloat16", blocks=3, seq_len=50, anchors="edges"),
    Case(block_size=8, window=24, hq=4, hkv=1, blocks=6, seq_len=100, docs=4),
    Case(block_size=16, hq=8, hkv=2, dtype="bfloat16", head_dim=128, batch=2, invalid_row=True),
    # Groups that are not a power of two (SmolLM2's 9 query heads over 3 KV heads: G = 3 = 1 x 3
    # repeats; G = 6 = 2 x 3) and a head size that is not one (80: zero-padded to 128).
    Case(hq=9, hkv=3, window=24, anchors="edges"),
    Case(block_size=8, hq=6, hkv=1, head_dim=80, dtype="bfloat16", blocks=3, seq_len=60),
]
# Larger shapes where the kernels are compiled natively (fast on a GPU).
GPU_CASES = [
    Case(window=256, hq=8, hkv=2, head_dim=128, dtype="bfloat16", batch=2, blocks=64,
         seq_len=1500, docs=5),
    Case(hq=8, hkv=2, head_dim=128, dtype="bfloat16", blocks=64, seq_len=1500, docs=2),
    Case(block_size=10, window=100, hq=4, hkv=4, head_dim=64, dtype="float32", blocks=40,
         seq_len=700, anchors="edges"),
    Case(hq=9, hkv=3, head_dim=64, dtype="bfloat16", batch=2, blocks=64, seq_len=1500, docs=4),
]


def make_inputs(case: Case, seed: int = 0):
  """Fresh random q/k/v and indices obeying the contract (sorted valid anchors, packed docs)."""
  rng = np.random.default_rng(seed)
  B, N, K, S = case.batch, case.blocks, case.block_size, case.seq_len
  dt = jnp.dtype(case.dtype)
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(keys[0], (B, N * K, case.hq, case.head_dim), dt)
  kc = jax.random.normal(keys[1], (B, S, case.hkv, case.head_dim), dt)
  vc = jax.random.normal(keys[2], (B, S, case.hkv, case.head_dim), dt)
  kb = jax.random.normal(keys[3], (B, N * K, case.hkv, case.head_dim), dt)
  vb = jax.random.normal(keys[4], (B, N * K, case.hkv, case.head_dim), dt)
  anchors = np.zeros((B, N), np.int32)
  doc_start = np.zeros((B, N), np.int32)
  valid = rng.random((B, N)) < 0.85
  for b in range(B):
    starts = np.unique(np.concatenate([[0], rng.integers(1, S, case.docs - 1)]))
    if case.anchors == "edges":
      # Row start, equal anchors, overlapping blocks (consecutive positions), row end.
      mid = int(rng.integers(1, S - N))
      a = np.sort(np.concatenate([[0, 0, S - 1, S - 1], mid + np.arange(N - 4)]))[:N]
    else:
      a = np.sort(rng.integers(0, S, N))
    anchors[b] = a
    doc_start[b] = starts[np.searchsorted(starts, a, side="right") - 1]
  if case.invalid_row:
    valid[-1] = False
  # Invalid blocks carry garbage indices: the kernel must ignore them.
  anchors = np.where(valid, anchors, rng.integers(0, S, (B, N))).astype(np.int32)
  return (q, kc, vc, kb, vb), (jnp.asarray(anchors), jnp.asarray(doc_start), jnp.asarray(valid))


def _assert_close(actual, expected, *, atol, rtol, what):
  actual = np.asarray(actual, np.float32)
  expected = np.asarray(expected, np.float32)
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  norm = max(1.0, float(np.abs(expected).max()))
  np.testing.assert_allclose(actual / norm, expected / norm, atol=atol, rtol=rtol, err_msg=what)


def _hidden_keys(case: Case, anchors, doc_start, valid):
  """Masks of context keys [B, S] and block keys [B, N*K] that no query may see."""
  cm = reference.context_mask(anchors, doc_start, valid, block_size=case.block_size,
                              window=case.window, seq_len=case.seq_len)  # [B, N, K, S]
  bm = reference.block_mask(valid, block_size=case.block_size, window=case.window)  # [B,N,K,K]
  ctx_hidden = ~np.asarray(cm).any(axis=(1, 2))
  blk_hidden = ~np.asarray(bm).any(axis=2).reshape(case.batch, -1)
  return ctx_hidden, blk_hidden


class DFlashAttentionSuite:
  """Subclasses set `interpret`; `cases` are the parameterisation."""
  interpret: bool

  def run_case(self, case: Case):
    (q, kc, vc, kb, vb), (anchors, doc_start, valid) = make_inputs(case)
    kw = dict(block_size=case.block_size, window=case.window)

    def kernel(*x):
      return api.dflash_attention(*x, anchors, doc_start, valid, implementation="triton",
                                  interpret=self.interpret, **kw)

    def oracle(*x):
      return reference.dflash_attention_reference(*x, anchors, doc_start, valid, **kw)

    ct = jax.random.normal(jax.random.PRNGKey(7), q.shape, q.dtype)

    @jax.jit
    def fwd_bwd(*x):
      out, vjp = jax.vjp(kernel, *x)
      return out, vjp(ct)

    out, grads = fwd_bwd(q, kc, vc, kb, vb)
    out2, grads2 = fwd_bwd(q, kc, vc, kb, vb)
    ref_out, ref_vjp = jax.vjp(oracle, q, kc, vc, kb, vb)
    ref_grads = ref_vjp(ct)

    tol = TOLERANCES[case.dtype]
    _assert_close(out, ref_out, what="out", **tol)
    for name, g, r in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), grads, ref_grads):
      assert g.dtype == r.dtype, name
      _assert_close(g, r, what=name, **tol)

    # Keys nobody may see get exactly zero gradient; invalid blocks output 0 and get dq = 0.
    ctx_hidden, blk_hidden = _hidden_keys(case, anchors, doc_start, valid)
    for name, g, hidden in (("dk_ctx", grads[1], ctx_hidden), ("dv_ctx", grads[2], ctx_hidden),
                            ("dk_blk", grads[3], blk_hidden), ("dv_blk", grads[4], blk_hidden)):
      assert np.all(np.asarray(g, np.float32)[hidden] == 0), f"{name}: hidden keys get gradient"
    invalid_q = np.repeat(~np.asarray(valid), case.block_size, axis=1)
    assert np.all(np.asarray(out, np.float32)[invalid_q] == 0), "invalid blocks must output 0"
    assert np.all(np.asarray(grads[0], np.float32)[invalid_q] == 0), "invalid blocks: dq != 0"

    # Deterministic: no atomics, so a second run is bitwise equal.
    for a, b in zip((out, *grads), (out2, *grads2)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  @pytest.mark.parametrize("case", CASES, ids=str)
  def test_matches_reference(self, case):
    self.run_case(case)


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
class TestDFlashAttentionGPU(DFlashAttentionSuite):
  interpret = False

  @pytest.mark.parametrize("case", GPU_CASES, ids=str)
  def test_matches_reference_large(self, case):
    self.run_case(case)


class TestDFlashAttentionInterpret(DFlashAttentionSuite):
  interpret = True


def test_forward_kernel_with_reference_backward():
  """backward="reference" lets the forward kernel be used (and tested) without its backward."""
  case = Case(window=24)
  (q, kc, vc, kb, vb), idx = make_inputs(case, seed=3)
  kw = dict(block_size=case.block_size, window=case.window)
  ct = jax.random.normal(jax.random.PRNGKey(1), q.shape, q.dtype)
  f = lambda *x: api.dflash_attention(*x, *idx, implementation="triton", interpret=True,
                                      backward="reference", **kw)
  g = lambda *x: reference.dflash_attention_reference(*x, *idx, **kw)
  def fwd_bwd(fn, *x):
    out, vjp = jax.vjp(fn, *x)
    return out, vjp(ct)
  out, grads = jax.jit(functools.partial(fwd_bwd, f))(q, kc, vc, kb, vb)
  ref_out, ref = fwd_bwd(g, q, kc, vc, kb, vb)
  _assert_close(out, ref_out, what="out (forward kernel)", **TOLERANCES["float32"])
  for a, b in zip(grads, ref):
    _assert_close(a, b, what="grad", **TOLERANCES["float32"])


@pytest.mark.parametrize("block_size,head_dim,window,Hq,Hkv", [
    (16, 128, 2048, 8, 2), (10, 64, None, 8, 2), (8, 256, 64, 8, 2), (16, 64, None, 9, 3)])
def test_lowers_for_cuda(block_size, head_dim, window, Hq, Hkv):
  """Lowering-only check on CPU: Pallas -> Triton IR for CUDA with the H200 tiles, forward and
  backward. Power-of-two violations and ops without a Triton lowering fail here, in CI. (The
  Triton -> PTX compile itself needs the GPU toolchain and runs in the gpu tests.)"""
  B, N, S = 1, 8, 300
  sd = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  args = (sd((B, N * block_size, Hq, head_dim), bf), sd((B, S, Hkv, head_dim), bf),
          sd((B, S, Hkv, head_dim), bf), sd((B, N * block_size, Hkv, head_dim), bf),
          sd((B, N * block_size, Hkv, head_dim), bf), sd((B, N), jnp.int32),
          sd((B, N), jnp.int32), sd((B, N), jnp.bool_))

  def loss(q, kc, vc, kb, vb, a, ds, valid):
    out = dflash_triton.dflash_attention_triton(
        q, kc, vc, kb, vb, a, ds, valid, block_size=block_size, window=window,
        config=config.H200)
    return jnp.sum(out.astype(jnp.float32))

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args).lower(
      lowering_platforms=("cuda",))
  text = lowered.as_text()
  for kernel in ("dflash_fwd", "dflash_bwd_dq", "dflash_bwd_dkv"):
    assert kernel in text, f"the {kernel} Triton kernel is missing from the lowered program"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_visible_pairs_counts_the_mask(case):
  """The benchmarks' FLOP count (index arithmetic) equals the dense masks' count, documents and
  invalid blocks included."""
  _, (anchors, doc_start, valid) = make_inputs(case)
  kw = dict(block_size=case.block_size, window=case.window)
  dense = (int(reference.context_mask(anchors, doc_start, valid, seq_len=case.seq_len, **kw).sum())
           + int(reference.block_mask(valid, **kw).sum()))
  assert reference.visible_pairs(anchors, doc_start, valid, **kw) == dense


def test_every_group_and_head_size_runs_on_the_kernels(monkeypatch, caplog):
  """G = 3 and head size 80 take the kernels (no silent dense fallback: that path holds the full
  [Q, S] score matrices, and a recipe with SmolLM2's 9/3 heads ran on it unnoticed); the only
  unsupported input, mixed dtypes, raises for implementation="triton" and falls back to XLA with
  a warning for the default implementation."""
  case = Case(hq=6, hkv=2, head_dim=80)
  x, idx = make_inputs(case)
  calls = []
  real = dflash_triton._dflash
  monkeypatch.setattr(dflash_triton, "_dflash", lambda *a: (calls.append(a[0].shape), real(*a))[1])
  api.dflash_attention(*x, *idx, block_size=16, implementation="triton", interpret=True)
  assert calls == [(1, 64, 6, 128)]            # heads as given, head size padded to 128
  mixed = (x[0].astype(jnp.bfloat16),) + x[1:]
  with pytest.raises(NotImplementedError, match="dtype"):
    api.dflash_attention(*mixed, *idx, block_size=16, implementation="triton", interpret=True)
  monkeypatch.setattr(api, "default_implementation", lambda head_dim=None: "triton")
  api._warned.clear()
  with caplog.at_level("WARNING"):
    out = api.dflash_attention(*mixed, *idx, block_size=16)
  assert out.shape == x[0].shape
  assert "dense XLA path" in caplog.text and "dtype" in caplog.text


def test_visible_keys_hand_counted():
  a = np.array([[3, 6]])
  count = lambda a, K, w: visible_pairs(a, np.zeros_like(a), block_size=K, window=w)
  # Full layer, K=2: each query sees a context keys + 2 block keys: (3+2)*2 + (6+2)*2.
  assert count(a, 2, None) == 26
  # Sliding window 2, K=2: offset o sees a - max(0, a+o-1) context keys (1, 0) + o+1 block keys.
  assert count(a, 2, 2) == (1 + 0 + 1 + 2) * 2
  # Anchor 0 with a full layer sees no context.
  assert count(np.array([[0]]), 4, None) == 16

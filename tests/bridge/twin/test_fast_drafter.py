"""bridge/twin/fast_drafter.py: the best-effort step's loss and gradients equal the reference
drafter's (same weights, same batch) in f32 on the CPU, uncompiled and compiled."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge.twin import reference_drafter as ref
from bridge.twin.fast_drafter import FastDrafterStep, rope_tables
from jax_drafter import objective, presets
from jax_drafter.tools import plans

# Same math, other order of operations (fused q/k/v, the LM head only on supervised rows, the
# rotation written out): f32 summation order only.
LOSS_TOL = dict(atol=1e-6, rtol=1e-6)
GRAD_TOL = dict(atol=1e-6, rtol=1e-5)
# Compiled flex_attention against eager attention: another kernel's reduction order over the
# keys (measured on the CPU at head size 32, three layers deep: up to 2.4e-6 absolute on hidden
# states of median magnitude 0.67; atol 1e-6 with rtol 1e-4 misses by 2%, so atol is 2e-6).
FLEX_TOL = dict(atol=2e-6, rtol=1e-4)

# tiny-parity (sliding window 6 + full), 3 layers so that two layers share a compiled graph.
CFG = dataclasses.replace(presets.get("tiny-parity"), num_hidden_layers=3,
                          layer_types=("sliding_attention", "full_attention", "sliding_attention"))
B, S, N = 2, 48, 6


def _setup(seed=0, cfg=CFG):
  torch.manual_seed(seed)
  model = ref.build_reference(cfg, attention="eager")
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
  micro, frozen = plans.packed_batch(cfg, B, S, N, seed, torch.float32, torch.device("cpu"))
  a, v = objective.sample_anchors(jax.random.key(seed), jnp.asarray(micro["loss_mask"].numpy()),
                                  jnp.asarray(micro["doc_id"].numpy()), N)
  a, v = torch.from_numpy(np.array(a)), torch.from_numpy(np.array(v))
  assert not v.all(), "the batch must have invalid blocks"
  return model, micro, frozen, a, v


def _reference(model, micro, frozen, a, v):
  sums = ref.micro_sums(model, micro, frozen, a, v, gamma=7.0, chunk_size=16)
  loss = sums["wce"] / sums["w"]
  model.zero_grad(set_to_none=True)
  loss.backward()
  return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _fast(model, micro, frozen, a, v, **kw):
  step = FastDrafterStep(CFG, compute_dtype=torch.float32, gamma=7.0, ce_rows=16, **kw)
  params = dict(model.named_parameters())
  loss = step.loss(params, micro, frozen["embed"], frozen["lm_head"], a, v)
  model.zero_grad(set_to_none=True)
  loss.backward()
  return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}, step


def _assert_same(fast, want):
  (loss_f, grads_f), (loss_r, grads_r) = fast, want
  torch.testing.assert_close(loss_f, loss_r, **LOSS_TOL)
  assert grads_f.keys() == grads_r.keys()
  for k in grads_r:
    assert grads_r[k].abs().max() > 0, k          # every parameter takes part
    torch.testing.assert_close(grads_f[k], grads_r[k], **GRAD_TOL, msg=k)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_loss_and_grads_equal_the_reference(attention):
  model, micro, frozen, a, v = _setup()
  want = _reference(model, micro, frozen, a, v)
  loss, grads, step = _fast(model, micro, frozen, a, v, attention=attention, compiled=False)
  _assert_same((loss, grads), want)
  # Only supervised rows reach the LM head: no offset-0 row, no row of an invalid block.
  blocks = ref.build_blocks(a, v, micro["input_ids"], micro["loss_mask"], micro["doc_id"],
                            micro["position_ids"], block_size=CFG.block_size,
                            mask_token_id=CFG.mask_token_id, gamma=7.0)
  assert step.last_rows == int((blocks.weights > 0).sum()) < B * N * (CFG.block_size - 1)


def test_compiled_step_equals_the_reference():
  """torch.compile'd layers (inductor on the CPU, sdpa inside), context, norm and CE softmax."""
  model, micro, frozen, a, v = _setup(seed=1)
  want = _reference(model, micro, frozen, a, v)
  _assert_same(_fast(model, micro, frozen, a, v, attention="sdpa", compiled=True)[:2], want)


def test_rope_tables_rotate_as_the_reference():
  pos = torch.tensor([[0, 1, 5, 4000]])
  cos, sin = rope_tables(pos, 16, 1e7, torch.float32)
  rot = ref.Qwen3RotaryEmbedding(ref.qwen3_config(dataclasses.replace(CFG, rope_theta=1e7,
                                                                       head_dim=16)))
  want_cos, want_sin = rot(torch.zeros(()), pos)
  torch.testing.assert_close(torch.cat([cos, cos], -1), want_cos, atol=0, rtol=0)
  torch.testing.assert_close(torch.cat([sin, sin], -1), want_sin, atol=0, rtol=0)


def test_unknown_attention_is_an_error():
  with pytest.raises(ValueError, match="attention='cudnn'"):
    FastDrafterStep(CFG, compute_dtype=torch.float32, attention="cudnn", compiled=False,
                    gamma=7.0, ce_rows=16)


def test_compiled_flex_layers_equal_eager_and_compile_once():
  """The GPU path's graphs (flex_attention inside the compiled layer, a new BlockMask every step),
  forward only: torch has no flex_attention backward on the CPU. New anchors at each step must
  not recompile: the timed steps would time the compiler.

  Head size 32, not tiny's 16: torch 2.13's compiled CPU flex_attention returns wrong values (NaN
  where a block has few keys) at head size 16 on AVX2 machines, with or without GQA, on some masks
  (measured: 15 of 20 random block masks against uncompiled flex); sizes 32 and 64 match on all 20.
  Drafters' heads are 64 or 128 and their flex path runs on the GPU."""
  from torch._dynamo.utils import counters
  cfg = dataclasses.replace(CFG, head_dim=32)
  model, micro, frozen, a, v = _setup(seed=2, cfg=cfg)
  params = {k: p.detach() for k, p in model.named_parameters()}
  kw = dict(compute_dtype=torch.float32, gamma=7.0, ce_rows=16)
  flex = FastDrafterStep(cfg, attention="flex", compiled=True, **kw)
  eager = FastDrafterStep(cfg, attention="eager", compiled=False, **kw)
  graphs = []
  for i in range(2):
    blocks = ref.build_blocks(torch.where(v, (a + i).clamp(max=S - 2), a), v, micro["input_ids"],
                              micro["loss_mask"], micro["doc_id"], micro["position_ids"],
                              block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, gamma=7.0)
    with torch.no_grad():
      got = flex.hidden(params, micro, frozen["embed"], blocks)
      want = eager.hidden(params, micro, frozen["embed"], blocks)
    torch.testing.assert_close(got, want, **FLEX_TOL)
    graphs.append(counters["stats"]["unique_graphs"])
  assert graphs[1] == graphs[0]

"""bridge/twin/linear_ce.py: the fused chunked linear + CE equals autograd through F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F

from bridge.twin.linear_ce import linear_cross_entropy

TOL = dict(atol=1e-5, rtol=1e-5)   # f32, different summation order only


def _problem(T=37, D=16, V=50, seed=0):
  g = torch.Generator().manual_seed(seed)
  h = torch.randn(T, D, generator=g)
  w = torch.randn(V, D, generator=g) * 0.5
  y = torch.randint(0, V, (T,), generator=g)
  ct = torch.rand(T, generator=g) + 0.5          # a per-row cotangent (the loss weights)
  return h, w, y, ct


@pytest.mark.parametrize("rows", [8, 37, 64])   # a padded last chunk, one exact chunk, one short
def test_ce_argmax_and_grad_equal_plain_cross_entropy(rows):
  h, w, y, ct = _problem()
  h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
  w1 = w.clone().requires_grad_()
  ce, pred = linear_cross_entropy(h1, w1, y, rows=rows)
  want = F.cross_entropy(h2 @ w.T, y, reduction="none")
  torch.testing.assert_close(ce, want, **TOL)
  assert torch.equal(pred, (h @ w.T).argmax(-1))
  (ce * ct).sum().backward()
  (want * ct).sum().backward()
  torch.testing.assert_close(h1.grad, h2.grad, **TOL)
  assert w1.grad is None                         # the head is frozen: no gradient formed for it
  assert not pred.requires_grad


def test_two_lm_head_matmuls_in_the_forward_none_in_the_backward():
  """The point of the fused CE: logits and dh in the forward (2 matmuls of T x D x V), and a
  backward that only scales the saved dh; the checkpointed chunks of the reference CE redo the
  logits in their backward (3 in all)."""
  from torch.utils.flop_counter import FlopCounterMode
  from bridge.twin.reference_drafter import chunked_cross_entropy
  T, D, V = 32, 16, 50
  h, w, y, ct = _problem(T=T, D=D, V=V, seed=1)
  matmul = 2 * T * D * V
  for fn, fwd, bwd in ((lambda x: linear_cross_entropy(x, w, y, rows=16), 2, 0),
                       (lambda x: chunked_cross_entropy(x, w, y, chunk_size=16), 1, 2)):
    h1 = h.clone().requires_grad_()
    with FlopCounterMode(display=False) as f_fwd:
      ce, _ = fn(h1)
    with FlopCounterMode(display=False) as f_bwd:
      (ce * ct).sum().backward()
    assert (f_fwd.get_total_flops(), f_bwd.get_total_flops()) == (fwd * matmul, bwd * matmul)


def test_bf16_operands_match_plain_cross_entropy_to_bf16_rounding():
  h, w, y, ct = _problem(T=40, D=32, V=64, seed=2)
  hb = h.bfloat16().requires_grad_()
  ce, _ = linear_cross_entropy(hb, w.bfloat16(), y, rows=16)
  (ce * ct).sum().backward()
  h32 = h.bfloat16().float().requires_grad_()
  want = F.cross_entropy(h32 @ w.bfloat16().float().T, y, reduction="none")
  (want * ct).sum().backward()
  torch.testing.assert_close(ce, want, atol=5e-2, rtol=2e-2)
  torch.testing.assert_close(hb.grad.float(), h32.grad, atol=3e-2, rtol=3e-2)


def test_bad_shapes_raise():
  h, w, y, _ = _problem()
  with pytest.raises(ValueError, match="rows=0"):
    linear_cross_entropy(h, w, y, rows=0)
  with pytest.raises(ValueError, match="labels"):
    linear_cross_entropy(h, w, y[:-1], rows=8)

"""Chunked linear + cross entropy against a frozen LM head, its gradient made in the forward.

The torch twin of jax_drafter/objective.py's fused CE (its custom_vjp): each chunk of C rows makes
its [C, V] logits once, in the forward, and turns them at once into the CE, the argmax and
dCE/dh [C, D]; the backward only scales the saved [T, D] gradient by the incoming per-row
cotangent. One chunk of logits is alive at a time, and the LM head costs two matmuls per row
(logits, dh). Checkpointed chunks (reference_drafter.chunked_cross_entropy) cost three (logits,
logits again in the backward, dh), each with its own passes over the f32 logits.

Precision, as JAX: operands in h's dtype; logits f32 (f32 accumulation, and f32 output where the
backend offers it: `logits_dtype`); softmax statistics f32; dCE/dlogits rounded to h's dtype for
the dh matmul, dh kept in h's dtype. The head gets no gradient (it is frozen).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def softmax_grad(logits_CxV, y_C, grad_dtype: torch.dtype):
  """(CE f32 [C], argmax [C], dCE/dlogits = softmax - onehot [C, V] in grad_dtype) of f32 logits.
  Compiled, this is one reduction pass and one elementwise pass over the logits."""
  lse_C = torch.logsumexp(logits_CxV, dim=-1)
  gold_C = logits_CxV.gather(1, y_C[:, None])[:, 0]
  pred_C = logits_CxV.argmax(dim=-1)
  p_CxV = torch.exp(logits_CxV - lse_C[:, None])
  hit = torch.arange(logits_CxV.shape[1], device=y_C.device)[None, :] == y_C[:, None]
  return lse_C - gold_C, pred_C, torch.where(hit, p_CxV - 1.0, p_CxV).to(grad_dtype)


@functools.cache
def compiled_softmax_grad():
  # One static shape per run: the last chunk is padded to C rows (see LinearCrossEntropy).
  return torch.compile(softmax_grad, dynamic=False)


@functools.cache
def _mm_has_f32_out(device_type: str) -> bool:
  """Does torch.mm take out_dtype=float32 for bf16 operands on this device (CUDA, torch >= 2.8)?"""
  a = torch.ones(16, 32, dtype=torch.bfloat16, device=device_type)
  try:   # a transposed operand, as the logits matmul has
    return torch.mm(a, a.T, out_dtype=torch.float32).dtype == torch.float32
  except Exception:  # noqa: BLE001 - any refusal means: no such matmul here
    return False


def logits_dtype(h: torch.Tensor) -> str:
  """How the logits are made from h's dtype: 'float32' (as JAX's preferred_element_type=f32) or
  'bfloat16 rounded' where the backend has no f32-output matmul for bf16 operands."""
  if h.dtype == torch.float32 or _mm_has_f32_out(h.device.type):
    return "float32"
  return f"{str(h.dtype).removeprefix('torch.')} rounded"


def _logits(h_CxD, w_VxD):
  if h_CxD.dtype == torch.float32:
    return h_CxD @ w_VxD.T
  if _mm_has_f32_out(h_CxD.device.type):
    return torch.mm(h_CxD, w_VxD.T, out_dtype=torch.float32)
  return (h_CxD @ w_VxD.T).float()


class LinearCrossEntropy(torch.autograd.Function):
  """(ce f32 [T], pred int64 [T]) = CE and argmax of h_TxD @ w_VxD.T against labels_T."""

  @staticmethod
  def forward(ctx, h_TxD, w_VxD, labels_T, rows: int, compiled: bool):
    T, _ = h_TxD.shape
    w = w_VxD.detach().to(h_TxD.dtype)
    fn = compiled_softmax_grad() if compiled else softmax_grad
    ce = torch.empty(T, dtype=torch.float32, device=h_TxD.device)
    pred = torch.empty(T, dtype=torch.long, device=h_TxD.device)
    dh = torch.empty_like(h_TxD)
    for s in range(0, T, rows):
      h_c, y_c = h_TxD[s:s + rows], labels_T[s:s + rows]
      n = h_c.shape[0]
      if n < rows:   # pad the last chunk: one shape for the compiled softmax_grad
        h_c, y_c = F.pad(h_c, (0, 0, 0, rows - n)), F.pad(y_c, (0, rows - n))
      ce_c, pred_c, d_CxV = fn(_logits(h_c, w), y_c, h_TxD.dtype)
      ce[s:s + n], pred[s:s + n] = ce_c[:n], pred_c[:n]
      dh[s:s + n] = d_CxV[:n] @ w
      del d_CxV   # before the next chunk's logits
    ctx.save_for_backward(dh)
    ctx.mark_non_differentiable(pred)
    return ce, pred

  @staticmethod
  def backward(ctx, g_ce, g_pred):
    (dh,) = ctx.saved_tensors
    return (dh.float() * g_ce[:, None]).to(dh.dtype), None, None, None, None


def linear_cross_entropy(h_TxD, w_VxD, labels_T, *, rows: int, compiled: bool = False):
  """Per-row CE f32 [T] and argmax [T] against the frozen head, `rows` rows of logits at a time.
  compiled: run the per-chunk softmax part through torch.compile (GPU); the matmuls are cuBLAS
  calls either way."""
  if rows < 1:
    raise ValueError(f"{rows=} must be >= 1")
  if h_TxD.ndim != 2 or labels_T.shape != h_TxD.shape[:1]:
    raise ValueError(f"h {tuple(h_TxD.shape)} must be [T, D] with labels [T], got labels "
                     f"{tuple(labels_T.shape)}")
  return LinearCrossEntropy.apply(h_TxD, w_VxD, labels_T, rows, compiled)

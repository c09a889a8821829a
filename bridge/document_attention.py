"""Document-causal attention for the target's packed rows through torch's flex_attention.

A packed row holds several documents; each token may attend only to earlier tokens of its own
document. The default path (bridge.target) hands the target's SDPA a dense boolean mask
[B, 1, S, S]: O(S^2) bytes per row (a 64k-token row: 4 GiB) and a kernel that visits every masked
tile. Here the same mask is a flex_attention BlockMask built from the rows' document ids: only the
tiles on the block diagonal are computed and nothing of size S^2 is stored.

    with documents(model):
        model.model(input_ids=..., position_ids=..., attention_mask=block_mask(doc_id))

On CUDA flex_attention runs compiled (torch.compile, once per shape); on a CPU it runs eagerly,
which materialises the scores (fine for tests, not for speed: the CPU default keeps SDPA).
"""

from __future__ import annotations

import contextlib
import threading

import torch

NAME = "packed_documents"   # no "flash" in the name: transformers treats those as flash-attn kernels
_lock = threading.Lock()
_compiled: dict[str, object] = {}


def _compiled_on_cuda(fn, on_cuda: bool, **compile_kw):
  """fn itself on a CPU (eager); on CUDA one torch.compile of it per process."""
  if not on_cuda:
    return fn
  with _lock:
    if fn.__name__ not in _compiled:
      _compiled[fn.__name__] = torch.compile(fn, **compile_kw)
  return _compiled[fn.__name__]


def _flex(on_cuda: bool):
  from torch.nn.attention.flex_attention import flex_attention
  return _compiled_on_cuda(flex_attention, on_cuda, dynamic=False)


def block_mask(doc_BxS: torch.Tensor):
  """The BlockMask of document-causal attention for rows whose tokens carry document ids: token q
  sees token k iff k <= q and both belong to the same document."""
  from torch.nn.attention.flex_attention import create_block_mask
  doc = doc_BxS
  B, S = doc.shape

  def same_document_causal(b, h, q, k):
    return (q >= k) & (doc[b, q] == doc[b, k])

  # Compiled on CUDA: the eager builder evaluates the mask on the whole [B, S, S] grid at once.
  build = _compiled_on_cuda(create_block_mask, doc.is_cuda)
  return build(same_document_causal, B, None, S, S, device=doc.device)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
  """transformers attention function: query [B, Hq, S, Dh], key/value [B, Hkv, S, Dh] and a
  BlockMask -> ([B, S, Hq, Dh], None), grouped-query heads without copying K/V."""
  from torch.nn.attention.flex_attention import BlockMask
  if not isinstance(attention_mask, BlockMask):
    raise TypeError(f"{NAME} attention needs a flex_attention BlockMask (document_attention."
                    f"block_mask), got {type(attention_mask).__name__}")
  if dropout:
    raise ValueError("the frozen target runs without attention dropout")
  out = _flex(query.is_cuda)(query, key, value, block_mask=attention_mask, scale=scaling,
                             enable_gqa=query.shape[1] != key.shape[1])
  return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def documents(model):
  """The model's attention switched to document-causal flex_attention inside the block, then back
  (the same model also decodes with its own attention: regeneration, evaluation)."""
  from transformers import AttentionInterface
  from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
  AttentionInterface.register(NAME, _attention)
  # A 4-D BlockMask passed as attention_mask is used as given; the mask function is never called
  # for it, but transformers looks the name up.
  AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
  previous = model.config._attn_implementation
  model.set_attn_implementation(NAME)
  try:
    yield
  finally:
    model.set_attn_implementation(previous)

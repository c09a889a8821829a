"""Shifted softmax statistics of a block of logits, in plain jnp: the math, the CPU path and the
test oracle of the Triton kernel.

Letters: C rows (tokens), V columns (the vocabulary).

For logits x [C, V] and a per-row shift s [C] (any value within ~60 of the row's max: the cross
entropy passes the label's own logit, which is known before the row max is),
  e      = exp(x - s)          [C, V] in out_dtype (the operand of the LM head's gradient matmul)
  sum_e  = sum(e)              [C] f32 (summed from the f32 values, before any rounding)
  max    = max(x)              [C] f32
  argmax = first index of max  [C] int32 (jnp.argmax's tie rule)
so log-sum-exp = s + log(sum_e), and with s = x[label], the cross entropy is log(sum_e) itself.
"""

from __future__ import annotations

import jax.numpy as jnp


def shifted_softmax_stats(x_CxV, shift_C, *, out_dtype=jnp.float32):
  x = x_CxV.astype(jnp.float32)
  e = jnp.exp(x - shift_C.astype(jnp.float32)[:, None])
  return (e.astype(out_dtype), jnp.sum(e, axis=-1), jnp.max(x, axis=-1),
          jnp.argmax(x, axis=-1).astype(jnp.int32))

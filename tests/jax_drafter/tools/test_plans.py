"""The plans' synthetic inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_drafter import objective, presets
from jax_drafter.tools import plans


def test_batch_has_packed_rows_and_invalid_blocks():
  p = presets.RUNS["tiny-parity"]
  cfg = presets.get(p.arch)
  micro, _ = plans.packed_batch(cfg, p.batch, p.seq_len, p.anchors, 0, torch.float32, "cpu")
  assert all(len(np.unique(row)) == 2 for row in micro["doc_id"].numpy())
  _, valid = objective.sample_anchors(jax.random.key(0), jnp.asarray(micro["loss_mask"].numpy()),
                                      jnp.asarray(micro["doc_id"].numpy()), p.anchors)
  assert np.asarray(valid)[0].all() and not np.asarray(valid)[1].all()

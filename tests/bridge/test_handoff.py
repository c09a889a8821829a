"""The DLPack handoff: zero-copy by pointer, dtype kept, bad tensors refused with a clear error."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge.handoff import Handoff, HandoffError, fresh_for_import, padded_row_chunks, to_jax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_zero_copy_and_dtype_kept(dtype):
  t = (torch.arange(4 * 64) % 7).to(dtype).reshape(4, 64)
  a = to_jax(t)
  assert a.unsafe_buffer_pointer() == t.data_ptr()
  assert a.dtype == {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16,
                     torch.int32: jnp.int32}[dtype]
  np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), t.float().numpy())


def test_non_contiguous_is_refused_with_a_clear_error():
  t = torch.randn(16, 32).t()
  with pytest.raises(HandoffError, match="not contiguous.*contiguous\\(\\)"):
    to_jax(t, name="features")


def test_misaligned_view_and_grad_and_int64_are_refused():
  with pytest.raises(HandoffError, match="aligned"):
    to_jax(torch.randn(65)[1:])
  with pytest.raises(HandoffError, match="requires grad"):
    to_jax(torch.randn(4, requires_grad=True))
  with pytest.raises(HandoffError, match="int32"):
    to_jax(torch.arange(8))


def test_handoff_keeps_tensors_alive_until_results_are_ready():
  h = Handoff()
  t = torch.randn(8, 16)
  x = h.put(t)
  del t
  y = jax.jit(lambda v: v * 2)(x)
  assert len(h) == 1
  h.release_after(y)
  assert len(h) == 0
  assert np.isfinite(np.asarray(y)).all()


def test_fresh_for_import_copies_only_when_needed():
  t = torch.randn(64, 64)
  assert fresh_for_import(t).data_ptr() == t.data_ptr()   # no copy
  view = torch.randn(64 * 64 + 1)[1:].view(64, 64)
  fresh = fresh_for_import(view)
  assert fresh.data_ptr() != view.data_ptr() and fresh.data_ptr() % 64 == 0
  assert to_jax(fresh).unsafe_buffer_pointer() == fresh.data_ptr()
  torch.testing.assert_close(fresh, view)


def test_split_placement_copies_explicitly_to_the_drafter_device(tmp_path):
  """Two host devices stand in for two GPUs: the import is zero-copy on device 0, then one
  explicit copy lands on the drafter's device 1; the torch tensor is kept until release."""
  code = (
      "import jax, torch, numpy as np\n"
      "from bridge.handoff import Handoff\n"
      "d1 = jax.devices()[1]\n"
      "h = Handoff(); t = torch.arange(64, dtype=torch.float32).reshape(8, 8)\n"
      "x = h.put(t, device=d1)\n"
      "assert x.devices() == {d1}, x.devices()\n"
      "y = jax.jit(lambda v: v + 1)(x)\n"
      "assert len(h) == 1; h.release_after(y); assert len(h) == 0\n"
      "np.testing.assert_array_equal(np.asarray(y), t.numpy() + 1)\n"
      "z = Handoff().put(t, device=jax.devices()[0])\n"
      "assert z.unsafe_buffer_pointer() == t.data_ptr()\n"
      "print('ok')\n")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                     timeout=120)
  assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]


def test_padded_row_chunks_share_one_shape_and_keep_the_rows():
  t = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
  chunks = padded_row_chunks(t, 4)
  assert [tuple(c.shape) for c in chunks] == [(4, 3), (4, 3)]
  torch.testing.assert_close(torch.cat(chunks)[:7], t)
  assert torch.count_nonzero(chunks[1][3:]) == 0 and all(c.is_contiguous() for c in chunks)
  assert chunks[0].data_ptr() == t.data_ptr()   # full chunks stay views: only the last is copied
  exact = padded_row_chunks(t[:4], 2)
  assert len(exact) == 2 and exact[0].data_ptr() == t.data_ptr()   # a multiple: views, no copy
  with pytest.raises(ValueError, match="rows"):
    padded_row_chunks(t, 0)

"""bridge/twin/weights.py: weights between the Flax drafter, the PyTorch reference and z-lab
directories."""

import numpy as np
import pytest
from flax import nnx

from bridge.twin import reference_drafter as ref
from bridge.twin.weights import flat_from_torch, load_zlab_into
from jax_drafter import export, presets
from jax_drafter.model import Drafter
from jax_drafter.params import to_flat
from jax_drafter.tools import parity

CFG = presets.get("tiny-parity")


def _params(seed=0):
  return nnx.split(Drafter(CFG, rngs=nnx.Rngs(seed)), nnx.Param)[1]


def test_zlab_dir_loads_into_reference_and_matches(tmp_path, capsys):
  export.write_zlab(str(tmp_path), CFG, _params(3))
  model = ref.build_reference(CFG)
  load_zlab_into(model, str(tmp_path))        # strict: no missing or unexpected keys
  # The torch loader (file layout as is) and the JAX reader (transposes) agree on every weight;
  # a layout bug in either path shows here, square matrices included.
  _, _, params = export.read_zlab(str(tmp_path))
  got, want = flat_from_torch(model.state_dict()), to_flat(params)
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], np.asarray(want[k], np.float32), err_msg=k)
  # Same outputs: parity of the exported weights (JAX reads the directory, torch loads it).
  assert parity.main(["--zlab", str(tmp_path), "--steps", "0"]) == 0, capsys.readouterr().out


def test_torch_flax_round_trip():
  from bridge.twin.weights import flat_from_torch, load_flat_into
  from jax_drafter.params import from_flat
  flat = {k: np.asarray(v) for k, v in to_flat(_params(5)).items()}
  model = ref.build_reference(CFG)
  load_flat_into(model, flat)
  assert model.layers[0].self_attn.q_proj.weight.shape == (64, 64)
  back = flat_from_torch(model.state_dict())
  _, params = from_flat(CFG, back)
  for k, v in to_flat(params).items():
    np.testing.assert_array_equal(np.asarray(v), flat[k], err_msg=k)
  with pytest.raises(ValueError, match="missing weight 'norm.weight'"):
    load_flat_into(model, {k: v for k, v in flat.items() if k != "norm.weight"})

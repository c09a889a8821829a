"""Export to the z-lab directory format and back; the PyTorch reference loads it strictly."""

import json

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from bridge.twin import reference_drafter as ref
from bridge.weights import flat_from_torch, load_zlab_into
from jax_drafter import export, presets
from jax_drafter.config import TrainSection
from jax_drafter.model import Drafter
from jax_drafter.params import to_flat
from jax_drafter.tools import parity

CFG = presets.get("tiny-parity")


def _params(seed=0):
  return nnx.split(Drafter(CFG, rngs=nnx.Rngs(seed)), nnx.Param)[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip(tmp_path, dtype):
  params = _params()
  export.write_zlab(str(tmp_path), CFG, params, dtype=dtype)
  conf = json.loads((tmp_path / "config.json").read_text())
  assert conf["dflash_config"]["target_layer_ids"] == list(CFG.target_layer_ids)
  assert conf["torch_dtype"] == dtype
  raw = load_file(str(tmp_path / "model.safetensors"))
  assert raw["layers.0.self_attn.q_proj.weight"].shape == (64, 64)           # [out, in]
  assert raw["layers.0.mlp.down_proj.weight"].shape == (64, 128)
  assert not any("embed" in k or "lm_head" in k for k in raw)
  cfg2, _, params2 = export.read_zlab(str(tmp_path))
  assert cfg2 == CFG
  a, b = to_flat(params), to_flat(params2)
  assert a.keys() == b.keys()
  for k in a:
    want = np.asarray(a[k], np.float32)
    if dtype == "bfloat16":
      want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(b[k]), want, err_msg=k)


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


def test_bad_files_name_the_key(tmp_path):
  export.write_zlab(str(tmp_path), CFG, _params(), dtype="float32")
  path = str(tmp_path / "model.safetensors")
  good = load_file(path)
  bad = dict(good)
  del bad["layers.1.self_attn.k_norm.weight"]
  save_file(bad, path)
  with pytest.raises(ValueError, match="missing weight 'layers.1.self_attn.k_norm.weight'"):
    export.read_zlab(str(tmp_path))
  with pytest.raises(ValueError, match="missing weight 'layers.1.self_attn.k_norm.weight'"):
    load_zlab_into(ref.build_reference(CFG), str(tmp_path))
  bad = dict(good, **{"embed_tokens.weight": np.zeros((256, 64), np.float32)})
  save_file(bad, path)
  with pytest.raises(ValueError, match="unexpected weight 'embed_tokens.weight'"):
    export.read_zlab(str(tmp_path))
  bad = dict(good, **{"fc.weight": good["fc.weight"].T.copy()})               # [in, out]: wrong
  save_file(bad, path)
  with pytest.raises(ValueError, match="'fc.weight' has shape"):
    export.read_zlab(str(tmp_path))


def test_cli_exports_a_checkpoint(tmp_path):
  from jax_drafter import checkpoint, step
  t = TrainSection(steps=2, warmup_steps=1)
  graphdef, state = step.init_state(CFG, t, step.make_optimizer(t))
  checkpoint.save(checkpoint.manager(str(tmp_path / "run")), state,
                  {"drafter_config": CFG.to_zlab()})
  out = tmp_path / "export"
  assert export.main(["--run-dir", str(tmp_path / "run"), "--out", str(out),
                      "--dtype", "float32"]) == 0
  _, _, params = export.read_zlab(str(out))
  for k, v in to_flat(state.params).items():
    np.testing.assert_array_equal(np.asarray(to_flat(params)[k]), np.asarray(v), err_msg=k)
  assert export.main(["--run-dir", str(tmp_path / "nothing"), "--out", str(out)]) == 1


def test_torch_flax_round_trip():
  from bridge.weights import flat_from_torch, load_flat_into
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

"""Export to the z-lab directory format and back; bad files name the offending key."""

import json

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from bridge.twin import reference_drafter as ref
from bridge.twin.weights import load_zlab_into
from jax_drafter import export, presets
from jax_drafter.config import TrainSection
from jax_drafter.model import Drafter
from jax_drafter.params import to_flat

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




def test_export_files_are_readable_by_others(tmp_path):
  """safetensors writes 0600; an export gets the mode of any new file under the umask."""
  import os
  export.write_zlab(str(tmp_path), CFG, _params())
  umask = os.umask(0)
  os.umask(umask)
  for name in ("model.safetensors", "config.json"):
    assert os.stat(tmp_path / name).st_mode & 0o777 == 0o666 & ~umask, name

"""train.compute_dtype and target.dtype "auto": bfloat16 where the devices multiply it natively."""

from pathlib import Path

import pytest

from jax_drafter import config as config_lib
from jax_drafter.config import (ConfigError, build_config, resolve_compute_dtype,
                                resolve_target_dtype)

AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
AVX512BF16 = "flags\t\t: fpu avx2 avx512f avx512_bf16\n"
PLAIN = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\nbugs\t\t: spectre_v1\n"


@pytest.mark.parametrize("cpuinfo, native", [(AMX, True), (AVX512BF16, True), (PLAIN, False),
                                             ("", False)])
def test_cpu_bf16_flags(cpuinfo, native):
  assert config_lib.cpu_has_native_bf16(cpuinfo) is native


@pytest.mark.parametrize("platform, native, want", [
    ("gpu", False, "bfloat16"), ("cpu", True, "bfloat16"), ("cpu", False, "float32")])
def test_auto_resolves_by_device(monkeypatch, platform, native, want):
  monkeypatch.setattr(config_lib, "cpu_has_native_bf16", lambda cpuinfo=None: native)
  cfg = resolve_compute_dtype(build_config({"train": {"compute_dtype": "auto"}}), platform)
  assert cfg.train.compute_dtype == want


def test_auto_follows_the_named_drafter_device(monkeypatch):
  monkeypatch.setattr(config_lib, "cpu_has_native_bf16", lambda cpuinfo=None: False)
  cfg = build_config({"train": {"compute_dtype": "auto", "devices": ["cuda:1"]}})
  assert resolve_compute_dtype(cfg).train.compute_dtype == "bfloat16"
  cfg = build_config({"train": {"compute_dtype": "auto", "devices": ["cpu"]}})
  assert resolve_compute_dtype(cfg).train.compute_dtype == "float32"


@pytest.mark.parametrize("target, native, want", [
    ({"device": "cuda:1"}, False, "bfloat16"), ({"devices": ["cuda:0", "cuda:1"]}, False, "bfloat16"),
    ({"device": "cpu"}, True, "bfloat16"), ({"device": "cpu"}, False, "float32"),
    ({"device": "cuda"}, False, "bfloat16"), ({"devices": ["cpu:1"]}, False, "float32")])
def test_target_auto_follows_the_target_device(monkeypatch, target, native, want):
  monkeypatch.setattr(config_lib, "cpu_has_native_bf16", lambda cpuinfo=None: native)
  cfg = build_config({"target": {"dtype": "auto", **target}})
  assert resolve_target_dtype(cfg).target.dtype == want
  # the drafter's compute dtype is its own setting
  assert resolve_target_dtype(cfg).train == cfg.train


def test_target_auto_on_an_auto_device_asks_torch(monkeypatch):
  import torch
  monkeypatch.setattr(config_lib, "cpu_has_native_bf16", lambda cpuinfo=None: False)
  monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
  assert config_lib.load_config(None, ["target.dtype=auto"]).target.dtype == "float32"
  monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
  assert config_lib.load_config(None, ["target.dtype=auto"]).target.dtype == "bfloat16"
  with pytest.raises(ConfigError, match="target.dtype='float16'"):
    config_lib.load_config(None, ["target.dtype=float16"])
  # a caller's own meaning of "auto" (the overfit gate's float32); a named dtype is kept
  load = lambda dt: config_lib.load_config(None, [f"target.dtype={dt}"],
                                           auto_target_dtype="float32").target.dtype
  assert load("auto") == "float32" and load("bfloat16") == "bfloat16"


def test_explicit_dtypes_are_kept_and_auto_never_survives_loading(monkeypatch):
  monkeypatch.setattr(config_lib, "cpu_has_native_bf16", lambda cpuinfo=None: True)
  for dt in ("float32", "bfloat16"):
    cfg = build_config({"train": {"compute_dtype": dt}})
    assert resolve_compute_dtype(cfg, "gpu").train.compute_dtype == dt
  # Native bf16 patched in: "auto" loads as bfloat16 whether JAX sees a GPU or a CPU.
  loaded = config_lib.load_config(None, ["train.compute_dtype=auto"])
  assert loaded.train.compute_dtype == "bfloat16"


def test_unknown_compute_dtype_is_a_config_error():
  with pytest.raises(ConfigError, match="train.compute_dtype='float16'.*'auto'"):
    build_config({"train": {"compute_dtype": "float16"}})


def test_attention_implementation_is_checked_against_the_kernels_list():
  from pallas_kernels.dflash_attention import api
  assert set(config_lib.ATTENTION_IMPLEMENTATIONS) == set(api.IMPLEMENTATIONS)
  for name in api.IMPLEMENTATIONS:
    assert config_lib.TrainSection(attention=name).attention == name
  with pytest.raises(ConfigError, match="train.attention='flash'"):
    config_lib.TrainSection(attention="flash")


def test_negative_feature_cache_sizes_are_config_errors():
  for key in ("feature_cache_gib", "feature_cache_host_gib"):
    with pytest.raises(ConfigError, match=f"target.{key}=-1 must be >= 0"):
      build_config({"target": {key: -1}})


def test_synthetic_prompt_settings_are_checked():
  with pytest.raises(ConfigError, match="data.synthetic_prompts=10 needs data.regenerate: true"):
    build_config({"data": {"synthetic_prompts": 10}})
  with pytest.raises(ConfigError, match="synthetic_prompt_temperature=0.*must be > 0"):
    build_config({"data": {"synthetic_prompts": 10, "regenerate": True,
                           "synthetic_prompt_temperature": 0}})
  with pytest.raises(ConfigError, match="data.synthetic_prompts=-1 must be >= 0"):
    build_config({"data": {"synthetic_prompts": -1}})
  assert build_config({"data": {"synthetic_prompts": 10, "regenerate": True}}).data.synthetic_prompts == 10


_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_configs_are_found():
  assert {p.name for p in _CONFIGS} >= {"smollm2.yaml", "smollm2-h200.yaml"}


@pytest.mark.parametrize("path", _CONFIGS, ids=lambda p: p.name)
def test_the_shipped_configs_load_and_pass_the_input_checks(path):
  """What the README tells users to run: every shipped config is valid as committed."""
  from jax_drafter import inputs
  cfg = config_lib.load_config(str(path), [])
  inputs.check_inputs(cfg)

"""python -m jax_drafter.cache_features, then training from the cache (`data.features`): the losses
of online training, no target model until evaluation, resume, refusals, regenerated answers."""

import collections
import json
import os
import shutil

import pytest
import yaml

from bridge import feature_store, target_files
from bridge import target as target_lib
from jax_drafter import cache_features, inputs, trainer

from tiny_fixtures import run_losses, tiny_run_config

# A bf16 target: its features are bf16 already, so the cache stores exactly what the target
# computed and a run from it must reproduce the online run bit for bit (a float32 target's
# features are rounded to bf16 once; tests/bridge/test_feature_store.py checks that rounding).
BF16 = ("target.dtype=bfloat16", "train.steps=3")


def cli(cfg, out, *args, tmp):
  """Runs the CLI on `cfg` (written out as a YAML config)."""
  path = os.path.join(tmp, "config.yaml")
  with open(path, "w") as f:
    yaml.safe_dump(json.loads(json.dumps(cfg.to_dict())), f)
  return cache_features.main(["--config", path, "--out", str(out), "--quiet", *args])


@pytest.fixture(scope="module")
def cache(tiny_target_dir, sharegpt_sample, tmp_path_factory):
  tmp = tmp_path_factory.mktemp("cache")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, tmp / "run", *BF16)
  assert cli(cfg, tmp / "features", tmp=tmp) == 0
  return str(tmp / "features")


def count_target_loads(monkeypatch):
  """Counts loads of the full model, wherever they come from."""
  calls = []
  real = target_lib.load_target

  def counted(*a, **k):
    calls.append(a)
    return real(*a, **k)

  monkeypatch.setattr(target_lib, "load_target", counted)
  monkeypatch.setattr(target_files, "load_target", counted)
  return calls


def test_training_from_the_cache_gives_the_online_losses(tiny_target_dir, sharegpt_sample, cache,
                                                         tmp_path, monkeypatch):
  online, cached = str(tmp_path / "online"), str(tmp_path / "cached")
  trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, online, *BF16))
  loads = count_target_loads(monkeypatch)
  summary = trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, cached, *BF16,
                                          f"data.features={cache}"))
  assert loads == [] and isinstance(summary["target"], target_files.TargetFiles)
  a, b = run_losses(online), run_losses(cached)
  assert sorted(a) == [1, 2, 3] and a == b     # bit-identical inputs: equal, not merely close


def test_evaluation_loads_the_target_when_it_runs(tiny_target_dir, sharegpt_sample, cache,
                                                  tmp_path, monkeypatch):
  loads = count_target_loads(monkeypatch)
  during = []
  progress = trainer.Progress(update=lambda step, m: during.append(len(loads)))
  summary = trainer.train(tiny_run_config(
      tiny_target_dir, sharegpt_sample, str(tmp_path / "eval"), *BF16, "train.steps=2",
      f"data.features={cache}", "train.eval_prompts=1", "train.eval_max_new_tokens=4"),
      progress=progress)
  assert during == [0, 0] and len(loads) == 1           # training without it, evaluation with it
  assert summary["eval_report"]["lossless"]["passed"] is True


def test_an_interrupted_cache_resumes_to_the_same_bytes(tiny_target_dir, sharegpt_sample, tmp_path,
                                                        monkeypatch):
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, tmp_path / "run",
                        "data.max_conversations=12")
  whole, part = tmp_path / "whole", tmp_path / "part"
  assert cli(cfg, whole, "--shard-rows", "2", tmp=tmp_path) == 0     # one batch of 2 per shard
  real = target_lib.Target.features
  calls = collections.Counter()

  def dies_at_third_batch(self, *a, **k):
    calls["n"] += 1
    if calls["n"] == 3:
      raise KeyboardInterrupt
    return real(self, *a, **k)

  monkeypatch.setattr(target_lib.Target, "features", dies_at_third_batch)
  assert cli(cfg, part, "--shard-rows", "2", tmp=tmp_path) == 130
  assert len(feature_store.read_manifest(str(part))["shards"]) == 2
  monkeypatch.setattr(target_lib.Target, "features", real)
  assert cli(cfg, part, "--shard-rows", "2", tmp=tmp_path) == 0
  names = sorted(os.listdir(whole))
  assert len(names) > 3 and names == sorted(os.listdir(part))
  for name in names:
    assert (part / name).read_bytes() == (whole / name).read_bytes(), name


def test_a_cache_made_with_other_settings_is_refused(tiny_target_dir, sharegpt_sample, cache,
                                                     tmp_path):
  def setup(*extra, target=tiny_target_dir):
    inputs.setup(tiny_run_config(target, sharegpt_sample, tmp_path / "run", *BF16,
                                  f"data.features={cache}", *extra))

  with pytest.raises(feature_store.CacheError, match="seq_len=96, this run has data.seq_len=80"):
    setup("data.seq_len=80")
  with pytest.raises(feature_store.CacheError, match=r"drafter.target_layer_ids=\[1, 1\]"):
    setup("drafter.target_layer_ids=[0, 2]")
  with pytest.raises(feature_store.CacheError, match="target.dtype='bfloat16'"):
    setup("target.dtype=float32")
  with pytest.raises(feature_store.CacheError, match="data.max_conversations=40"):
    setup("data.max_conversations=30")
  other = tmp_path / "other_target"
  shutil.copytree(tiny_target_dir, other)
  from safetensors.torch import load_file, save_file
  w = load_file(other / "model.safetensors")
  w["model.layers.0.self_attn.q_proj.weight"][0, 0] += 1.0
  save_file(w, other / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(feature_store.CacheError, match="made with another target"):
    setup(target=str(other))
  with pytest.raises(feature_store.CacheError, match="holds no feature cache"):
    inputs.setup(tiny_run_config(tiny_target_dir, sharegpt_sample, tmp_path / "run",
                                  f"data.features={tmp_path}"))


def test_too_little_disk_is_refused_before_writing(tiny_target_dir, sharegpt_sample, tmp_path,
                                                   monkeypatch, capsys):
  usage = collections.namedtuple("usage", "total used free")
  monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 0, 1000))
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, tmp_path / "run")
  assert cli(cfg, tmp_path / "features", tmp=tmp_path) == 2
  out, err = capsys.readouterr()
  assert "x 2 bytes (bf16)" in out and "free" in out        # what it needs, said first
  assert "not enough disk" in err and "1000 B are free" in err
  assert os.listdir(tmp_path / "features") == []


def test_regenerated_answers_train_from_the_cache_without_the_model(
    tiny_target_dir, sharegpt_sample, tmp_path, monkeypatch):
  regen = ("data.regenerate=true", "data.regenerate_max_new_tokens=8", "data.max_conversations=6",
           "data.held_out=1", f"data.cache_dir={tmp_path / 'data'}", "train.steps=1")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, tmp_path / "run", *regen)
  assert cli(cfg, tmp_path / "features", tmp=tmp_path) == 0
  loads = count_target_loads(monkeypatch)
  trained = tiny_run_config(tiny_target_dir, sharegpt_sample, tmp_path / "run", *regen,
                            f"data.features={tmp_path / 'features'}")
  assert trainer.train(trained)["final_step"] == 1 and loads == []
  # Without the regenerated answers the rows cannot be rebuilt, and the model is not there to
  # generate them again: refused, naming the regeneration cache.
  shutil.rmtree(tmp_path / "data")
  from bridge.regenerate import RegenerationError
  with pytest.raises(RegenerationError, match="not in the regeneration cache"):
    inputs.setup(trained)


def test_an_empty_features_path_is_a_config_error():
  from jax_drafter.config import ConfigError, load_config
  with pytest.raises(ConfigError, match="data.features is empty"):
    load_config(None, ["data.features=''"])
  assert load_config(None, ["data.features=/x"]).data.features == "/x"


def test_validation_rows_are_cached_and_validate_like_online(tiny_target_dir, sharegpt_sample,
                                                            tmp_path):
  val = ("data.validation=6", "train.val_every=2")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, tmp_path / "run", *BF16, *val)
  assert cli(cfg, tmp_path / "features", tmp=str(tmp_path)) == 0
  online = trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, str(tmp_path / "on"),
                                         *BF16, *val))
  cached = trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, str(tmp_path / "off"),
                                         *BF16, *val, f"data.features={tmp_path / 'features'}"))
  assert [v["step"] for v in cached["validations"]] == [2, 3]
  assert cached["validations"] == online["validations"]

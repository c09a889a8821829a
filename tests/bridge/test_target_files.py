"""The target read from its files without the model: the same info, embedding and LM head as the
loaded model (tied, untied, sharded, bf16), a fingerprint of the files, the model built lazily."""

import dataclasses
import os
import shutil

import pytest
import torch

from bridge import target_files
from bridge.target import Target, TargetError, load_target


def assert_like_the_loaded_model(files, target):
  assert dataclasses.replace(files.info, name="") == dataclasses.replace(target.info, name="")
  assert files.embedding.dtype == target.embedding.dtype
  assert torch.equal(files.embedding, target.embedding)
  assert torch.equal(files.lm_head, target.lm_head)


def test_tied_target_matches_the_loaded_model(tiny_target_dir):
  files = target_files.TargetFiles(tiny_target_dir, device="cpu")
  assert_like_the_loaded_model(files, load_target(tiny_target_dir, device="cpu"))
  assert files.lm_head is files.embedding          # one tensor: imported once, as when loaded
  assert files.tokenizer.chat_template
  with pytest.raises(TargetError, match="layer id 4 is out of range"):
    files.check_layer_ids([1, 4])


@pytest.fixture(scope="module")
def untied_sharded_dir(tmp_path_factory, smollm2_tokenizer):
  from transformers import LlamaConfig, LlamaForCausalLM
  d = tmp_path_factory.mktemp("untied")
  torch.manual_seed(1)
  cfg = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=16, intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    max_position_embeddings=256, tie_word_embeddings=False)
  LlamaForCausalLM(cfg).save_pretrained(d, max_shard_size="1MB")
  smollm2_tokenizer.save_pretrained(d)
  return str(d)


def test_untied_sharded_bf16_target_matches_the_loaded_model(untied_sharded_dir):
  assert os.path.exists(os.path.join(untied_sharded_dir, "model.safetensors.index.json"))
  files = target_files.TargetFiles(untied_sharded_dir, dtype="bfloat16", device="cpu")
  target = load_target(untied_sharded_dir, dtype="bfloat16", device="cpu")
  assert_like_the_loaded_model(files, target)
  assert not torch.equal(files.lm_head, files.embedding)


def test_the_model_is_built_on_first_use_only(tiny_target_dir, monkeypatch):
  calls = []
  real = target_files.load_target
  monkeypatch.setattr(target_files, "load_target", lambda *a, **k: calls.append(a) or real(*a, **k))
  files = target_files.load_without_model(tiny_target_dir, device="cpu")
  assert isinstance(files, target_files.TargetFiles) and calls == []
  model = files.load_model()
  assert isinstance(model, Target) and files.load_model() is model and len(calls) == 1


def test_fingerprint_follows_the_files_not_their_place(tiny_target_dir, tmp_path):
  from safetensors.torch import load_file, save_file
  copy = tmp_path / "copy"
  shutil.copytree(tiny_target_dir, copy)
  (copy / "README.md").write_text("notes do not change the target")
  fp = target_files.fingerprint(tiny_target_dir)
  assert target_files.fingerprint(str(copy)) == fp
  weights = load_file(copy / "model.safetensors")
  weights["model.layers.3.mlp.up_proj.weight"][0, 0] += 1.0   # one weight of the last layer
  save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
  assert target_files.fingerprint(str(copy)) != fp
  shutil.copyfile(os.path.join(tiny_target_dir, "model.safetensors"), copy / "model.safetensors")
  (copy / "tokenizer_config.json").write_text(
      (copy / "tokenizer_config.json").read_text().replace('"model_max_length"', '"x"'))
  assert target_files.fingerprint(str(copy)) != fp                 # the tokenizer is part of it


def test_decoder_layers_read_from_the_files_are_the_loaded_models(untied_sharded_dir):
  """What train.init_from_target_layers copies, read from the sharded files without building
  the model, equals what the loaded model holds (bf16 checkpoint, as float32 arrays)."""
  files = target_files.TargetFiles(untied_sharded_dir, dtype="bfloat16", device="cpu")
  target = load_target(untied_sharded_dir, dtype="bfloat16", device="cpu")
  got, want = files.decoder_layer_arrays([1, 0]), target.decoder_layer_arrays([1, 0])
  assert sorted(got) == sorted(want) and "layers.0.mlp.up_proj.weight" in got
  for name in want:
    assert (got[name] == want[name]).all(), name
  assert (got["layers.0.self_attn.q_proj.weight"]
          == target.model.model.layers[1].self_attn.q_proj.weight.float().numpy()).all()
  with pytest.raises(TargetError, match="out of range"):
    files.decoder_layer_arrays([2])

"""train.init_from_target_layers: drafter layers that start as copies of target decoder layers.

The copies are checked by what they compute, against the target's own torch modules: the first
drafter layer's context K/V are the K/V that the copied target layer makes of its input (the
feature of the layer below it), its MLP and norms are the target's, and the final norm is the
target's. A wrong transpose of a square projection or a wrong name fails these."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from bridge.target import Target, TargetError, load_target
from jax_drafter import target_init
from jax_drafter import train as train_cli
from jax_drafter.config import ConfigError, DrafterConfig, load_config
from jax_drafter.export import read_zlab
from jax_drafter.export import main as export_main
from jax_drafter.model import Drafter, rope
from jax_drafter.params import to_flat

from tiny_fixtures import VOCAB, TinyTokenizer, tiny_run_config, tiny_target  # noqa: F401

D, HQ, HKV, DH, FF, LAYERS = 64, 4, 2, 16, 128, 4


def _qwen3_target():
  """A tiny random Qwen3 (q_norm/k_norm in every layer), norms randomised so that copying one
  norm in place of another shows."""
  from transformers import Qwen3Config, Qwen3ForCausalLM
  torch.manual_seed(0)
  conf = Qwen3Config(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS,
                     num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=DH,
                     max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
  model = Qwen3ForCausalLM(conf).float()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.uniform_(0.5, 1.5)
  return Target(model, TinyTokenizer(), "tiny-qwen3")


def _drafter_config(layers=2, target_layer_ids=(0, 1), intermediate=FF):
  return DrafterConfig(hidden_size=D, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=DH,
                       vocab_size=VOCAB, num_target_layers=LAYERS,
                       target_layer_ids=target_layer_ids, mask_token_id=VOCAB - 1, block_size=4,
                       rope_theta=10000.0, rms_norm_eps=1e-6)


def _fresh(cfg):
  return nnx.split(Drafter(cfg, rngs=nnx.Rngs(0)), nnx.Param)


def test_the_first_layer_reads_the_context_as_the_copied_target_layer_reads_its_input():
  target = _qwen3_target()
  cfg = _drafter_config()
  graphdef, fresh = _fresh(cfg)
  before = {k: np.asarray(v) for k, v in to_flat(fresh).items()}
  params = target_init.from_target_layers(fresh, cfg, target.decoder_layer_arrays([2, 3]), [2, 3])
  for k, v in to_flat(fresh).items():            # the caller's state is left as it was
    np.testing.assert_array_equal(np.asarray(v), before[k])
  model = nnx.merge(graphdef, params)

  # Target features of layers 0 and 1 (the drafter's target_layer_ids) for one sequence.
  S = 12
  ids = torch.randint(0, VOCAB - 1, (1, S))
  pos = torch.arange(S)[None]
  with torch.no_grad():
    hs = target.model(ids, position_ids=pos, output_hidden_states=True).hidden_states
  h0, h1 = hs[1], hs[2]                 # outputs of decoder layers 0 and 1
  feat = jnp.asarray(torch.cat([h0, h1], -1).numpy())
  ctx = model.hidden_norm(model.fc(feat))   # fc is the identity on layer 1's feature

  layer2 = target.model.model.layers[2]
  with torch.no_grad():
    x = layer2.input_layernorm(h1)
    k_t = layer2.self_attn.k_norm(layer2.self_attn.k_proj(x).view(1, S, HKV, DH))
    v_t = layer2.self_attn.v_proj(x).view(1, S, HKV, DH)
    q_t = layer2.self_attn.q_norm(layer2.self_attn.q_proj(x).view(1, S, HQ, DH))
  k, v = model.layers[0].self_attn.context_kv(ctx, jnp.asarray(pos.numpy()))
  np.testing.assert_allclose(np.asarray(v), v_t.numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(k), np.asarray(rope(jnp.asarray(k_t.numpy()),
                                                            jnp.asarray(pos.numpy()), 10000.0)),
                             rtol=1e-4, atol=1e-5)
  attn = model.layers[0].self_attn
  q = attn.q_norm(attn.q_proj(ctx).reshape(1, S, HQ, DH))
  np.testing.assert_allclose(np.asarray(q), q_t.numpy(), rtol=1e-4, atol=1e-5)

  # The second drafter layer is target layer 3: its MLP, post-attention norm and o_proj.
  layer3 = target.model.model.layers[3]
  r = torch.randn(1, S, D)
  rj = jnp.asarray(r.numpy())
  with torch.no_grad():
    want_mlp = layer3.mlp(layer3.post_attention_layernorm(r)).numpy()
    want_o = layer3.self_attn.o_proj(r).numpy()
    want_norm = target.model.model.norm(r).numpy()
  second = model.layers[1]
  np.testing.assert_allclose(np.asarray(second.mlp(second.post_attention_layernorm(rj))), want_mlp,
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(second.self_attn.o_proj(rj)), want_o, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(model.norm(rj)), want_norm, rtol=1e-4, atol=1e-5)


def test_the_context_feature_is_the_input_of_the_first_copied_layer():
  assert target_init.context_feature((1, 8, 14, 20, 27), 15) == 2      # layer 14 feeds layer 15
  assert target_init.context_feature((1, 8, 14, 20, 27), 28) == 4
  assert target_init.context_feature((27, 1, 14), 20) == 2             # order as configured
  assert target_init.context_feature((8, 14), 3) == 0                  # none below: the lowest


def test_a_llama_target_keeps_the_drafters_own_q_k_norms(tiny_target):
  cfg = _drafter_config(layers=1, target_layer_ids=(1,))
  _, fresh = _fresh(cfg)
  arrays = tiny_target.decoder_layer_arrays([2])
  assert not any("q_norm" in k or "k_norm" in k for k in arrays)
  params = to_flat(target_init.from_target_layers(fresh, cfg, arrays, [2]))
  np.testing.assert_array_equal(np.asarray(params["layers.0.self_attn.q_norm.weight"]), 1.0)
  np.testing.assert_array_equal(np.asarray(params["layers.0.mlp.up_proj.weight"]),
                                arrays["layers.0.mlp.up_proj.weight"].T)


def test_sizes_that_differ_from_the_target_name_the_field(tiny_target):
  cfg = _drafter_config(layers=1, target_layer_ids=(1,), intermediate=96)
  _, fresh = _fresh(cfg)
  with pytest.raises(ConfigError, match="intermediate_size"):
    target_init.from_target_layers(fresh, cfg, tiny_target.decoder_layer_arrays([2]), [2])
  with pytest.raises(TargetError, match="out of range"):
    tiny_target.decoder_layer_arrays([4])


def test_a_layer_without_the_usual_projections_is_refused(tiny_target):
  layer = tiny_target.model.model.layers[1]
  mlp = layer.mlp
  del layer.mlp
  try:
    with pytest.raises(TargetError, match="decoder layer 1 has no mlp.gate_proj"):
      tiny_target.decoder_layer_arrays([1])
  finally:
    layer.mlp = mlp


def test_a_gated_attention_layer_is_refused_by_name(tiny_target):
  """A Qwen3.5-style q_proj (queries and output gates, twice o_proj's input) is named as such,
  not reported as a head-count mismatch."""
  attn = tiny_target.model.model.layers[2].self_attn
  q = attn.q_proj
  attn.q_proj = torch.nn.Linear(q.in_features, 2 * q.out_features, bias=False)
  try:
    with pytest.raises(TargetError, match="decoder layer 2's attention has an output gate"):
      tiny_target.decoder_layer_arrays([2])
  finally:
    attn.q_proj = q
  tiny_target.decoder_layer_arrays([2])


def test_the_config_wants_one_layer_per_drafter_layer():
  with pytest.raises(ConfigError, match="one target layer id"):
    load_config(None, ["drafter.num_hidden_layers=2", "train.init_from_target_layers=[3]"])
  assert load_config(None, ["drafter.num_hidden_layers=2",
                            "train.init_from_target_layers=[3, 4]"]).train.init_from_target_layers == (3, 4)


def test_a_training_run_starts_from_the_copies(tiny_target_dir, sharegpt_sample, tmp_path):
  """The train CLI with the option: after two steps at a vanishing learning rate the exported
  drafter still holds the target's layers 2 and 3 (a random start would be ~0.03 away)."""
  out = str(tmp_path / "run")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, out, "train.steps=2",
                        "train.learning_rate=1e-9", "train.init_from_target_layers=[2, 3]",
                        "train.eval_prompts=0")
  args = ["--quiet", "--config", os.devnull] + [
      f"{s}.{k}={v if isinstance(v, str) else json.dumps(v)}"
      for s, sec in cfg.to_dict().items() for k, v in sec.items()]
  assert train_cli.main(args) == 0
  zdir = str(tmp_path / "z")
  assert export_main(["--run-dir", out, "--out", zdir, "--dtype", "float32"]) == 0
  dcfg, _, params = read_zlab(zdir)
  got = to_flat(params)
  want = load_target(tiny_target_dir, dtype="float32", device="cpu").decoder_layer_arrays([2, 3])
  for name, a in want.items():
    np.testing.assert_allclose(np.asarray(got[name]), a.T if a.ndim == 2 else a, atol=1e-5,
                               err_msg=name)
  j = list(dcfg.target_layer_ids).index(max(i for i in dcfg.target_layer_ids if i < 2))
  fc = np.asarray(got["fc.weight"])
  H = dcfg.hidden_size
  np.testing.assert_allclose(fc[j * H:(j + 1) * H], np.eye(H), atol=1e-5)

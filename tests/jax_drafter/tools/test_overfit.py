"""The overfit gate on the real SmolLM2-135M target (float32, CPU) and the default 1-layer drafter at block 16.

One conversation whose greedy answer holds "\\n\\n" as one token (1116) within the first 48 tokens:
memorised from the exact ids it drafts back at 16 of 16; memorised from its text encoded again
(1116 -> 198 198) the gate fails and names the position where the labels part from the target.
"""

import dataclasses
import json

import numpy as np
import pytest

from jax_drafter.config import load_config
from jax_drafter.tools import overfit
from jax_drafter.train import DEFAULT_CONFIG

CONVERSATION = 10      # ShareGPT conversation whose answer holds token 1116 at index 32
MAX_NEW_TOKENS = 48    # a multiple of the block size: a perfect drafter reaches tau 16
STEPS = 80             # memorises with a margin at lr 1e-3 (the loss plateaus for ~40 steps first)
ANCHORS = 8            # of 47 candidates per step: steps, not anchors, end the plateau
OVERRIDES = ["target.device=cpu", "target.dtype=float32", "drafter.block_size=16",
             "train.learning_rate=1e-3", "train.log_every=10"]


def test_the_gate_runs_an_auto_target_in_float32(monkeypatch, capsys):
  # Even where "auto" means bfloat16 (native bf16 patched in): the gate resolves it to float32, and
  # keeps a dtype the command names.
  from jax_drafter import config as config_lib
  monkeypatch.setattr(config_lib, "cpu_has_native_bf16", lambda cpuinfo=None: True)
  seen = []

  def stop(cfg, **kw):
    seen.append(cfg.target.dtype)
    raise overfit.GateError("stopped by the test")
  monkeypatch.setattr(overfit, "overfit", stop)
  for dtype in ("auto", "bfloat16"):
    assert overfit.main([f"target.dtype={dtype}", "target.device=cpu"]) == 2
  assert seen == ["float32", "bfloat16"]
  assert "stopped by the test" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smol():
  cfg = load_config(DEFAULT_CONFIG, OVERRIDES)
  target, dcfg = overfit.load(cfg)
  prompt_ids, _ = overfit.choose_prompt(cfg, target.tokenizer, conversation=CONVERSATION,
                                        max_tokens=1024)
  answer = overfit.target_answer(target, prompt_ids, MAX_NEW_TOKENS)
  return cfg, target, dcfg, prompt_ids, answer


def test_exact_ids_pass_through_the_cli(smol, tmp_path, monkeypatch, capsys):
  cfg, target, dcfg, _, _ = smol
  monkeypatch.setattr(overfit, "load", lambda c: (target, dcfg))  # loaded once per module
  out = tmp_path / "report.json"
  rc = overfit.main(["--config", DEFAULT_CONFIG, *OVERRIDES, "--conversation", str(CONVERSATION),
                     "--steps", str(STEPS), "--anchors", str(ANCHORS),
                     "--max-new-tokens", str(MAX_NEW_TOKENS), "--json", str(out)])
  printed = capsys.readouterr().out
  report = json.loads(out.read_text())
  assert rc == 0, printed
  assert report["passed"] and report["lossless"] is True
  assert report["tau"] >= 15.0 and report["perfect_tau"] == 16.0
  assert report["answer_tokens"] == MAX_NEW_TOKENS and report["num_anchors"] == ANCHORS
  assert "overfit gate PASS" in printed


def test_too_few_steps_fail_with_exit_1_and_the_offsets(smol, tmp_path, monkeypatch, capsys):
  cfg, target, dcfg, _, _ = smol
  monkeypatch.setattr(overfit, "load", lambda c: (target, dcfg))
  out = tmp_path / "report.json"
  # The shapes of the passing run: its compiled step is reused (persistent compilation cache).
  rc = overfit.main(["--config", DEFAULT_CONFIG, *OVERRIDES, "--conversation", str(CONVERSATION),
                     "--steps", "3", "--anchors", str(ANCHORS),
                     "--max-new-tokens", str(MAX_NEW_TOKENS), "--json", str(out)])
  printed = capsys.readouterr().out
  report = json.loads(out.read_text())
  assert rc == 1, printed
  assert not report["passed"] and report["tau"] < 15.0 and report["perfect_tau"] == 16.0
  assert "overfit gate FAIL" in printed and "accuracy per block offset" in printed
  assert "verify step 0: stopped after" in printed


def test_reencoded_answer_fails_and_names_the_position(smol):
  cfg, target, dcfg, prompt_ids, answer = smol
  tok = target.tokenizer
  reencoded = tok(tok.decode(answer), add_special_tokens=False)["input_ids"]
  split = next(i for i, (a, b) in enumerate(zip(answer, reencoded)) if a != b)
  assert answer[split] == 1116 and reencoded[split:split + 2] == [198, 198]
  report = overfit.run_gate(target, dcfg, cfg.train, prompt_ids, steps=STEPS,
                            max_new_tokens=MAX_NEW_TOKENS, num_anchors=ANCHORS,
                            answer_ids=reencoded)
  assert not report["passed"] and report["tau"] < 15.0
  assert report["lossless"] is True   # the drafter is wrong, the decoding still exact
  # The row itself was memorised: the failure is the labels, not the training.
  assert np.mean(report["offset_accuracy"]) > 0.95
  misses = report["misses"]
  assert misses and misses[0]["answer_position"] > split
  assert misses[0]["trained_label"] != misses[0]["target"]
  text = overfit.format_report(report)
  assert "overfit gate FAIL" in text and "accuracy per block offset" in text
  assert f"at answer token {misses[0]['answer_position']}" in text


def test_a_reduced_draft_vocabulary_memorises_and_drafts_back_too(smol):
  """64 rows of SmolLM2's 49,152, chosen from the row (the answer's tokens first): training maps
  labels to draft rows and decoding maps drafted rows back to ids; the gate says they agree."""
  cfg, target, dcfg, prompt_ids, answer = smol
  small = dataclasses.replace(dcfg, draft_vocab_size=64)
  report = overfit.run_gate(target, small, cfg.train, prompt_ids, steps=STEPS,
                            max_new_tokens=MAX_NEW_TOKENS, num_anchors=ANCHORS)
  assert len(set(answer)) < 64 and max(answer) > 64      # every answer token fits, ids do not
  assert report["passed"] and report["lossless"] is True and report["tau"] >= 15.0


def test_the_gate_trains_without_the_configs_dropout(smol, monkeypatch):
  cfg, target, dcfg, prompt_ids, _ = smol
  seen = []

  def stop(graphdef, dcfg, t, *a, **kw):
    seen.append(t)
    raise overfit.GateError("stopped by the test")
  monkeypatch.setattr(overfit.step_lib, "make_train_step", stop)
  with pytest.raises(overfit.GateError, match="stopped by the test"):
    overfit.run_gate(target, dcfg, dataclasses.replace(cfg.train, dropout=0.3), prompt_ids,
                     steps=STEPS, max_new_tokens=MAX_NEW_TOKENS, num_anchors=ANCHORS)
  assert seen[0].dropout == 0.0 and seen[0].learning_rate == cfg.train.learning_rate


def test_default_prompt_is_the_first_usable_conversation(smol):
  cfg, target, _, _, _ = smol
  ids, source = overfit.choose_prompt(cfg, target.tokenizer, max_tokens=1024)
  generation_prompt = target.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)
  assert source.startswith("conversation 0 ")
  assert ids[-len(generation_prompt["input_ids"]):] == generation_prompt["input_ids"]
  with pytest.raises(overfit.GateError, match="--conversation or --prompt"):
    overfit.choose_prompt(cfg, target.tokenizer, max_tokens=10)
  ids, source = overfit.choose_prompt(cfg, target.tokenizer, prompt="Hi", max_tokens=1024)
  assert source == "--prompt"


def test_perfect_accepted_and_impossible_bars():
  assert overfit.perfect_accepted(48, 16) == [15, 15, 15]
  assert overfit.perfect_accepted(33, 16) == [15, 15]
  assert overfit.perfect_accepted(40, 16) == [15, 15, 7]   # nothing past the answer's end
  assert overfit.perfect_accepted(1, 16) == []
  assert overfit.default_min_tau(16) == 15 and overfit.default_min_tau(4) == 3


def test_an_answer_that_cannot_reach_the_bar_is_refused_before_training(smol):
  cfg, target, dcfg, prompt_ids, answer = smol
  with pytest.raises(overfit.GateError, match="a multiple of 16"):
    overfit.run_gate(target, dcfg, cfg.train, prompt_ids, steps=1, max_new_tokens=MAX_NEW_TOKENS,
                     answer_ids=answer[:20])


def test_build_row_pads_with_its_own_document():
  rows = overfit.build_row([5, 6, 7], [8, 9, 2], pad_id=2)
  assert rows["input_ids"].shape == (1, 16)
  np.testing.assert_array_equal(rows["loss_mask"][0, :7], [0, 0, 0, 1, 1, 1, 0])
  np.testing.assert_array_equal(rows["doc_id"][0, :7], [0, 0, 0, 0, 0, 0, -1])
  np.testing.assert_array_equal(rows["position_ids"][0, :6], np.arange(6))

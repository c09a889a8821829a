"""jax_drafter.tools.compare: two evaluation reports, prompt by prompt."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jax_drafter.tools import compare


def _report(accepted, *, keys=None, lengths=None, max_new_tokens=8, temperature=0.0):
  rows = []
  for i, acc in enumerate(accepted):
    row = {"prompt": i, "prompt_tokens": (lengths or [10 + i for i in range(len(accepted))])[i],
           "accepted": acc}
    if keys is not None:
      row["prompt_key"] = keys[i]
    rows.append(row)
  return {"max_new_tokens": max_new_tokens, "temperature": temperature, "per_prompt": rows}


def test_figures_by_hand():
  """Mean of per-prompt differences, better/worse/equal, pooled tokens over steps, medians."""
  base = _report([[0, 0, 0, 0], [1, 1], [3]])          # taus 1, 2, 4
  new = _report([[1, 1], [1, 1], [0, 0, 3]])           # taus 2, 2, 2
  c = compare.compare(base, new, resamples=200)
  np.testing.assert_allclose(c["tau"]["BASE"], 7 / 3)
  np.testing.assert_allclose(c["tau"]["NEW"], 2.0)
  np.testing.assert_allclose(c["tau_difference"], np.mean([1, 0, -2]))
  np.testing.assert_allclose(c["tau_difference_stderr"], np.std([1, 0, -2], ddof=1) / np.sqrt(3))
  assert (c["better"], c["worse"], c["equal"]) == (1, 1, 1)
  # Pooled: BASE (4 + 4 + 4) tokens over 7 steps; NEW (4 + 4 + 6) over 7.
  np.testing.assert_allclose(c["tau_pooled"]["BASE"], 12 / 7)
  np.testing.assert_allclose(c["tau_pooled"]["NEW"], 14 / 7)
  np.testing.assert_allclose(c["tau_pooled_difference"], 2 / 7)
  lo, hi = c["tau_pooled_difference_95"]
  assert lo <= hi
  assert c["tau_median"] == {"BASE": 2.0, "NEW": 2.0}
  # Seeded: the same interval again; another seed may differ but stays an interval.
  assert compare.compare(base, new, resamples=200)["tau_pooled_difference_95"] == [lo, hi]


def test_a_drafter_against_itself_is_zero_everywhere():
  rng = np.random.default_rng(1)
  acc = [list(rng.integers(0, 4, rng.integers(1, 9))) for _ in range(12)]
  acc = [[int(a) for a in row] for row in acc]
  c = compare.compare(_report(acc), _report(acc), resamples=100)
  assert c["tau_difference"] == 0 and c["tau_pooled_difference"] == 0
  assert c["tau_pooled_difference_95"] == [0.0, 0.0]
  assert (c["better"], c["worse"], c["equal"]) == (0, 0, 12)
  assert "note:" not in compare.format_comparison(c)


def test_says_when_the_target_decoded_differently():
  """Reports whose target decoded differently (evaluate --decoder) still compare, with a note
  naming both; reports from before the decoder was recorded count as not recorded."""
  base, new = _report([[1, 0]]), _report([[1, 0]])
  base["tokens_per_second"] = {"decoder": "with a dynamic KV cache, eager"}
  new["tokens_per_second"] = {"decoder": "with a static KV cache, CUDA graphs"}
  text = compare.format_comparison(compare.compare(base, new, resamples=10))
  assert ("note: the target decoded with a dynamic KV cache, eager in BASE, with a static KV "
          "cache, CUDA graphs in NEW") in text
  del base["tokens_per_second"]
  assert "(not recorded) in BASE" in compare.format_comparison(compare.compare(base, new, resamples=10))
  new["tokens_per_second"] = {}
  assert "note:" not in compare.format_comparison(compare.compare(base, new, resamples=10))


def test_rows_pair_by_prompt_key_in_any_order():
  base = _report([[0], [3, 3]], keys=["a", "b"])
  new = _report([[3, 3], [0]], keys=["b", "a"], lengths=[11, 10])  # NEW evaluated b first
  c = compare.compare(base, new, resamples=10)
  assert c["tau_difference"] == 0 and (c["better"], c["worse"]) == (0, 0)


@pytest.mark.parametrize("new, message", [
    (_report([[0], [1]], keys=["a", "c"]), "different prompts"),
    (_report([[0]], keys=["a"]), "different prompts"),
    (_report([[0], [1]], keys=["a", "b"], max_new_tokens=16), "max_new_tokens=8"),
    (_report([[0], [1]], keys=["a", "b"], temperature=1.0), "temperature"),
])
def test_refuses_reports_on_other_prompts_or_settings(new, message):
  base = _report([[0], [1]], keys=["a", "b"])
  with pytest.raises(compare.CompareError, match=message):
    compare.compare(base, new)


def test_without_keys_pairs_by_position_and_checks_lengths():
  base = _report([[0], [1]])
  assert compare.compare(base, _report([[1], [1]]), resamples=10)["better"] == 1
  with pytest.raises(compare.CompareError, match="prompt 1 has 11 tokens in BASE and 12 in NEW"):
    compare.compare(base, _report([[0], [1]], lengths=[10, 12]))


def test_cli(tmp_path, capsys):
  a, b = tmp_path / "a.json", tmp_path / "b.json"
  a.write_text(json.dumps(_report([[0, 0], [1]], keys=["x", "y"])))
  b.write_text(json.dumps(_report([[1], [1]], keys=["x", "y"])))
  out = tmp_path / "cmp.json"
  assert compare.main([str(a), str(b), "--resamples", "50", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  assert "prompt by prompt: +0.500" in text and "better on 1, worse on 0, equal on 1" in text
  assert json.loads(out.read_text())["tau_difference"] == 0.5
  # Not a report: exit 2 with the file named, no traceback.
  bad = tmp_path / "bad.json"
  bad.write_text("{\"tau\": 1.2}")
  assert compare.main([str(a), str(bad)]) == 2
  assert f"{bad}: no per_prompt rows" in capsys.readouterr().err
  assert compare.main([str(a), str(tmp_path / "missing.json")]) == 2
  assert "cannot read an evaluation report" in capsys.readouterr().err
  assert compare.main([",", str(a)]) == 2
  assert "at least one report a side" in capsys.readouterr().err


def test_first_n_prompts_of_a_longer_evaluation():
  """--first N: a 64-prompt evaluation against a 32-prompt one on its first prompts; without it
  the reports are refused; N beyond either report is refused."""
  acc = [[i % 3, 1] for i in range(6)]
  short = _report(acc[:4], lengths=[10, 11, 12, 13])
  long = _report(acc, lengths=[10, 11, 12, 13, 14, 15])
  with pytest.raises(compare.CompareError, match="4 prompts and NEW 6"):
    compare.compare(short, long, resamples=10)
  c = compare.compare(short, long, resamples=10, first=4)
  assert c["prompts"] == 4 and c["tau_difference"] == 0
  assert compare.compare(long, long, resamples=10, first=5)["prompts"] == 5
  with pytest.raises(compare.CompareError, match="at most 4"):
    compare.compare(short, long, resamples=10, first=5)


def test_recipes_over_their_training_runs():
  """Several runs a side: each run's tau, each side's mean and sd over runs, the difference of
  the means with the Welch standard error; the prompt-by-prompt figures pool each prompt's steps
  of every run of a side."""
  keys = ["a", "b"]
  b0 = _report([[0, 0], [1]], keys=keys)           # taus 1, 2   -> run tau 1.5
  b1 = _report([[1], [1, 1]], keys=keys)           # taus 2, 2   -> 2.0
  n0 = _report([[3], [1]], keys=keys)              # taus 4, 2   -> 3.0
  n1 = _report([[2], [0]], keys=keys)              # taus 3, 1   -> 2.0
  n2 = _report([[1, 3], [0, 0]], keys=["b", "a"])  # taus 1 (a), 3 (b) in another order -> 2.0
  c = compare.compare_runs([b0, b1], [n0, n1, n2], resamples=50)
  r = c["runs"]
  assert r["tau"] == {"BASE": [1.5, 2.0], "NEW": [3.0, 2.0, 2.0]}
  np.testing.assert_allclose(r["mean"]["NEW"], 7 / 3)
  np.testing.assert_allclose(r["sd"]["BASE"], np.std([1.5, 2.0], ddof=1))
  np.testing.assert_allclose(r["difference"], 7 / 3 - 1.75)
  np.testing.assert_allclose(r["difference_stderr"], np.sqrt(np.var([1.5, 2.0], ddof=1) / 2
                                                             + np.var([3.0, 2.0, 2.0], ddof=1) / 3))
  # Pooled per prompt: BASE's prompt a has steps [0, 0, 1] (tau 4/3), b [1, 1, 1] (2);
  # NEW's a [3, 2, 0, 0] (tau 2.25), b [1, 0, 1, 3] (2.25), runs matched by prompt key.
  np.testing.assert_allclose(c["tau"]["BASE"], (4 / 3 + 2) / 2)
  np.testing.assert_allclose(c["tau"]["NEW"], 2.25)
  np.testing.assert_allclose(c["tau_pooled"]["BASE"], (4 + 6) / 6)   # tokens over steps
  text = compare.format_comparison(c)
  assert "BASE: 2 training runs, tau 1.500 2.000; mean 1.750 ± 0.354" in text
  assert "NEW - BASE over runs: +0.583 ± 0.417" in text
  assert "one training run on a side" not in text
  # One run a side: the same figures as before, and the note that they compare drafters.
  one = compare.compare_runs([b0], [n0], resamples=50)
  assert one["tau_difference"] == compare.compare(b0, n0, resamples=50)["tau_difference"]
  assert one["runs"]["difference_stderr"] is None
  assert "one training run on a side: this compares two drafters" in compare.format_comparison(one)


def test_runs_of_one_side_must_be_on_the_same_prompts():
  b0 = _report([[0], [1]], keys=["a", "b"])
  other = _report([[0], [1]], keys=["a", "c"])
  with pytest.raises(compare.CompareError, match="different prompts.*NEW run 0's not in NEW run 1"):
    compare.compare_runs([b0], [b0, other])
  with pytest.raises(compare.CompareError, match="--first 3: BASE has 2 prompts; give at most 2"):
    compare.compare_runs([b0, b0], [b0], first=3)
  c = compare.compare_runs([b0, b0], [b0, b0], first=1, resamples=10)
  assert c["prompts"] == 1 and c["runs"]["tau"]["BASE"] == [1.0, 1.0]


def test_cli_with_runs_joined_by_commas(tmp_path, capsys):
  files = []
  for i, acc in enumerate([[[0], [1]], [[1], [1]], [[2], [2]], [[3], [1]]]):
    f = tmp_path / f"r{i}.json"
    f.write_text(json.dumps(_report(acc, keys=["x", "y"])))
    files.append(str(f))
  out = tmp_path / "cmp.json"
  assert compare.main([",".join(files[:2]), ",".join(files[2:]), "--resamples", "20",
                       "--json", str(out)]) == 0
  text = capsys.readouterr().out
  assert "NEW - BASE over runs: +1.250 ± 0.250" in text
  assert json.loads(out.read_text())["runs"]["tau"]["NEW"] == [3.0, 3.0]

"""python -m jax_drafter.regenerate on a tiny random target: the training split, shards, summary."""

import json

import pytest

from jax_drafter import regenerate as regen_cli
from jax_drafter.config import ConfigError, load_config
from jax_drafter.data import load_conversations, split_held_out


def test_cli_regenerates_the_training_split_in_shards(tiny_target_dir, sharegpt_sample, tmp_path):
  common = ["--config", "/dev/null", f"target.path={tiny_target_dir}", f"data.path={sharegpt_sample}",
            "data.max_conversations=8", "data.held_out=2", "data.seq_len=256",
            "data.regenerate_max_new_tokens=4", "data.regenerate_max_turns=1",
            f"data.cache_dir={tmp_path}", "--quiet"]
  parts, skipped = [], 0
  for i in range(2):
    out, js = tmp_path / f"part{i}.jsonl", tmp_path / f"part{i}.json"
    assert regen_cli.main(common + ["--shard", f"{i}/2", "--out", str(out), "--json", str(js)]) == 0
    summary = json.load(open(js))
    assert summary["records"] == summary["conversations"] - summary["skipped_long_prompt"]
    assert summary["generated_tokens"] > 0 and summary["file"] == str(out)
    skipped += summary["skipped_long_prompt"]
    parts.append([json.loads(line) for line in open(out)])
  train, held = split_held_out(load_conversations(sharegpt_sample, max_conversations=8), 2, 0)
  ids = [r["id"] for part in parts for r in part]
  # Every training conversation once, but those whose prompt does not fit seq_len (counted).
  assert len(ids) == len(set(ids)) and set(ids) <= {c["id"] for c in train}
  assert len(ids) + skipped == len(train)
  assert not {c["id"] for c in held} & set(ids)
  # A merged file is the cache training reads: nothing is generated again.
  merged = tmp_path / "regenerated.jsonl"
  merged.write_text("".join(open(tmp_path / f"part{i}.jsonl").read() for i in range(2)))
  js = tmp_path / "again.json"
  assert regen_cli.main(common + ["--json", str(js)]) == 0
  again = json.load(open(js))
  assert again["generated_tokens"] == 0 and again["decode_steps"] == 0
  assert again["cached"] + again["skipped_long_prompt"] == again["conversations"]


def test_bad_shard_is_a_one_line_error(tiny_target_dir, sharegpt_sample, capsys):
  rc = regen_cli.main(["--config", "/dev/null", f"target.path={tiny_target_dir}",
                       f"data.path={sharegpt_sample}", "--shard", "2/2", "--quiet"])
  assert rc == 2 and "--shard 2/2" in capsys.readouterr().err


def test_several_answers_per_conversation(tiny_target_dir, sharegpt_sample, tmp_path):
  """data.regenerate_samples=2: the greedy answer (the same record a one-answer run writes) and a
  sampled one per conversation, in one cache; a rerun generates nothing."""
  common = ["--config", "/dev/null", f"target.path={tiny_target_dir}", f"data.path={sharegpt_sample}",
            "data.max_conversations=8", "data.held_out=2", "data.seq_len=256",
            "data.regenerate_max_new_tokens=6", "data.regenerate_max_turns=1"]
  one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
  assert regen_cli.main(common + ["--quiet", "--out", str(one)]) == 0
  js = tmp_path / "two.json"
  assert regen_cli.main(common + ["data.regenerate_samples=2", "--quiet", "--out", str(two),
                                  "--json", str(js)]) == 0
  greedy = {r["key"]: r for r in map(json.loads, open(one))}
  both = [json.loads(line) for line in open(two)]
  summary = json.load(open(js))
  assert summary["records"] == len(both) == 2 * len(greedy) and greedy
  first = {r["key"]: r for r in both[:len(greedy)]}
  assert first == greedy                         # the first answer is the greedy run's record
  sampled = both[len(greedy):]
  assert sorted(r["id"] for r in sampled) == sorted(r["id"] for r in greedy.values())
  assert not {r["key"] for r in sampled} & set(greedy)
  by_id = {r["id"]: r for r in greedy.values()}
  assert any(r["input_ids"] != by_id[r["id"]]["input_ids"] for r in sampled)
  again = tmp_path / "again.json"
  assert regen_cli.main(common + ["data.regenerate_samples=2", "--quiet", "--out", str(two),
                                  "--json", str(again)]) == 0
  assert json.load(open(again))["generated_tokens"] == 0


def test_sampled_answers_of_the_first_turns_only(tiny_target_dir, sharegpt_sample, tmp_path):
  """data.regenerate_sample_max_turns=1 with every turn regenerated: the greedy records keep every
  assistant turn, the sampled ones hold the first assistant turn only."""
  common = ["--config", "/dev/null", f"target.path={tiny_target_dir}", f"data.path={sharegpt_sample}",
            "data.max_conversations=8", "data.held_out=2", "data.seq_len=512",
            "data.regenerate_max_new_tokens=4", "data.regenerate_close_cut_turns=true",
            "data.regenerate_samples=2", "data.regenerate_sample_max_turns=1", "--quiet"]
  out = tmp_path / "r.jsonl"
  assert regen_cli.main(common + ["--out", str(out)]) == 0
  records = [json.loads(line) for line in open(out)]
  half = len(records) // 2
  greedy, sampled = records[:half], records[half:]
  assert len(greedy) == len(sampled) > 0
  turns = lambda r: len(r["assistant_spans"])
  assert all(turns(r) == 1 for r in sampled)
  assert any(turns(r) > 1 for r in greedy)      # the sample data has multi-turn conversations
  with pytest.raises(ConfigError, match="regenerate_sample_max_turns=0 must be >= 1"):
    load_config(None, ["data.regenerate_sample_max_turns=0"])


def test_sampled_answers_need_a_temperature():
  import pytest
  from jax_drafter.config import ConfigError
  with pytest.raises(ConfigError, match="regenerate_sample_temperature"):
    load_config(None, ["data.regenerate_samples=2", "data.regenerate_sample_temperature=0"])


def test_out_of_memory_names_the_settings_and_keeps_the_finished_conversations(
    tiny_target_dir, sharegpt_sample, tmp_path, monkeypatch, capsys):
  """The device running out of memory mid-regeneration for good (from the second batch on, even
  one conversation at a time; a batch that fits once halved is decoded so, tests/bridge/
  test_generation.py): one message naming the two settings to lower, exit 2, and the batches
  finished before it stay in the cache, so a rerun generates only the rest."""
  import torch

  from bridge import generation
  common = ["--config", "/dev/null", f"target.path={tiny_target_dir}", f"data.path={sharegpt_sample}",
            "data.max_conversations=8", "data.held_out=2", "data.seq_len=256",
            "data.regenerate_max_new_tokens=4", "data.regenerate_max_turns=1",
            "data.regenerate_batch_rows=2", "--quiet", "--out", str(tmp_path / "r.jsonl")]
  real, calls = generation.generate_batch, []

  def fail_from_the_second_batch(*args, **kwargs):
    calls.append(1)
    if len(calls) >= 2:
      raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.38 GiB.")
    return real(*args, **kwargs)

  monkeypatch.setattr(generation, "generate_batch", fail_from_the_second_batch)
  assert regen_cli.main(common) == 2
  errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "ran out of memory" in errors[0]
  err = errors[0]
  assert "data.regenerate_batch_tokens" in err and "data.regenerate_concurrent_batches" in err
  kept = [json.loads(line) for line in open(tmp_path / "r.jsonl")]
  assert 1 <= len(kept) <= 2                         # the first batch's conversations
  monkeypatch.setattr(generation, "generate_batch", real)
  js = tmp_path / "rest.json"
  assert regen_cli.main(common + ["--json", str(js)]) == 0
  assert json.load(open(js))["cached"] == len(kept)


def test_the_compile_setting_reaches_the_decoder(tiny_target_dir, sharegpt_sample, tmp_path,
                                                 monkeypatch):
  """data.regenerate_compile=true asks generation.generate_many for the torch.compile'd forward
  (its tokens are tested in tests/bridge/test_generation.py; here it runs eagerly, to stay fast)."""
  from bridge import generation
  real, seen = generation.generate_many, []

  def spy(*args, compiled=False, **kwargs):
    seen.append(compiled)
    return real(*args, **kwargs)

  monkeypatch.setattr(generation, "generate_many", spy)
  common = ["--config", "/dev/null", f"target.path={tiny_target_dir}", f"data.path={sharegpt_sample}",
            "data.max_conversations=6", "data.held_out=2", "data.seq_len=256",
            "data.regenerate_max_new_tokens=4", "data.regenerate_max_turns=1"]
  assert regen_cli.main(common + ["--quiet", "--out", str(tmp_path / "a.jsonl")]) == 0
  assert seen and not any(seen)
  seen.clear()
  assert regen_cli.main(common + ["data.regenerate_compile=true", "--quiet", "--out",
                                  str(tmp_path / "b.jsonl")]) == 0
  assert seen and all(seen)

"""inputs.setup: what a run trains and validates on, with regeneration of every turn."""

import numpy as np

from jax_drafter import inputs
from tests.tiny_fixtures import tiny_run_config


def _answers_per_document(rows) -> list[int]:
  """Supervised stretches (answers) of each packed document."""
  counts = []
  for mask, doc in zip(rows["loss_mask"], rows["doc_id"]):
    for d in np.unique(doc[doc >= 0]):
      m = mask[doc == d]
      counts.append(int(m[0] + np.sum((m[1:] == 1) & (m[:-1] == 0))))
  return counts


def test_every_turn_trains_while_validation_keeps_the_first_answer(tiny_target_dir, sharegpt_sample,
                                                                   tmp_path):
  """data.regenerate_max_turns=null with regenerate_close_cut_turns: the tiny target's answers
  are all cut at 3 tokens, closed and continued, so the training documents hold several answers;
  the validation documents hold the first answer only (what held-out evaluation decodes)."""
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, str(tmp_path / "run"),
                        "data.regenerate=true", "data.regenerate_max_new_tokens=3",
                        "data.regenerate_max_turns=null", "data.regenerate_close_cut_turns=true",
                        "data.seq_len=512", "data.validation=6", f"data.cache_dir={tmp_path}")
  _, _, ds = inputs.setup(cfg)
  train = _answers_per_document(ds.rows)
  assert max(train) >= 3 and sum(train) > len(train)
  assert set(_answers_per_document(ds.val_rows)) == {1}
  # Without closing, the first cut answer ends every conversation.
  plain = tiny_run_config(tiny_target_dir, sharegpt_sample, str(tmp_path / "run2"),
                          "data.regenerate=true", "data.regenerate_max_new_tokens=3",
                          "data.regenerate_max_turns=null", "data.seq_len=512",
                          "data.validation=6", f"data.cache_dir={tmp_path}")
  _, _, ds2 = inputs.setup(plain)
  assert set(_answers_per_document(ds2.rows)) == {1}
  np.testing.assert_array_equal(ds2.val_rows["input_ids"], ds.val_rows["input_ids"])


def test_synthetic_prompts_join_the_training_conversations_only(tiny_target_dir, sharegpt_sample,
                                                                tmp_path, monkeypatch):
  """data.synthetic_prompts: the target's own user messages are answered and trained on like the
  dataset's conversations; validation rows stay those of the dataset, and the data key changes."""
  from bridge import synthetic_prompts as sp
  calls = []

  common = ("data.regenerate=true", "data.regenerate_max_new_tokens=3", "data.validation=6",
            f"data.cache_dir={tmp_path}")
  _, _, base = inputs.setup(tiny_run_config(tiny_target_dir, sharegpt_sample,
                                            str(tmp_path / "a"), *common))
  # One message the target "wrote" is a held-out prompt (other case and spacing): it is dropped.
  held = next(m["content"] for m in base.held_out[0]["messages"] if m["role"] == "user")

  def fake(model, tokenizer, s, *, fingerprint, cache_path, progress=True):
    calls.append((s.count, s.temperature, cache_path))
    texts = ["What is a drafter?", "Name three rivers.", "Hello!", "  " + held.upper() + " "]
    return [{"id": f"synthetic-0-{i}", "messages": [{"role": "user", "content": text},
                                                    {"role": "assistant", "content": ""}]}
            for i, text in enumerate(texts)]
  monkeypatch.setattr(sp, "synthesize", fake)
  _, _, more = inputs.setup(tiny_run_config(tiny_target_dir, sharegpt_sample, str(tmp_path / "b"),
                                            *common, "data.synthetic_prompts=5",
                                            "data.synthetic_prompt_temperature=0.9"))
  assert calls == [(5, 0.9, str(tmp_path / "synthetic_prompts.jsonl"))]
  assert more.stats["train_conversations"] == base.stats["train_conversations"] + 3
  assert more.stats["synthetic_dropped_held_out"] == 1
  assert "synthetic_dropped_held_out" not in base.stats
  assert len(_answers_per_document(more.rows)) == len(_answers_per_document(base.rows)) + 3
  np.testing.assert_array_equal(more.val_rows["input_ids"], base.val_rows["input_ids"])

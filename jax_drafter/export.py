"""Export a trained drafter to the z-lab DFlash directory format, and read such a directory back.

The directory holds `config.json` (DrafterConfig.to_zlab) and `model.safetensors` with the z-lab
names (`fc.weight`, `hidden_norm.weight`, `layers.{i}.self_attn.q_proj.weight`, ..., `norm.weight`),
Linear weights in PyTorch's [out, in] layout, no embedding and no LM head (the target's are used).
This is what SGLang, vLLM and z-lab's `DFlashDraftModel` load. safetensors only: nothing is pickled.
A drafter with a reduced draft vocabulary also gets `draft_vocab.json` (jax_drafter.draft_vocab).

CLI: python -m jax_drafter.export --run-dir RUN [--step N] --out DIR [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from jax_drafter import draft_vocab
from jax_drafter.config import ZLAB_CONFIG, ZLAB_WEIGHTS, DrafterConfig, check_names_and_shapes
from jax_drafter.params import abstract_model, from_flat, to_flat

log = logging.getLogger(__name__)

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def zlab_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
  """name -> shape in the file ([out, in] for Linear weights)."""
  _, abstract = abstract_model(cfg)
  return {k: tuple(v.shape[::-1]) for k, v in to_flat(abstract).items()}


def to_zlab_arrays(params, dtype: str = "float32") -> dict[str, np.ndarray]:
  """Flax params -> {z-lab name: numpy array}, Linear weights transposed to [out, in]."""
  if dtype not in NP_DTYPES:
    raise ValueError(f"{dtype=} must be one of {sorted(NP_DTYPES)}")
  out = {}
  for k, v in to_flat(params).items():
    a = np.asarray(v, np.float32)
    out[k] = np.ascontiguousarray(a.T if a.ndim == 2 else a).astype(NP_DTYPES[dtype])
  return out


def from_zlab_arrays(cfg: DrafterConfig, arrays: dict[str, np.ndarray], *, source: str = "weights"):
  """{z-lab name: [out, in] array} -> (graphdef, params) with key-set and shape checks."""
  check_names_and_shapes(zlab_shapes(cfg), {k: v.shape for k, v in arrays.items()}, source=source)
  flat = {k: (np.asarray(v, np.float32).T if v.ndim == 2 else np.asarray(v, np.float32))
          for k, v in arrays.items()}
  return from_flat(cfg, flat, source=source)


def write_zlab(out_dir: str, cfg: DrafterConfig, params, dtype: str = "bfloat16",
               vocab=None) -> str:
  """Write config.json + model.safetensors into out_dir (files replaced atomically), and with a
  reduced draft vocabulary (`vocab`, the ids) draft_vocab.json. Returns out_dir."""
  vocab = draft_vocab.check(vocab, cfg, source=f"export to {out_dir}")
  arrays = to_zlab_arrays(params, dtype)
  check_names_and_shapes(zlab_shapes(cfg), {k: v.shape for k, v in arrays.items()},
                         source=f"export to {out_dir}")
  os.makedirs(out_dir, exist_ok=True)
  conf = cfg.to_zlab()
  conf["torch_dtype"] = dtype
  tmp_w, tmp_c = (os.path.join(out_dir, f".{n}.tmp") for n in (ZLAB_WEIGHTS, ZLAB_CONFIG))
  save_file(arrays, tmp_w, metadata={"format": "pt"})
  with open(tmp_c, "w") as f:
    json.dump(conf, f, indent=2)
  # safetensors creates its file 0600; an export is meant to be read by servers and colleagues:
  # give both files the mode any new file gets under the user's umask.
  umask = os.umask(0)
  os.umask(umask)
  for tmp in (tmp_w, tmp_c):
    os.chmod(tmp, 0o666 & ~umask)
  os.replace(tmp_w, os.path.join(out_dir, ZLAB_WEIGHTS))
  if vocab is not None:         # before config.json: a config that names it finds it
    draft_vocab.write(out_dir, vocab)
  elif os.path.exists(os.path.join(out_dir, draft_vocab.FILE)):
    os.remove(os.path.join(out_dir, draft_vocab.FILE))
  os.replace(tmp_c, os.path.join(out_dir, ZLAB_CONFIG))
  log.info("exported drafter (%s) to %s", dtype, out_dir)
  return out_dir


def read_zlab(zlab_dir: str):
  """A z-lab DFlash directory -> (DrafterConfig, graphdef, float32 params)."""
  cpath, wpath = os.path.join(zlab_dir, ZLAB_CONFIG), os.path.join(zlab_dir, ZLAB_WEIGHTS)
  for p in (cpath, wpath):
    if not os.path.isfile(p):
      raise FileNotFoundError(f"{p} does not exist; a z-lab drafter directory holds {ZLAB_CONFIG} "
                              f"and {ZLAB_WEIGHTS}")
  with open(cpath) as f:
    try:
      conf = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{cpath}: not valid JSON ({e})") from None
  cfg = DrafterConfig.from_zlab(conf, source=cpath)
  graphdef, params = from_zlab_arrays(cfg, load_file(wpath), source=wpath)
  return cfg, graphdef, params


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jax_drafter.export", description=__doc__.split("\n")[0])
  ap.add_argument("--run-dir", required=True, help="training run directory (with checkpoints/)")
  ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  ap.add_argument("--out", required=True, help="output directory")
  ap.add_argument("--dtype", default="bfloat16", choices=sorted(NP_DTYPES))
  args = ap.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  from jax_drafter.checkpoint import load_params
  try:
    cfg, _, params, meta = load_params(args.run_dir, args.step)
    vocab = draft_vocab.from_meta(meta, cfg, source=f"{args.run_dir}/checkpoints")
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  write_zlab(args.out, cfg, params, args.dtype, vocab)
  print(f"wrote {os.path.join(args.out, ZLAB_WEIGHTS)} and {ZLAB_CONFIG} ({args.dtype})")
  return 0


if __name__ == "__main__":
  sys.exit(main())

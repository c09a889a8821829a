"""What one speculative-decoding verify step of the target costs on a GPU, per decoder: the
DynamicCache decoder (eager transformers, `jax_drafter.evaluate --decoder dynamic`), the
static-cache decoder eager, and the static-cache decoder with CUDA graphs (`--decoder static`, which
`auto`, the default, picks on a GPU).
A target of SmolLM2-135M's shapes with random weights (bf16); each step verifies a block of
--block tokens with the layers a 5-layer drafter reads captured, then crops back to a random
accepted length, as decoding does. Medians over --steps steps (wall clock, synchronised).

  python scripts/bench_verify.py [--prompt-len 200] [--block 16] [--steps 200] [--json F]
"""

import argparse
import json
import statistics
import time

import torch

from bench_generation import VocabOnlyTokenizer, smollm2_shaped_model  # scripts/ is on the path
from bridge import spec_decode
from bridge.target import Target

LAYERS = (1, 8, 14, 20, 27)   # what the recipe's 5-layer drafter reads (docs/DESIGN.md rule)


def time_decoder(dec, prompt, *, block: int, steps: int, seed: int = 0) -> dict:
  g = torch.Generator().manual_seed(seed)
  dec.prefill(prompt)
  times = []
  for i in range(steps + 3):                           # 3 warm-up steps (graph capture)
    base = dec.length
    ids = torch.randint(3, 49152, (block,), generator=g).tolist()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits, feats = dec.verify(ids)
    int(logits[0].argmax())                            # the host reads the result, as accept() does
    torch.cuda.synchronize()
    if i >= 3:
      times.append(time.perf_counter() - t0)
    dec.crop(base + 1 + int(torch.randint(0, block, (1,), generator=g)))
    if dec.length > len(prompt) + 400:                 # stay within the static cache
      dec.crop(len(prompt))
  return {"median_ms": 1e3 * statistics.median(times), "steps": len(times)}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--prompt-len", type=int, default=200)
  p.add_argument("--block", type=int, default=16)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--json")
  a = p.parse_args()
  target = Target(smollm2_shaped_model(), VocabOnlyTokenizer(), "smollm2-shaped")
  prompt = torch.randint(3, 49152, (a.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
  max_len = a.prompt_len + 400 + 2 * a.block
  decoders = {
      "dynamic cache, eager": spec_decode.TargetDecoder(target, LAYERS),
      "static cache, eager": spec_decode.StaticTargetDecoder(target, LAYERS, max_len=max_len,
                                                             cuda_graph=False),
      "static cache, CUDA graph": spec_decode.StaticTargetDecoder(target, LAYERS, max_len=max_len),
  }
  out = {"prompt_len": a.prompt_len, "block": a.block, "device": torch.cuda.get_device_name(),
         "torch": torch.__version__}
  for name, dec in decoders.items():
    out[name] = time_decoder(dec, prompt, block=a.block, steps=a.steps)
    print(f"{name:26s} verify step {out[name]['median_ms']:7.2f} ms (median of {a.steps})",
          flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=2)


if __name__ == "__main__":
  main()

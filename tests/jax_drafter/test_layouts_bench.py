"""scripts/layouts_bench.py (issue #13's GPU table): the training overrides it gives every layout
make a valid run config and drafter for each drafter depth (a CPU check: the GPU run is minutes)."""

import pytest
from transformers import LlamaConfig

from bridge.target import info_from_config
from jax_drafter.config import load_config, resolve_drafter
from jax_drafter.train import DEFAULT_CONFIG
from tiny_fixtures import load_script


@pytest.mark.parametrize("layers", [1, 3])
def test_every_layout_gets_a_valid_config(tmp_path, layers):
  bench = load_script("layouts_bench.py")
  args = bench.parser().parse_args(["--tokenizer", "tok", "--data", "rows.jsonl",
                                    "--drafter-layers", str(layers), "--seq", "512"])
  overrides = bench.train_overrides(args, str(tmp_path), "bfloat16")
  for layout in bench.LAYOUTS.values():
    cfg = load_config(DEFAULT_CONFIG, overrides + layout)   # what `python -m jax_drafter.train` reads
    arch = bench.ARCHS["smollm2-1.7b"]
    info = info_from_config(LlamaConfig(vocab_size=49152, **arch), vocab_size=49152,
                            tokenizer_size=49152, name="smollm2-1.7b")
    d = resolve_drafter(cfg.drafter, info, mask_token_id=0)
    assert d.num_hidden_layers == layers and len(d.layer_types) == layers
    assert cfg.data.seq_len == 512 and cfg.data.path == "rows.jsonl"
    assert cfg.train.dropout == 0.0     # the default's dropout would change the step it times

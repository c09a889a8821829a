"""Two processes on localhost (jax.distributed, CPU collectives over gloo), each with its own target
and one device, train like one process: the same losses, one run directory written by process 0."""

import os
import socket
import subprocess
import sys

import pytest
import yaml

from jax_drafter import trainer

from tiny_fixtures import run_losses, tiny_run_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_train_like_one(tiny_target_dir, sharegpt_sample, tmp_path):
  one = str(tmp_path / "one")
  trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, one, "train.steps=3"))
  two = str(tmp_path / "two")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, two, "train.steps=3")
  path = tmp_path / "run.yaml"
  path.write_text(yaml.safe_dump(cfg.to_dict()))
  port = _free_port()
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen(
      [sys.executable, "-m", "jax_drafter.train", "--config", str(path), "--quiet", "--no-export",
       "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=600)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("the two processes did not finish in 10 minutes")
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  assert "drafter data parallel over 2 devices" in outs[0]
  a, b = run_losses(one), run_losses(two)
  assert sorted(b) == [1, 2, 3]
  for s in (1, 2, 3):
    assert b[s] == pytest.approx(a[s], rel=1e-5), s
  assert sorted(os.listdir(os.path.join(two, "checkpoints")))[-1] == "3"

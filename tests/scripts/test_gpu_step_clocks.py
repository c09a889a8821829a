"""scripts/gpu_step_clocks.py: what it makes of NVML reads (per-step windows, the correlation of
step time with clock) on reads written by hand, and its message where there is no NVIDIA driver."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import gpu_step_clocks as clocks  # noqa: E402


def _sampler(rows):
  s = clocks.Sampler.__new__(clocks.Sampler)   # no thread, no NVML: the reads are given
  s.rows = rows
  return s


def test_window_averages_the_reads_inside_a_step_only():
  # (time s, SM clock MHz, power W, energy counter J, clock-event reason bits)
  s = _sampler([(0.9, 1980, 120.0, 1000.0, 0x0),
                (1.0, 1400, 690.0, 1010.0, 0x4),
                (1.2, 1300, 700.0, 1150.0, 0x4),
                (1.4, 1500, 698.0, 1290.0, 0x4 | 0x20),
                (1.6, 1980, 130.0, 1300.0, 0x1)])
  w = s.window(1.0, 1.4)
  assert w["samples"] == 3
  assert w["clock_mean_mhz"] == pytest.approx(1400.0)
  assert w["clock_min_mhz"] == 1300
  assert w["power_mean_w"] == pytest.approx((690 + 700 + 698) / 3)
  assert w["energy_j"] == pytest.approx(280.0)
  assert w["reasons"] == ["sw power cap", "sw thermal"]
  assert s.window(2.0, 3.0) == {"samples": 0}


def test_timed_gives_each_step_its_own_window(monkeypatch):
  s = _sampler([])
  t = [10.0]

  def step():   # each call "takes" 0.5 s and leaves one read inside its window
    s.rows.append((t[0] + 0.25, 1400 + 100 * len(s.rows), 700.0, 100.0 * len(s.rows), 0x4))
    t[0] += 0.5
  monkeypatch.setattr(clocks.time, "perf_counter", lambda: t[0])
  rows = clocks.timed(step, 3, s)
  assert [r["ms"] for r in rows] == [500.0, 500.0, 500.0]
  assert [r["clock_mean_mhz"] for r in rows] == [1400, 1500, 1600]


def test_correlation():
  assert clocks.correlation([1, 2, 3, 4], [2, 4, 6, 8]) == pytest.approx(1.0)
  assert clocks.correlation([1, 2, 3, 4], [8, 6, 4, 2]) == pytest.approx(-1.0)
  assert clocks.correlation([1, 1, 1], [1, 2, 3]) is None
  assert clocks.correlation([1, 2], [2, 1]) is None


def test_no_driver_says_so():
  with pytest.raises(SystemExit, match="cannot load NVML .*run this on the GPU machine"):
    clocks.Nvml(0, library="libnvidia-ml-not-here.so.1")

import ctypes
import platform
import sys

import pytest

from jax_drafter import cli


def _heap_range():
  with open("/proc/self/maps") as f:
    for line in f:
      if line.rstrip().endswith("[heap]"):
        lo, hi = line.split()[0].split("-")
        return int(lo, 16), int(hi, 16)
  return None


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt")
def test_a_64_mib_allocation_comes_from_the_heap_once_large_allocations_are_kept():
  # glibc's default maps anything past its mmap threshold (32 MiB at most) on its own
  assert cli.keep_large_allocations() is True
  libc = ctypes.CDLL("libc.so.6")
  libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
  libc.free.argtypes = [ctypes.c_void_p]
  p = libc.malloc(64 << 20)
  try:
    heap = _heap_range()
    assert p and heap is not None and heap[0] <= p < heap[1], (hex(p or 0), heap)
  finally:
    libc.free(p)

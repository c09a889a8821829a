"""scripts/gpu_step_profile.py: its reading of a JAX perfetto trace (which events are the GPU's
kernels) and its kernel classes, on a trace written by hand in the format the GPU profiler gives."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import gpu_step_profile as prof  # noqa: E402


def test_device_events_keep_the_gpu_tracks_only():
  trace = {"traceEvents": [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
      {"ph": "X", "pid": 1, "tid": 7, "name": "nvjet_sm90_tst_256x128", "ts": 100.0, "dur": 50.0},
      {"ph": "X", "pid": 1, "tid": 7, "name": "loop_convert_fusion", "ts": 160.0, "dur": 5.0},
      {"ph": "X", "pid": 2, "tid": 1, "name": "PjitFunction(train_step)", "ts": 90, "dur": 99},
      {"ph": "i", "pid": 1, "name": "marker", "ts": 120.0},
  ]}
  events, tracks = prof.device_events(trace)
  assert tracks == {"/device:GPU:0"}
  assert [(n, d, t) for n, d, t in events] == [("nvjet_sm90_tst_256x128", 50.0, 100.0),
                                               ("loop_convert_fusion", 5.0, 160.0)]
  events, tracks = prof.device_events({"traceEvents": trace["traceEvents"][1:2]})
  assert events == [] and "none of: /host:CPU" in next(iter(tracks))


def test_kernel_classes_of_the_step_s_kernels():
  """Names as the H100 profile of the 27b-8k step gave them."""
  want = {"nvjet_sm90_tss_128x160_64x5_4x2_h_bz_NNT": "GEMM",
          "gemm_fusion_dot_49": "GEMM",
          "dflash_bwd_dkv_mosaic_gpu_kernel": "attention (Pallas)",
          "loop_select_fusion_19": "other fusion",
          "input_reduce_fusion_1": "reduction fusion",
          "input_add_reduce_fusion_23": "reduction fusion",
          "memcpy128": "copy / transpose",
          "wrapped_convert_7": "other"}
  assert {n: prof.kernel_class(n) for n in want} == want


def test_hlo_ops_map_trace_names_to_their_op_names():
  """Lines as the compiled 27b-8k step's HLO has them: the trace's `_14` is the HLO's `.14`."""
  text = """HloModule jit_train_step
  %loop_add_fusion.14 = bf16[1,16384,17408]{2,1,0} fusion(%a, %b), kind=kLoop, \
calls=%fused_add.14, metadata={op_name="jit(train_step)/transpose(jvp(jit(silu)))/add_any" \
scheduling_name="x"}
  ROOT %loop_convert_fusion = bf16[1920,248320]{1,0} fusion(%c), kind=kLoop, \
metadata={op_name="jit(train_step)/jvp()/while/body/eval_jaxpr/convert_element_type"}
  %param_0.1 = f32[8]{0} parameter(0)
"""
  assert prof.hlo_ops(text) == {
      "loop_add_fusion_14": "jit(train_step)/transpose(jvp(jit(silu)))/add_any",
      "loop_convert_fusion": "jit(train_step)/jvp()/while/body/eval_jaxpr/convert_element_type"}

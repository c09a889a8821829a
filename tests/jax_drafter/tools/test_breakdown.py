"""Every part of the tiny step is compiled and timed on its own."""

from jax_drafter.tools import bench


def test_breakdown_times_every_part_of_the_tiny_step():
  from jax_drafter.tools import breakdown, plans
  plan = plans.build_plan("tiny-memory", [])
  graphdef, state, batch, frozen = plans.random_inputs(plan)
  parts = breakdown.step_breakdown(graphdef, state, batch, frozen, cfg=plan.cfg, t=plan.train,
                                   reps=1)
  n = plan.cfg.num_hidden_layers
  assert list(parts)[0] == "fc + hidden_norm" and len(parts) == n + 3, parts
  assert all(name.startswith(f"layer {i} (") for i, name in enumerate(list(parts)[1:n + 1]))
  assert all(v > 0 for v in parts.values())
  text = bench.format_breakdown({k: v * 1e3 for k, v in parts.items()}, 1e3 * sum(parts.values()))
  assert "rest (step - parts)" in text and "norm + LM-head CE" in text

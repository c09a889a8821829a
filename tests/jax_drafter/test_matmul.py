"""model.matmul: on a CPU a bfloat16 matmul runs as bfloat16 dots with float32 outputs (XLA:CPU
makes a bf16-output dot an f32 dot of upcast operands, ~4x slower), forward and both gradients,
with the values of the plain jnp.matmul it replaces: f32 accumulation, one rounding to bf16."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_drafter import model
from jax_drafter.tools.memory import traced_flops


def _xw(shape_x, k_out, seed):
  r = np.random.default_rng(seed)
  x = jnp.asarray(r.normal(size=shape_x), jnp.bfloat16)
  w = jnp.asarray(r.normal(size=(shape_x[-1], k_out)) * 0.1, jnp.bfloat16)
  return x, w


def _exact(x, w):   # the f32 product of the bf16 values, rounded once: the reference
  return (x.astype(jnp.float32) @ w.astype(jnp.float32)).astype(jnp.bfloat16)


@pytest.mark.parametrize("shape_x", [(37, 48), (3, 5, 48), (2, 3, 4, 48)])
def test_values_and_gradients_match_the_plain_matmul(shape_x):
  x, w = _xw(shape_x, 40, seed=len(shape_x))
  y = model.matmul(x, w)
  assert y.dtype == jnp.bfloat16 and y.shape == shape_x[:-1] + (40,)
  ref = _exact(x, w)
  # f32 sums in another order, then one rounding: at most one bf16 step apart
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32),
                             rtol=2 ** -7, atol=1e-3)
  g = jnp.asarray(np.random.default_rng(9).normal(size=y.shape), jnp.bfloat16)
  loss = lambda f: (lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * g.astype(jnp.float32)))
  dx, dw = jax.grad(loss(model.matmul), argnums=(0, 1))(x, w)
  dx_ref, dw_ref = jax.grad(loss(jnp.matmul), argnums=(0, 1))(x, w)
  assert dx.dtype == dw.dtype == jnp.bfloat16
  g32, x32, w32 = (np.asarray(a, np.float32) for a in (g, x, w))
  dx_exact = g32 @ w32.T
  dw_exact = x32.reshape(-1, x32.shape[-1]).T @ g32.reshape(-1, g32.shape[-1])
  for got, ref, exact in ((dx, dx_ref, dx_exact), (dw, dw_ref, dw_exact)):
    np.testing.assert_allclose(np.asarray(got, np.float32), exact, rtol=2 ** -7, atol=2e-3)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=2 ** -6, atol=4e-3)


def test_float32_operands_take_the_plain_matmul():
  r = np.random.default_rng(0)
  x, w = jnp.asarray(r.normal(size=(8, 16)), jnp.float32), jnp.asarray(r.normal(size=(16, 4)), jnp.float32)
  np.testing.assert_array_equal(np.asarray(model.matmul(x, w)), np.asarray(jnp.matmul(x, w)))


def _bf16_dots(fn, *args):
  """How many dots of the compiled CPU program of fn read two bf16 operands."""
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  types = {}
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[", line)
    if m:
      types[m.group(1)] = m.group(2)
  dots = re.findall(r"\bdot\(%?([\w.\-]+), %?([\w.\-]+)\)", hlo)
  assert len(dots) == 3, hlo   # forward, input gradient, weight gradient
  return sum(types.get(a) == types.get(b) == "bf16" for a, b in dots)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dots; elsewhere "
                    "model.matmul is jnp.matmul")
def test_on_the_cpu_the_forward_and_input_gradient_dots_read_bf16():
  x, w = _xw((64, 96), 80, seed=3)
  grad = lambda f: jax.value_and_grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2),
                                      argnums=(0, 1))
  # XLA:CPU turns every bf16-output dot of the plain matmul into an f32 dot of upcast operands;
  # model.matmul keeps the forward's and the input gradient's in bf16 (the weight gradient's,
  # contracted over the operands' leading dimension, is upcast either way).
  assert _bf16_dots(grad(jnp.matmul), x, w) == 0
  assert _bf16_dots(grad(model.matmul), x, w) == 2


def test_an_input_nothing_differentiates_gets_no_gradient_matmul():
  # like fc's input, the target features: jnp.matmul's transpose skips its gradient, and so must
  # this one (the jaxpr's matmul FLOPs, which the tools count, stay those of jnp.matmul):
  # forward and weight gradient, then the input gradient too where x is differentiated
  x, w = _xw((6, 7, 48), 40, seed=5)
  one = 2 * 6 * 7 * 48 * 40   # the FLOPs of one of the three matmuls
  only_w = lambda f: jax.grad(lambda w: jnp.sum(f(x, w).astype(jnp.float32)))
  assert traced_flops(only_w(model.matmul), w) == traced_flops(only_w(jnp.matmul), w) == 2 * one
  both = lambda f: jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32)), argnums=(0, 1))
  assert traced_flops(both(model.matmul), x, w) == traced_flops(both(jnp.matmul), x, w) == 3 * one
  # an output nothing depends on: zero gradients, no dots in the backward
  unused = jax.grad(lambda x, w: (model.matmul(x, w), jnp.sum(x.astype(jnp.float32)))[1],
                    argnums=(0, 1))
  dx, dw = unused(x, w)
  assert np.all(np.asarray(dx, np.float32) == 1) and not np.any(np.asarray(dw, np.float32))

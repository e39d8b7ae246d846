"""Scratch buffers proven constant along axes are carried narrow (replicated_scratch).

Two oracles: for the analysis, the values themselves (random programs run on inputs
constant along the axes the analysis is told about: every axis it claims for an
output must hold in the numbers); for the kernels, jax.numpy attention and plain
NumPy models of kernels whose scratch only looks lane-wide.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from jax import lax

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, random_array
from pallet.backends.xla import executor, plan_of
from pallet.backends.xla import replicated_scratch
from pallet.backends.xla.replicated_scratch import constant_axes

f32 = jnp.float32
pytestmark = pytest.mark.cpu_only
N = 4   # every value in the random programs is N x N


# ------------------------------------------------------------------ the analysis
def _op(kind: int, a: jax.Array, b: jax.Array) -> jax.Array:
  """One step of a random program on two N x N values."""
  rows = lax.broadcasted_iota(f32, (N, N), 0)
  ops = [
      lambda: jnp.exp(a * 0.1) - b,
      lambda: jnp.maximum(a, b) * 2.0,
      lambda: a - a.max(axis=1, keepdims=True),            # reduce + size-1 broadcast
      lambda: lax.broadcast_in_dim(a.sum(0), (N, N), (1,)),
      lambda: a + rows,                                     # iota varies along axis 0
      lambda: a.T,
      lambda: jnp.concatenate([a[:, :2], b[:, 2:]], axis=1),
      lambda: lax.dynamic_update_slice(a, b[:2], (1, 0)),
      lambda: lax.dynamic_update_slice(a, b[:, :1] * jnp.ones((N, N)), (0, 0)),
      lambda: a @ b,
      lambda: jnp.cumsum(a, axis=1),                        # unknown to the analysis
      lambda: a.reshape(N, 1, N).reshape(N, N) + b.reshape(N * N).reshape(N, N),
      lambda: jnp.where(rows > 1, a, b),
      lambda: lax.cond(a.sum() > 0, lambda x, y: x * 2.0, lambda x, y: y + 1.0, a, b),
      lambda: lax.fori_loop(0, 3, lambda i, c: (c[0] + c[1], c[1] * 0.5), (a, b))[0],
      lambda: lax.fori_loop(0, 2, lambda i, c: c.at[i].set(b[0]), a),
      lambda: jnp.broadcast_to(lax.scan(lambda c, r: (c + r, c * 2.0), a[0], b)[0], (N, N)),
      lambda: lax.scan(lambda c, r: (c, r + c), a[0], b)[1],
      lambda: jnp.pad(a[:, :3], ((0, 0), (0, 1)), constant_values=1.0),
      lambda: jnp.tile(a[:, :2], (1, 2)),
      lambda: jax.jit(lambda x: jnp.tanh(x) + b)(a),
      lambda: lax.while_loop(lambda c: c[0] < 2,
                             lambda c: (c[0] + 1, c[1].at[c[0]].set(b[0])), (0, a))[1],
  ]
  return ops[kind % len(ops)]()


def _constant_input(rng: np.random.Generator, axes: frozenset) -> np.ndarray:
  shape = tuple(1 if d in axes else N for d in range(2))
  return np.broadcast_to(rng.standard_normal(shape).astype(np.float32), (N, N))


LANE, ROW = frozenset({1}), frozenset({0})


@settings(max_examples=150, deadline=None)
@example(steps=[(6, 0, 1)], in_axes=[LANE, LANE], seed=0)    # concatenate along a lane
@example(steps=[(21, 0, 1)], in_axes=[ROW, ROW], seed=1)     # a while loop sets rows
@example(steps=[(15, 0, 1)], in_axes=[ROW, ROW], seed=2)     # so does a fori_loop
@given(steps=st.lists(st.tuples(st.integers(0, 21), st.integers(0, 3), st.integers(0, 3)),
                      min_size=1, max_size=5),
       in_axes=st.lists(st.sampled_from([frozenset(), frozenset({0}), frozenset({1}),
                                         frozenset({0, 1})]), min_size=2, max_size=2),
       seed=st.integers(0, 2**16))
def test_claimed_axes_hold_in_the_values(steps, in_axes, seed):
  """Every axis `constant_axes` claims for an output is constant in the numbers."""
  def program(x, y):
    values = [x, y]
    for kind, i, j in steps:
      values.append(_op(kind, values[i % len(values)], values[j % len(values)]))
    return values[2:]

  rng = np.random.default_rng(seed)
  args = [_constant_input(rng, a) for a in in_axes]
  closed = jax.make_jaxpr(program)(*args)
  claimed = constant_axes(closed.jaxpr, in_axes)
  for out, axes in zip(program(*args), claimed):
    out = np.asarray(out)
    for d in axes:
      np.testing.assert_allclose(out, np.broadcast_to(out.take([0], axis=d), out.shape),
                                 rtol=1e-6, atol=1e-6, err_msg=f"axis {d} of {steps}")


def test_the_analysis_finds_what_it_should():
  """Not vacuous: lane-wide statistics keep their axis through every construct."""
  def step(m, l, s):
    m_next = jnp.maximum(m, s.max(-1, keepdims=True))
    alpha = jnp.exp(m - m_next)
    l_next = lax.cond(s.sum() > 0, lambda: alpha * l + s.sum(-1, keepdims=True),
                      lambda: l)
    l_next = lax.fori_loop(0, 2, lambda i, c: c * 0.5 + alpha, l_next)
    return m_next, l_next, s - m_next
  x = jnp.ones((N, N))
  jaxpr = jax.make_jaxpr(step)(x, x, x).jaxpr
  lane = frozenset({1})
  assert constant_axes(jaxpr, [lane, lane, frozenset()]) == [lane, lane, frozenset()]


def test_narrow_keeps_the_axes_asked_for():
  """A value held narrow along more axes than a buffer drops comes back in the
  buffer's shape."""
  held = np.float32([[2.5]])
  value = replicated_scratch.Wide(jnp.asarray(held), frozenset({0, 1}), (3, 4))
  np.testing.assert_array_equal(replicated_scratch.narrow(value, frozenset({1})),
                                np.full((3, 1), 2.5, np.float32))
  np.testing.assert_array_equal(replicated_scratch.narrow(value, frozenset({0, 1})), held)


# ------------------------------------------------------------------ kernels
LANES = 128


def _attention_kernel(causal: bool):
  """Online softmax with the running max and sum kept lane-wide, as TPU kernels do."""
  def kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _init():
      m_ref[...] = jnp.full_like(m_ref, -1e30)
      l_ref[...] = jnp.zeros_like(l_ref)
      acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(j <= i if causal else j >= 0)
    def _step():
      s = jnp.dot(q_ref[...], k_ref[...].T, precision=lax.Precision.HIGHEST)
      if causal:
        bq, bk = s.shape
        rows = i * bq + lax.broadcasted_iota(jnp.int32, s.shape, 0)
        cols = j * bk + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(rows >= cols, s, -1e30)
      m_prev, l_prev = m_ref[...], l_ref[...]
      m_next = jnp.maximum(m_prev, s.max(-1, keepdims=True))
      p = jnp.exp(s - m_next[:, :1])
      alpha = jnp.exp(m_prev - m_next)
      l_ref[...] = alpha * l_prev + lax.broadcast_in_dim(p.sum(-1), l_prev.shape, (0,))
      m_ref[...] = m_next
      acc_ref[...] = alpha[:, :1] * acc_ref[...] + jnp.dot(
          p, v_ref[...], precision=lax.Precision.HIGHEST)

    @pl.when(j == pl.num_programs(1) - 1)
    def _out():
      o_ref[...] = acc_ref[...] / l_ref[...][:, :1]
  return kernel


def _attention(q, k, v, *, block: int, causal: bool, semantics=None):
  t, d = q.shape
  grid = (t // block, t // block)
  kwargs = {} if semantics is None else dict(
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics))
  return pl.pallas_call(
      _attention_kernel(causal), out_shape=jax.ShapeDtypeStruct((t, d), f32), grid=grid,
      in_specs=[pl.BlockSpec((block, d), lambda i, j: (i, 0)),
                pl.BlockSpec((block, d), lambda i, j: (j, 0)),
                pl.BlockSpec((block, d), lambda i, j: (j, 0))],
      out_specs=pl.BlockSpec((block, d), lambda i, j: (i, 0)),
      scratch_shapes=[pltpu.VMEM((block, LANES), f32), pltpu.VMEM((block, LANES), f32),
                      pltpu.VMEM((block, d), f32)], **kwargs)(q, k, v)


def _reference(q, k, v, causal):
  s = jnp.dot(q, k.T, precision=lax.Precision.HIGHEST)
  if causal:
    s = jnp.where(jnp.tril(jnp.ones(s.shape, bool)), s, -jnp.inf)
  return jnp.dot(jax.nn.softmax(s, axis=-1), v, precision=lax.Precision.HIGHEST)


def _carried_shapes(fn, *args):
  eqns = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]
  kernel = eqns[0].params["kernel"]
  plan = plan_of(kernel)
  return executor.discharged_body(kernel, None, plan.vectorized)[1], plan


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("semantics", [None, ("parallel", "arbitrary")])
def test_lane_wide_statistics_are_carried_narrow(causal, semantics):
  t, d, block = 64, 16, 16
  q, k, v = (random_array((t, d), seed=s) for s in range(3))
  fn = lambda q, k, v: _attention(q, k, v, block=block, causal=causal, semantics=semantics)
  shapes, plan = _carried_shapes(fn, q, k, v)
  assert shapes == [(block, 1), (block, 1), (block, d)]
  assert any("scratch carried narrow" in r for r in plan.reasons)
  assert_close(jax.jit(fn)(q, k, v), _reference(q, k, v, causal), rtol=2e-5, atol=2e-5)


def _lane_kernel(write):
  """Sums each row of x's blocks into lanes of a (rows, 128) scratch, `write` says how;
  the output is the whole scratch after the last step."""
  def kernel(x_ref, o_ref, acc_ref):
    j = pl.program_id(0)

    @pl.when(j == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    write(acc_ref, x_ref[...].sum(-1, keepdims=True), j)

    @pl.when(j == pl.num_programs(0) - 1)
    def _():
      o_ref[...] = acc_ref[...]
  return kernel


def _lanes(x, write):
  rows, cols = x.shape
  return pl.pallas_call(
      _lane_kernel(write), out_shape=jax.ShapeDtypeStruct((rows, LANES), f32),
      grid=(cols // 8,), in_specs=[pl.BlockSpec((rows, 8), lambda j: (0, j))],
      out_specs=pl.BlockSpec((rows, LANES), lambda j: (0, 0)),
      scratch_shapes=[pltpu.VMEM((rows, LANES), f32)])(x)


def _lane0(ref, total, j):
  ref[:, 0:1] += total


def _lane_j(ref, total, j):
  ref[...] += jnp.where(lax.broadcasted_iota(jnp.int32, ref.shape, 1) == j, total, 0.0)


def _every_lane(ref, total, j):
  ref[...] += jnp.broadcast_to(total, ref.shape)


def _lane_by_loop(ref, total, j):
  def body(c, _):
    ref[:, pl.ds(c, 1)] += total * (c + 1).astype(f32)
    return c + 1, None
  lax.scan(body, 0, None, length=3)


def _row_sums(x):
  return x.sum(-1, keepdims=True)


@pytest.mark.parametrize("write, narrow, model", [
    (_lane0, False, lambda x: np.pad(_row_sums(x), ((0, 0), (0, LANES - 1)))),
    (_lane_j, False, lambda x: np.pad(x.reshape(8, 8, 8).sum(-1), ((0, 0), (0, LANES - 8)))),
    (_every_lane, True, lambda x: np.broadcast_to(_row_sums(x), (8, LANES))),
    (_lane_by_loop, False,
     lambda x: np.pad(_row_sums(x) * np.arange(1, 4), ((0, 0), (0, LANES - 3)))),
], ids=["lane 0", "lane j", "every lane", "lanes in a loop"])
def test_scratch_that_only_looks_lane_wide_stays_whole(write, narrow, model):
  """Partial writes, lane-dependent values and loops over lanes keep the buffer whole;
  results against NumPy models of the kernels."""
  x = random_array((8, 64), seed=4)
  shapes, _ = _carried_shapes(lambda x: _lanes(x, write), x)
  assert (shapes == [(8, 1)]) == narrow
  assert_close(jax.jit(lambda x: _lanes(x, write))(x), model(np.asarray(x)),
               rtol=1e-5, atol=1e-5)

"""Loops whose trip count has a static bound run as masked fixed-length loops on the
XLA backend (bounded_loops.py), so the grid axes feeding the count can be vectorized;
every case is checked against jax.numpy on random inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallet as pl
from helpers import assert_close, random_array, sds
from pallet.backends import xla as xla_backend
from pallet.backends.xla import bounded_loops, plan as plan_lib, plan_of

f32 = jnp.float32
pytestmark = pytest.mark.cpu_only


def _plan(fn, *args):
  eqns = [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]
  assert len(eqns) == 1
  return plan_of(eqns[0].params["kernel"]), eqns[0].params["kernel"]


def _split_sums(x, lengths, *, block=8, splits=4, clamp=True, gather=False, idx=None,
                check=False):
  """Decode-attention shape: program (b, s) sums the rows of split s of sequence b
  that lie before lengths[b], one `block`-row block per loop step; the trip count is
  read from data and, with `clamp`, capped at the split's block count."""
  batch, seq, width = x.shape
  per_split = seq // splits

  def kernel(len_ref, x_ref, *rest):
    o_ref = rest[-1]
    s = pl.program_id(1)
    start = s * per_split
    end = jnp.minimum(start + per_split, len_ref[0]) if clamp else len_ref[0]
    steps = (end - start + block - 1) // block
    if clamp:
      steps = jnp.minimum(steps, per_split // block)

    def step(j, acc):
      rows = start + j * block + lax.broadcasted_iota(jnp.int32, (block, width), 0)
      if gather:
        picked = x_ref[rest[0][pl.ds(j * block, block)], :]
      else:
        picked = x_ref[pl.ds(start + j * block, block), :]
      if check:
        pl.debug_check(j * block < per_split, "a step past the split")
      return acc + jnp.where(rows < len_ref[0], picked, 0.0)
    o_ref[...] = lax.fori_loop(0, steps, step, jnp.zeros((block, width), f32))

  in_specs = [pl.BlockSpec((1,), lambda b, s: (b,)),
              pl.BlockSpec((None, seq, width), lambda b, s: (b, 0, 0))]
  args = [lengths, x]
  if gather:
    in_specs.append(pl.BlockSpec((per_split,), lambda b, s: (s,)))
    args.append(idx)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((batch, splits, block, width), f32),
      grid=(batch, splits), in_specs=in_specs,
      out_specs=pl.BlockSpec((None, None, block, width), lambda b, s: (b, s, 0, 0)))(*args)


def _split_sums_reference(x, lengths, *, block=8, splits=4):
  batch, seq, width = x.shape
  masked = jnp.where(jnp.arange(seq)[None, :, None] < lengths[:, None, None], x, 0.0)
  return masked.reshape(batch, splits, seq // splits // block, block, width).sum(2)


def test_data_dependent_trip_count_with_a_static_cap_is_masked_and_vectorized():
  x = random_array((3, 64, 16))
  lengths = jnp.array([5, 64, 33], jnp.int32)
  plan, _ = _plan(_split_sums, x, lengths)
  assert plan.bounded_loops and plan.vectorized == [0, 1] and plan.outer == []
  assert "masked fixed-length loops" in plan.describe() and "at most 2 steps" in plan.describe()
  assert_close(_split_sums(x, lengths), _split_sums_reference(x, lengths))


def test_lengths_ending_inside_a_split_and_empty_splits_match_jnp():
  x = random_array((4, 128, 8))
  lengths = jnp.array([1, 127, 0, 70], jnp.int32)
  fn = lambda x, n: _split_sums(x, n, block=4, splits=2)   # 16 steps a split: a fori loop
  plan, _ = _plan(fn, x, lengths)
  assert plan.bounded_loops and "at most 16 steps" in plan.describe()
  assert_close(fn(x, lengths), _split_sums_reference(x, lengths, block=4, splits=2))


def test_trip_count_read_from_data_without_a_cap_keeps_the_loop():
  x = random_array((2, 64, 16))
  lengths = jnp.array([40, 9], jnp.int32)
  fn = lambda x, n: _split_sums(x, n, splits=2, clamp=False)
  plan, _ = _plan(fn, x, lengths)
  assert not plan.bounded_loops and plan.outer == [1]
  assert "no static bound on its trip count" in plan.describe()
  # uncapped, a split's loop runs on past its end, up to the length
  xs = np.asarray(x)
  expected = np.zeros((2, 2, 8, 16), np.float32)
  for b, n in enumerate(np.asarray(lengths)):
    for split in range(2):
      for row in range(split * 32, n):
        expected[b, split, row % 8] += xs[b, row]
  assert_close(fn(x, lengths), expected)


def test_loop_gathering_at_indices_read_from_data_keeps_the_loop():
  x = random_array((2, 64, 16))
  lengths = jnp.array([64, 64], jnp.int32)
  idx = jax.random.permutation(jax.random.key(3), 64).astype(jnp.int32)
  fn = lambda x, n, idx: _split_sums(x, n, gather=True, idx=idx)
  plan, _ = _plan(fn, x, lengths, idx)
  assert not plan.bounded_loops and "gathers at indices read from data" in plan.describe()
  expected = x[:, idx].reshape(2, 4, 2, 8, 16).sum(2)
  assert_close(fn(x, lengths, idx), expected)


def test_bound_keeps_the_correlation_of_a_grid_index_used_twice():
  # end - start <= 16 at every grid point, though start ranges over [0, 48]
  x = random_array((1, 64, 16))
  _, kernel = _plan(_split_sums, x, jnp.array([64], jnp.int32))
  (loop,) = bounded_loops.bounds(kernel).bounded
  assert loop.bound == 2 and loop.steps == 8   # 2 steps x 4 splits x 1 sequence


def test_final_counter_of_a_bounded_while_loop_is_exact():
  def kernel(n_ref, x_ref, o_ref):
    def cond(c):
      return c[0] < jnp.minimum(n_ref[0] + pl.program_id(0), 3)

    def body(c):
      return c[0] + 1, c[1] * 2.0 + x_ref[...]
    i, acc = lax.while_loop(cond, body, (jnp.int32(0), jnp.zeros((8,), f32)))
    o_ref[...] = acc + i.astype(f32)

  x = random_array((4, 8))
  n = jnp.array([1], jnp.int32)
  fn = lambda n, x: pl.pallas_call(
      kernel, out_shape=sds(x), grid=(4,),
      in_specs=[pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((None, 8), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((None, 8), lambda i: (i, 0)))(n, x)
  plan, _ = _plan(fn, n, x)
  assert plan.bounded_loops and plan.vectorized == [0]
  expected = []
  for p in range(4):
    steps = min(1 + p, 3)
    acc = np.zeros(8, np.float32)
    for _ in range(steps):
      acc = acc * 2 + np.asarray(x[p])
    expected.append(acc + steps)
  assert_close(fn(n, x), jnp.stack(expected))


def test_loop_kept_when_each_looped_step_has_enough_work(monkeypatch):
  monkeypatch.setattr(plan_lib, "LOOP_STEP_FLOPS", 0)
  xla_backend._planned.cache_clear()
  try:
    x = random_array((3, 64, 16))
    lengths = jnp.array([5, 64, 33], jnp.int32)
    plan, _ = _plan(_split_sums, x, lengths)
    assert not plan.bounded_loops and plan.outer == [1]
    assert "while loops kept: looped, each step" in plan.describe()
    assert_close(_split_sums(x, lengths), _split_sums_reference(x, lengths))
  finally:
    xla_backend._planned.cache_clear()


def test_loop_with_checks_in_its_body_keeps_the_loop():
  # a masked step past a program's trip count would run the check on values the
  # program never computes, and fail
  x = random_array((3, 64, 16))
  lengths = jnp.array([5, 64, 33], jnp.int32)
  fn = lambda x, n: _split_sums(x, n, check=True)
  with pl.enable_debug_checks(True):
    plan, _ = _plan(fn, x, lengths)
    out = fn(x, lengths)
  assert not plan.bounded_loops and "has effects" in plan.describe()
  assert_close(out, _split_sums_reference(x, lengths))


def test_select_of_per_grid_point_and_scalar_bounds_broadcasts():
  # A select between a bound known per grid point (an array) and a constant (a
  # scalar): the bounds combine elementwise (flash attention's windowed dk/dv pass).
  jaxpr = jax.make_jaxpr(lambda p, x: lax.select(p, x, 3))(True, 1).jaxpr
  per_point = (np.array([0.0, 2.0, 5.0]), np.array([1.0, 4.0, 9.0]))
  lo, hi = bounded_loops._interval_of_eqn(
      jaxpr.eqns[-1], [(np.float64(0), np.float64(1)), per_point,
                       (np.float64(3), np.float64(3))])[0]
  np.testing.assert_array_equal(lo, [0.0, 2.0, 3.0])
  np.testing.assert_array_equal(hi, [3.0, 4.0, 9.0])

"""A `fori_loop` whose bounds come from program ids the plan knows (a grid axis of one
step, or an unrolled grid) runs as its body inlined when it makes at most one trip,
and is skipped when it makes none: XLA gets no while loop for it (a causal kernel's
key range per query block, at sizes of one block), so it never compiles it. Loops of more trips, or whose
bounds depend on data, stay loops. Checked against jax.numpy on random inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallet as pl
from helpers import assert_close, random_array

pytestmark = pytest.mark.cpu_only
f32 = jnp.float32


def _row_sums(x, upper_of, grid_rows):
  """o[i] = sum of rows [0, upper_of(i)) of the block, one block of 8 rows per step."""
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)

    def body(r, acc):
      return acc + x_ref[pl.ds(r, 1), :]
    o_ref[...] = lax.fori_loop(0, upper_of(i), body, jnp.zeros((1, x.shape[1]), f32))

  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((grid_rows, x.shape[1]), f32),
      grid=(grid_rows,), in_specs=[pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((1, x.shape[1]), lambda i: (i, 0)))(x)


def _reference(x, upper_of, grid_rows):
  blocks = x.reshape(grid_rows, 8, -1)
  return jnp.stack([blocks[i, :upper_of(i)].sum(0) for i in range(grid_rows)])


def _whiles(fn, *args) -> int:
  """While loops in the program pallet hands to XLA (XLA's own simplifier removes a
  loop of constant trip count 0 or 1 too, but only after compiling it)."""
  return jax.jit(fn).lower(*args).as_text().count("stablehlo.while")


@pytest.mark.parametrize("trips", [0, 1])
def test_a_loop_of_at_most_one_known_trip_is_inlined(trips):
  x = random_array((8, 16), seed=trips)
  upper = lambda i: jnp.minimum(i + trips, 8)      # program id 0: `trips` trips
  call = lambda x: _row_sums(x, upper, 1)
  assert_close(call(x), _reference(x, lambda i: trips, 1))
  assert _whiles(call, x) == 0


def test_unrolled_grid_steps_inline_their_loops():
  """A grid of 2 steps is unrolled (the plan's GRID_UNROLL_STEPS), so each step's
  bound is a literal: 0 and 1 trips (a scan of one step, which the pass inlines too),
  no loop left."""
  x = random_array((16, 16), seed=3)
  upper = lambda i: jnp.minimum(i, 1)
  call = lambda x: _row_sums(x, upper, 2)
  assert_close(call(x), _reference(x, lambda i: min(i, 1), 2))
  assert _whiles(call, x) == 0


def test_loops_of_more_trips_or_data_bounds_stay_loops():
  x = random_array((8, 16), seed=4)
  upper = lambda i: i + 3                           # three trips: kept a loop
  call = lambda x: _row_sums(x, upper, 1)
  assert_close(call(x), _reference(x, lambda i: 3, 1))
  assert _whiles(call, x) == 1

  n = jnp.array([2], jnp.int32)

  def kernel(n_ref, x_ref, o_ref):                  # bound read from data: unknown
    o_ref[...] = lax.fori_loop(0, n_ref[0], lambda r, a: a + x_ref[pl.ds(r, 1), :],
                               jnp.zeros((1, 16), f32))

  data_call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1, 16), f32))
  assert_close(data_call(n, x), x[:2].sum(0, keepdims=True))
  assert _whiles(data_call, n, x) == 1


def test_a_causal_flash_attention_of_one_block_has_no_loop():
  """pallet.ops' causal attention at 384 rows (one block on the CPU): its masked and
  unmasked key loops make 1 and 0 trips; the program has no while loop."""
  from pallet import ops
  q, k, v = (random_array((1, 2, 48, 16), seed=s) for s in (5, 6, 7))
  fn = lambda q, k, v: ops.flash_attention(q, k, v, causal=True)
  assert_close(fn(q, k, v), ops.attention_reference(q, k, v, causal=True))
  assert _whiles(fn, q, k, v) == 0
  np.testing.assert_array_equal(np.isfinite(np.asarray(fn(q, k, v))), True)

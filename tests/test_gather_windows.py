"""`table_ref[idx]` (an index array on some dimensions, slices on the others) runs as
a gather of windows (rows), as jax.numpy's `table[idx]` does, not as a gather of
every element: JAX's state discharge turns the slices into iota index columns, and
the static-index pass (`backends/xla/gather_windows.py`) turns them back. Checked
against jax.numpy on random inputs and indices, and on the program's gathers."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallet as pl
from helpers import assert_close, random_array

pytestmark = pytest.mark.cpu_only
f32 = jnp.float32


def _gather_call(table_shape, index, grid_rows, block_rows):
  """A kernel reading `table_ref[index(idx)]` for a block of `block_rows` indices
  per grid step, the whole table in every step."""
  n = grid_rows * block_rows

  def kernel(t_ref, i_ref, o_ref):
    o_ref[...] = t_ref[index(i_ref[...])]

  out = jax.eval_shape(lambda t, i: t[index(i)], jax.ShapeDtypeStruct(table_shape, f32),
                       jax.ShapeDtypeStruct((block_rows,), jnp.int32))
  rest = out.shape[1:]
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((n, *rest), f32), grid=(grid_rows,),
      in_specs=[pl.BlockSpec(table_shape, lambda i: (0,) * len(table_shape)),
                pl.BlockSpec((block_rows,), lambda i: (i,))],
      out_specs=pl.BlockSpec((block_rows, *rest), lambda i: (i,) + (0,) * len(rest)))


def _element_gathers(fn, *args) -> list[str]:
  """The gathers of `fn`'s lowered program that take single elements of a 2-D+ operand."""
  text = jax.jit(fn).lower(*args).as_text()
  sizes = re.findall(r"slice_sizes = array<i64: ([0-9, ]+)>", text)
  return [s for s in sizes if s.count(",") >= 1 and set(s.replace(" ", "").split(",")) == {"1"}]


CASES = {
    "rows": ((64, 128), lambda i: (i,)),
    "rows_with_lane_slice": ((64, 128), lambda i: (i, slice(8, 40))),
    "columns": ((32, 64), lambda i: (slice(None), i)),
    "middle_of_three": ((8, 40, 16), lambda i: (slice(2, 6), i, slice(None))),
}


@pytest.mark.parametrize("name", CASES)
def test_index_array_with_slices_matches_jax_numpy(name):
  table_shape, index = CASES[name]
  table = random_array(table_shape, seed=1)
  axis = next(k for k, s in enumerate(index(0)) if not isinstance(s, slice))
  idx = jax.random.randint(jax.random.key(2), (64,), -table_shape[axis], table_shape[axis])

  def kernel(t_ref, i_ref, o_ref):
    o_ref[...] = t_ref[index(i_ref[...])]

  expected = table[index(idx)]
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(expected.shape, f32))
  assert_close(call(table, idx), expected, rtol=0, atol=0)
  if name == "rows":   # the same through a grid of index blocks
    assert_close(_gather_call(table_shape, index, 4, 16)(table, idx), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["rows", "rows_with_lane_slice"])
def test_program_gathers_rows_not_elements(name):
  table_shape, index = CASES[name]
  table = random_array(table_shape, seed=3)
  idx = jax.random.randint(jax.random.key(4), (64,), 0, table_shape[0])
  call = _gather_call(table_shape, index, 4, 16)
  assert _element_gathers(call, table, idx) == []
  assert _element_gathers(lambda t, i: t[index(i)], table, idx) == []


def test_two_index_arrays_stay_an_element_gather():
  """Both dimensions indexed by data: nothing is a window, and the values are right."""
  table = random_array((16, 24), seed=5)
  rows = jax.random.randint(jax.random.key(6), (32,), 0, 16)
  cols = jax.random.randint(jax.random.key(7), (32,), 0, 24)

  def kernel(t_ref, r_ref, c_ref, o_ref):
    o_ref[...] = t_ref[r_ref[...], c_ref[...]]

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32,), f32))
  assert_close(call(table, rows, cols), table[rows, cols], rtol=0, atol=0)


def test_gather_windows_under_vmap_and_grad():
  table = random_array((32, 16), seed=8)
  idx = jax.random.randint(jax.random.key(9), (3, 32), 0, 32)
  call = _gather_call((32, 16), lambda i: (i,), 2, 16)
  assert_close(jax.vmap(call, in_axes=(None, 0))(table, idx), table[idx], rtol=0, atol=0)
  weights = random_array((3, 32, 16), seed=10)
  grad = jax.grad(lambda t: jnp.sum(jax.vmap(call, in_axes=(None, 0))(t, idx) * weights))
  expected = jax.grad(lambda t: jnp.sum(t[idx] * weights))
  assert_close(grad(table), expected(table))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 12), cols=st.integers(2, 12), depth=st.integers(1, 4),
       axis=st.integers(0, 2), data=st.data())
def test_random_slices_around_an_index_array(rows, cols, depth, axis, data):
  """One dimension indexed by an array, the others by random static slices."""
  shape = (rows, cols, depth)
  index = []
  for k, n in enumerate(shape):
    if k == axis:
      index.append(None)
      continue
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    index.append(slice(start, stop))
  table = random_array(shape, seed=rows * 100 + cols)
  idx = jnp.asarray(data.draw(st.lists(st.integers(-shape[axis], shape[axis] - 1),
                                       min_size=8, max_size=8)), jnp.int32)
  make_index = lambda i: tuple(i if s is None else s for s in index)

  def kernel(t_ref, i_ref, o_ref):
    o_ref[...] = t_ref[make_index(i_ref[...])]

  expected = table[make_index(idx)]
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(expected.shape, f32))
  np.testing.assert_array_equal(np.asarray(call(table, idx)), np.asarray(expected))


def test_store_through_an_index_array_scatters_rows():
  """`o_ref[idx, 8:40] = v`: each index writes a window of 32 elements of its row."""
  values = random_array((16, 32), seed=11)
  idx = jax.random.permutation(jax.random.key(12), 64)[:16].astype(jnp.int32)
  base = random_array((64, 128), seed=13)

  def kernel(v_ref, i_ref, b_ref, o_ref):
    o_ref[...] = b_ref[...]
    o_ref[i_ref[...], 8:40] = v_ref[...]

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 128), f32))
  expected = base.at[idx, 8:40].set(values)
  np.testing.assert_array_equal(np.asarray(call(values, idx, base)), np.asarray(expected))
  text = jax.jit(call).lower(values, idx, base).as_text()
  assert "inserted_window_dims = [0, 1]" not in text
  assert "inserted_window_dims = [0]" in text


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(2, 12), cols=st.integers(2, 12), axis=st.integers(0, 1),
       data=st.data())
def test_random_stores_through_an_index_array(rows, cols, axis, data):
  """Distinct (possibly negative) indices on one dimension, a random slice on the other."""
  shape = (rows, cols)
  other = shape[1 - axis]
  start = data.draw(st.integers(0, other - 1))
  stop = data.draw(st.integers(start + 1, other))
  picks = data.draw(st.lists(st.integers(0, shape[axis] - 1), min_size=1,
                             max_size=shape[axis], unique=True))
  negative = data.draw(st.booleans())
  idx = jnp.asarray([p - shape[axis] if negative else p for p in picks], jnp.int32)
  where = (lambda i: (i, slice(start, stop))) if axis == 0 else (
      lambda i: (slice(start, stop), i))
  base = random_array(shape, seed=rows * 31 + cols)
  values = random_array(jax.eval_shape(lambda b: b[where(idx)], base).shape, seed=7)

  def kernel(v_ref, i_ref, b_ref, o_ref):
    o_ref[...] = b_ref[...]
    o_ref[where(i_ref[...])] = v_ref[...]

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(shape, f32))
  expected = base.at[where(idx)].set(values)
  np.testing.assert_array_equal(np.asarray(call(values, idx, base)), np.asarray(expected))


@pytest.mark.parametrize("bound", ["static", "data"])
def test_rows_gathered_inside_a_loop_body(bound):
  """Paged attention's page read: `pages_ref[table_ref[j]]` inside a `fori_loop` (a
  scan with static bounds, a while loop with a bound read from data) and a `pl.when`
  gathers whole pages, as outside a loop."""
  pages = random_array((12, 4, 8), seed=14)
  table = jax.random.permutation(jax.random.key(15), 12)[:6].astype(jnp.int32).reshape(3, 2)

  def kernel(t_ref, p_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)

    def body(j, _):
      @pl.when(j < 3)
      def _():
        o_ref[...] += jnp.sum(p_ref[t_ref[j]], axis=0)
      return 0
    upper = 4 if bound == "static" else 4 + 0 * t_ref[0, 0]
    jax.lax.fori_loop(0, upper, body, 0)

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4, 8), f32))
  expected = pages[table.reshape(-1)].sum(0)
  assert_close(call(table, pages), expected)
  assert _element_gathers(call, table, pages) == []

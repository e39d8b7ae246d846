"""Property-based tests: random shapes, block shapes (divisible or not), grids and index
maps, each compared to a jax.numpy reference. Outputs alias a poisoned (NaN / INT_MIN)
buffer, so any element the kernel should have written but did not shows up."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

import pallet as pl
from helpers import assert_close, pallas_call, poisoned, random_array

SETTINGS = settings(max_examples=10, deadline=None, derandomize=True)
dims = st.integers(1, 13)
dtypes = st.sampled_from([jnp.float32, jnp.int32])


def _op(x):
  """The kernel body's elementwise function (exact for ints, simple for floats)."""
  return x * 3 - 1


def _run_poisoned(kernel, x, in_spec, out_spec, grid, out_shape=None):
  """Runs `kernel(x_ref, o_ref)` with the output aliased to a poisoned buffer."""
  out_shape = out_shape or jax.ShapeDtypeStruct(x.shape, x.dtype)

  def with_buffer(x_ref, buf_ref, o_ref):
    kernel(x_ref, o_ref)

  buf_spec = out_spec if out_spec is not None else None
  return pallas_call(with_buffer, out_shape=out_shape, grid=grid,
                     in_specs=[in_spec, buf_spec], out_specs=out_spec,
                     input_output_aliases={1: 0})(x, poisoned(out_shape.shape,
                                                              out_shape.dtype))


def _elementwise(x_ref, o_ref):
  o_ref[...] = _op(x_ref[...])


@st.composite
def shapes_and_blocks(draw, max_rank=3):
  rank = draw(st.integers(1, max_rank))
  shape = tuple(draw(dims) for _ in range(rank))
  block = tuple(draw(st.integers(1, n)) for n in shape)
  return shape, block


@SETTINGS
@given(shapes_and_blocks(), dtypes)
def test_identity_index_map_any_block_shape(shape_block, dtype):
  shape, block = shape_block
  grid = tuple(pl.cdiv(n, b) for n, b in zip(shape, block))
  spec = pl.BlockSpec(block, lambda *ids: ids)
  x = random_array(shape, dtype)
  out = _run_poisoned(_elementwise, x, spec, spec, grid)
  assert_close(out, _op(x))


@SETTINGS
@given(shapes_and_blocks(max_rank=2), dtypes)
def test_transposed_grid_order(shape_block, dtype):
  # Grid axes listed in reverse order of the array dims they walk.
  shape, block = shape_block
  grid = tuple(pl.cdiv(n, b) for n, b in zip(shape, block))[::-1]
  spec = pl.BlockSpec(block, lambda *ids: ids[::-1])
  x = random_array(shape, dtype)
  out = _run_poisoned(_elementwise, x, spec, spec, grid)
  assert_close(out, _op(x))


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 7), dtypes)
def test_reversed_index_map(n_blocks, block, cols, dtype):
  shape = (n_blocks * block, cols)
  x = random_array(shape, dtype)
  out = _run_poisoned(_elementwise, x,
                      pl.BlockSpec((block, cols), lambda i: (n_blocks - 1 - i, 0)),
                      pl.BlockSpec((block, cols), lambda i: (i, 0)), (n_blocks,))
  expected = _op(x).reshape(n_blocks, block, cols)[::-1].reshape(shape)
  assert_close(out, expected)


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 5), st.data(), dtypes)
def test_constant_index_map(n_blocks, block, data, dtype):
  which = data.draw(st.integers(0, n_blocks - 1))
  x = random_array((n_blocks * block,), dtype)
  out = _run_poisoned(_elementwise, x, pl.BlockSpec((block,), lambda i: (which,)),
                      pl.BlockSpec((block,), lambda i: (i,)), (n_blocks,))
  assert_close(out, jnp.tile(_op(x[which * block:(which + 1) * block]), n_blocks))


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 4), st.integers(0, 3), dtypes)
def test_element_offsets_sliding_windows(n_steps, window, stride, shift, dtype):
  # Step i reads x[shift + i*stride : shift + i*stride + window] (windows may overlap
  # or leave gaps) and writes it as output block i.
  length = shift + (n_steps - 1) * stride + window
  x = random_array((length,), dtype)
  out = _run_poisoned(
      _elementwise, x,
      pl.BlockSpec((pl.Element(window),), lambda i: (shift + i * stride,)),
      pl.BlockSpec((window,), lambda i: (i,)), (n_steps,),
      out_shape=jax.ShapeDtypeStruct((n_steps * window,), x.dtype))
  expected = jnp.concatenate([x[shift + i * stride:shift + i * stride + window]
                              for i in range(n_steps)])
  assert_close(out, _op(expected))


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4),
       st.integers(0, 2))
def test_accumulation_over_a_reduction_axis(n_i, n_k, bi, bk, k_position):
  # out[i] = sum_k x[i, k] over a grid whose reduction axis sits at k_position
  # (0, 1 or 2 of a 3-axis grid with an extra size-1 parallel axis).
  order = ["i", "u"]
  order.insert(min(k_position, 2), "k")
  sizes = {"i": n_i, "k": n_k, "u": 1}
  grid = tuple(sizes[a] for a in order)
  pos = {a: order.index(a) for a in order}

  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(pos["k"]) == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    o_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True)

  x = random_array((n_i * bi, n_k * bk), jnp.int32)
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n_i * bi, 1), jnp.int32),
                    grid=grid,
                    in_specs=[pl.BlockSpec((bi, bk), lambda *g: (g[pos["i"]], g[pos["k"]]))],
                    out_specs=pl.BlockSpec((bi, 1), lambda *g: (g[pos["i"]], 0)))(x)
  assert_close(out, x.sum(1, keepdims=True))


@SETTINGS
@given(st.integers(1, 20), st.integers(1, 8), st.integers(0, 5))
def test_masked_tail_blocks(n, block, bins):
  # Triton-style masked loads/stores over a ragged length, with a histogram by
  # atomics on the side (duplicates everywhere when bins is small).
  bins = bins + 1

  def kernel(x_ref, o_ref, h_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      h_ref[...] = jnp.zeros(h_ref.shape, jnp.int32)
    offs = pl.program_id(0) * block + jnp.arange(block)
    mask = offs < n
    v = pl.load(x_ref, (offs,), mask=mask, other=0)
    pl.store(o_ref, (offs,), v * 2, mask=mask)
    pl.atomic_add(h_ref, (v % bins,), jnp.ones((block,), jnp.int32), mask=mask)

  x = random_array((n,), jnp.int32, low=0, high=30)
  out, hist = pallas_call(kernel, grid=(pl.cdiv(n, block),),
                          out_shape=(jax.ShapeDtypeStruct((n,), jnp.int32),
                                     jax.ShapeDtypeStruct((bins,), jnp.int32)))(x)
  assert_close(out, x * 2)
  np.testing.assert_array_equal(hist, np.bincount(np.asarray(x) % bins, minlength=bins))


_FOLDS = {
    # name: (init at k == 0 from the first block, step, numpy fold)
    "sum": (lambda b: b, lambda o, b: o + b, lambda bs: sum(bs)),
    "max": (lambda b: b, jnp.maximum, lambda bs: np.max(np.stack(bs), 0)),
    "decay": (lambda b: b, lambda o, b: o * 2 - b,
              lambda bs: functools.reduce(lambda o, b: o * 2 - b, bs)),
}


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3),
       st.integers(0, 1), st.sampled_from(sorted(_FOLDS)))
def test_folds_over_a_reduction_axis(n_i, n_k, bi, bk, k_first, fold):
  # A resident output block folded over k, initialised from the first block: exact
  # integer arithmetic, so any reordering or lost step shows.
  init, step, reference = _FOLDS[fold]

  def kernel(x_ref, o_ref):
    k = pl.program_id(0 if k_first else 1)

    @pl.when(k == 0)
    def _():
      o_ref[...] = init(x_ref[...])

    @pl.when(k > 0)
    def _():
      o_ref[...] = step(o_ref[...], x_ref[...])

  grid = (n_k, n_i) if k_first else (n_i, n_k)
  in_map = (lambda k, i: (i, k)) if k_first else (lambda i, k: (i, k))
  out_map = (lambda k, i: (i, 0)) if k_first else (lambda i, k: (i, 0))
  x = random_array((n_i * bi, n_k * bk), jnp.int32, low=-5, high=5)
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n_i * bi, bk), jnp.int32),
                    grid=grid, in_specs=[pl.BlockSpec((bi, bk), in_map)],
                    out_specs=pl.BlockSpec((bi, bk), out_map))(x)
  blocks = [np.asarray(x)[:, k * bk:(k + 1) * bk] for k in range(n_k)]
  np.testing.assert_array_equal(out, reference(blocks))

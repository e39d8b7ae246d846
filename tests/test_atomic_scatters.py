"""Atomics into a whole-array output run as one scatter over the grid (XLA backend,
backends/xla/scatter_accumulators.py); every result checked against jax.numpy's
`.at[].add/max/min`, and kernels outside the proven pattern still right."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
from helpers import assert_close, current_test_backend, pallas_call, random_array

i32, f32 = jnp.int32, jnp.float32
xla_only = pytest.mark.skipif(current_test_backend() != "xla",
                              reason="the plan of the XLA backend")


def _plan_and_hlo(fn, *args):
  from pallet.backends import xla
  jaxpr = jax.make_jaxpr(fn)(*args)
  kernel = next(e.params["kernel"] for e in jaxpr.jaxpr.eqns
                if e.primitive.name == "pallas_call")
  return xla.plan_of(kernel), jax.jit(fn).lower(*args).as_text()


def _one_scatter(fn, *args) -> None:
  plan, text = _plan_and_hlo(fn, *args)
  assert "one scatter per atomic" in plan.describe()
  assert "stablehlo.while" not in text


def _looped(fn, *args, why: str) -> None:
  plan, _ = _plan_and_hlo(fn, *args)
  assert "atomics not run as one scatter" in plan.describe() and why in plan.describe()


def _histogram(bins, block, grid2=1):
  """Values in (block, 8) blocks over a 2-D grid, counts aliased to a zero input."""
  def kernel(v_ref, c_in_ref, c_ref):
    del c_in_ref
    v = v_ref[...]
    pl.atomic_add(c_ref, v, jnp.ones(v.shape, i32))

  def run(values):
    n, m = values.shape
    spec = pl.BlockSpec((bins,), lambda i, j: (0,))
    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((bins,), i32),
                       grid=(n // block, m // 8),
                       in_specs=[pl.BlockSpec((block, 8), lambda i, j: (i, j)), spec],
                       out_specs=spec, input_output_aliases={1: 0},
                       compiler_params=pl.CompilerParams(
                           dimension_semantics=("arbitrary", "arbitrary")))(
        values, jnp.zeros((bins,), i32))
  return run


def test_histogram_over_a_2d_grid_counts_every_repeat():
  values = random_array((64, 24), i32, low=0, high=9)    # 0..9 into 10 bins: many repeats
  run = _histogram(bins=10, block=16)
  np.testing.assert_array_equal(run(values), jnp.zeros(10, i32).at[values].add(1))
  if current_test_backend() == "xla":
    _one_scatter(run, values)


def _scatter_rows(op="add", block=8, zero_first=False, aliased=True):
  def kernel(idx_ref, upd_ref, *refs):
    t_ref = refs[-1]
    if zero_first:
      @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
      def _():
        t_ref[...] = jnp.zeros(t_ref.shape, t_ref.dtype)
    getattr(pl, f"atomic_{op}")(t_ref, idx_ref[...], upd_ref[...])

  def run(idx, upd, table):
    rows, width = table.shape
    t_spec = pl.BlockSpec((rows, width), lambda i, j: (0, 0))
    in_specs = [pl.BlockSpec((block,), lambda i, j: (i,)),
                pl.BlockSpec((block, width), lambda i, j: (i, 0))]
    args = (idx, upd)
    if aliased:
      in_specs.append(t_spec)
      args = (idx, upd, table)
    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(table.shape, table.dtype),
                       grid=(idx.shape[0] // block, 2), in_specs=in_specs, out_specs=t_spec,
                       input_output_aliases={2: 0} if aliased else {})(*args)
  return run


@pytest.mark.parametrize("op", ["add", "max", "min"])
def test_scatter_rows_into_a_table(op):
  # negative indices count from the end; those still outside the table are dropped
  idx = random_array((48,), i32, low=-14, high=14)
  upd, table = random_array((48, 16)), random_array((10, 16))
  run = _scatter_rows(op)
  out = run(idx, upd, table)
  # the grid's second axis repeats every update once more
  expected = getattr(table.at[jnp.concatenate([idx, idx])], op)(
      jnp.concatenate([upd, upd]), mode="drop")
  assert_close(out, expected, rtol=1e-5, atol=1e-5)
  if current_test_backend() == "xla":
    _one_scatter(run, idx, upd, table)


def test_scatter_into_a_table_zeroed_on_the_first_step():
  idx = random_array((32,), i32, low=0, high=6)
  upd = random_array((32, 8))
  run = _scatter_rows(zero_first=True, aliased=False)
  out = run(idx, upd, jnp.zeros((6, 8), f32))
  expected = jnp.zeros((6, 8), f32).at[jnp.concatenate([idx, idx])].add(
      jnp.concatenate([upd, upd]))
  assert_close(out, expected, rtol=1e-5, atol=1e-5)
  if current_test_backend() == "xla":
    _one_scatter(run, idx, upd, jnp.zeros((6, 8), f32))


def _masked_two_atomics(values, weights, bins=8, block=16):
  """Two atomics per step into two outputs, one masked (the flat scatter form)."""
  def kernel(v_ref, w_ref, h_ref, s_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      h_ref[...] = jnp.zeros(h_ref.shape, i32)
      s_ref[...] = jnp.zeros(s_ref.shape, f32)
    v, w = v_ref[...], w_ref[...]
    pl.atomic_add(h_ref, v, jnp.ones(v.shape, i32), mask=w > 0)
    pl.atomic_add(s_ref, v, w)
    pl.atomic_add(s_ref, v, 2 * w)

  return pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((bins,), i32), jax.ShapeDtypeStruct((bins,), f32)),
      grid=(values.shape[0] // block,),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,))] * 2,
      out_specs=[pl.BlockSpec((bins,), lambda i: (0,))] * 2)(values, weights)


def test_masked_atomics_and_a_chain_of_two_into_one_output():
  values = random_array((64,), i32, low=0, high=7)
  weights = random_array((64,))
  h, s = _masked_two_atomics(values, weights)
  np.testing.assert_array_equal(h, jnp.zeros(8, i32).at[values].add((weights > 0).astype(i32)))
  assert_close(s, jnp.zeros(8, f32).at[values].add(3 * weights), rtol=1e-5, atol=1e-5)
  if current_test_backend() == "xla":
    _one_scatter(_masked_two_atomics, values, weights)


def _mixed(values, read_old=False, reset_step=0):
  """add then max into one histogram (read_old=False), or add whose old values are
  stored into a second whole-array output (read_old=True)."""
  def kernel(v_ref, h_ref, *o_ref):
    @pl.when(pl.program_id(0) == reset_step)
    def _():
      h_ref[...] = jnp.zeros(h_ref.shape, i32)
    v = v_ref[...]
    old = pl.atomic_add(h_ref, v, jnp.ones(v.shape, i32))
    if read_old:
      o_ref[0][pl.ds(pl.program_id(0) * 16, 16)] = old
    else:
      pl.atomic_max(h_ref, v, v)

  n = values.shape[0]
  outs = [jax.ShapeDtypeStruct((8,), i32)] + [jax.ShapeDtypeStruct((n,), i32)] * read_old
  specs = [pl.BlockSpec((8,), lambda i: (0,))] + [pl.BlockSpec((n,), lambda i: (0,))] * read_old
  return pallas_call(kernel, out_shape=outs, grid=(n // 16,),
                     in_specs=[pl.BlockSpec((16,), lambda i: (i,))], out_specs=specs)(values)


def test_atomics_outside_the_pattern_still_match():
  values = random_array((64,), i32, low=0, high=7)
  (h,) = _mixed(values)
  expected = np.zeros(8, np.int64)
  for start in range(0, 64, 16):   # within a step every add, then every max
    block = np.asarray(values[start:start + 16])
    np.add.at(expected, block, 1)
    np.maximum.at(expected, block, block)
  np.testing.assert_array_equal(h, expected)
  h, old = _mixed(values, read_old=True)
  seen = np.zeros(8, np.int64)
  expected_old = []
  for v in np.asarray(values):     # lanes in order: each sees the earlier ones
    expected_old.append(seen[v])
    seen[v] += 1
  np.testing.assert_array_equal(h, seen)
  np.testing.assert_array_equal(old, expected_old)
  h, _ = _mixed(values, read_old=True, reset_step=1)
  np.testing.assert_array_equal(h, np.bincount(np.asarray(values[16:]), minlength=8))


@xla_only
def test_kernels_outside_the_pattern_keep_their_loop():
  values = random_array((64,), i32, low=0, high=7)
  _looped(_mixed, values, why="mixes scatters of different combinations")
  _looped(lambda v: _mixed(v, read_old=True), values, why="not a chain of scatters")
  _looped(lambda v: _mixed(v, read_old=True, reset_step=1), values,
          why="zeroed at steps other than the grid's first")


def test_gradient_and_vmap_through_a_scatter_kernel():
  idx = random_array((32,), i32, low=0, high=10)
  upd, table = random_array((32, 16)), random_array((10, 16))
  run = _scatter_rows()
  cot = random_array((10, 16))
  twice = lambda u, t: t.at[jnp.concatenate([idx, idx])].add(jnp.concatenate([u, u]))
  grad = jax.grad(lambda u, t: jnp.sum(run(idx, u, t) * cot), argnums=(0, 1))
  got = grad(upd, table)
  if current_test_backend() == "xla":   # one scatter, so no loop to transpose
    assert "stablehlo.while" not in jax.jit(grad).lower(upd, table).as_text()
  want = jax.grad(lambda u, t: jnp.sum(twice(u, t) * cot), argnums=(0, 1))(upd, table)
  for g, w in zip(got, want):
    assert_close(g, w, rtol=1e-5, atol=1e-5)
  batched = random_array((3, 32, 16))
  got = jax.vmap(lambda u: run(idx, u, table))(batched)
  want = jax.vmap(lambda u: twice(u, table))(batched)
  assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op,reduce", [(pl.atomic_add, jnp.sum), (pl.atomic_max, jnp.max),
                                       (pl.atomic_min, jnp.min)],
                         ids=["add", "max", "min"])
def test_every_program_combines_into_one_whole_window(op, reduce):
  # A grid-wide reduction: each program's partial result combined atomically into one
  # whole-array output (empty scatter index vectors). XLA of jaxlib 0.10.2 kept only
  # the last program's update when such scatters were joined into one.
  x = random_array((512,))

  def kernel(x_ref, start_ref, o_ref):
    del start_ref   # aliased to o_ref
    op(o_ref, pl.ds(0, 1), reduce(x_ref[...], keepdims=True))

  whole = pl.BlockSpec(memory_space=pl.ANY)
  start = random_array((1,))
  f = pl.pallas_call(kernel, grid=(4,), out_shape=jax.ShapeDtypeStruct((1,), jnp.float32),
                     in_specs=[pl.BlockSpec((128,), lambda i: (i,)), whole], out_specs=whole,
                     input_output_aliases={1: 0})
  partials = reduce(x.reshape(4, 128), axis=1)
  want = {jnp.sum: start + jnp.sum(partials), jnp.max: jnp.maximum(start, jnp.max(partials)),
          jnp.min: jnp.minimum(start, jnp.min(partials))}[reduce]
  assert_close(jax.jit(f)(x, start), want, rtol=1e-5, atol=1e-5)

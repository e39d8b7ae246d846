"""Grid sizes computed at run time (traced values, as megablox's gmm uses them):
kernels against jax.numpy, under jit, vmap and jvp, on the backend under test, plus
the errors around them."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
import pallet.triton as plt
from pallet import tpu as pltpu
from helpers import assert_close, pallas_call, poisoned, random_array, sds
from pallet.backends.triton import TritonLoweringError
from pallet.backends.xla import plan_of
from pallet.errors import PalletError

f32 = jnp.float32


def _first_blocks_doubled(x, n, block=8):
  """Doubles the first `n` blocks of x (n traced); the rest keeps x's values (aliased)."""
  def kernel(x_ref, o_ref):
    o_ref[...] = 2 * x_ref[...]
  spec = pl.BlockSpec((block, x.shape[1]), lambda i: (i, 0))
  return pallas_call(kernel, out_shape=sds(x), grid=(n,), in_specs=[spec], out_specs=spec,
                     input_output_aliases={0: 0})(x)


def _doubled_reference(x, n, block=8):
  rows = jnp.arange(x.shape[0])[:, None] < n * block
  return jnp.where(rows, 2 * x, x)


@pytest.mark.parametrize("n", [0, 1, 3, 8])
def test_traced_grid_size_under_jit(n):
  x = random_array((64, 16))
  out = jax.jit(_first_blocks_doubled)(x, jnp.int32(n))
  assert_close(out, _doubled_reference(x, n))


def test_one_compilation_serves_every_size():
  x = random_array((64, 16))
  fn = jax.jit(_first_blocks_doubled)
  for n in (2, 5):
    assert_close(fn(x, jnp.int32(n)), _doubled_reference(x, n))
  assert fn._cache_size() == 1


def test_concrete_array_grid_entries_are_static():
  x = random_array((64, 16))
  out = _first_blocks_doubled(x, jnp.int32(3))
  assert_close(out, _doubled_reference(x, 3))


@pytest.mark.cpu_only
def test_plan_describes_the_dynamic_loop():
  x = random_array((64, 16))
  jaxpr = jax.make_jaxpr(_first_blocks_doubled)(x, jnp.int32(3))
  kernel = next(e for e in jaxpr.eqns if e.primitive.name == "pallas_call").params["kernel"]
  assert kernel.grid_mapping.grid == (None,)
  assert kernel.grid_mapping.dynamic_axes == (0,)
  assert "computed at run time" in plan_of(kernel).describe()


@jax.jit
def _row_sums_of_first_columns(x, n_cols):
  """out[i] = sum of the first n_cols*bk columns of row block i: a reduction axis of
  traced length, an f32 scratch accumulator, num_programs of the traced axis."""
  bm, bk = 8, 16

  def kernel(x_ref, o_ref, acc_ref):
    k = pl.program_id(1)

    @pl.when(k == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True)

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = acc_ref[...]

  return pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], 1), f32),
      grid=(x.shape[0] // bm, n_cols),
      in_specs=[pl.BlockSpec((bm, bk), lambda i, k: (i, k))],
      out_specs=pl.BlockSpec((bm, 1), lambda i, k: (i, 0)),
      scratch_shapes=[pltpu.VMEM((bm, 1), f32)])(x)


@pytest.mark.parametrize("n_cols", [1, 3, 4])
def test_traced_reduction_axis_with_scratch(n_cols):
  x = random_array((32, 64))
  out = _row_sums_of_first_columns(x, jnp.int32(n_cols))
  assert_close(out, jnp.sum(x[:, :16 * n_cols], axis=1, keepdims=True))


def test_num_programs_of_a_traced_axis():
  def kernel(o_ref):
    o_ref[...] = jnp.full(o_ref.shape, pl.num_programs(0) * 100 + pl.program_id(0), jnp.int32)

  @jax.jit
  def run(n):
    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 4), jnp.int32), grid=(n,),
                       out_specs=pl.BlockSpec((1, 4), lambda i: (i, 0)))()

  out = run(jnp.int32(5))
  np.testing.assert_array_equal(np.asarray(out[:5]),
                                np.repeat(500 + np.arange(5)[:, None], 4, axis=1))


@jax.jit
def _gather_rows(table, idx, n):
  """Copies table blocks idx[i] for i < n (scalar prefetch + traced grid size)."""
  def kernel(idx_ref, t_ref, o_ref):
    o_ref[...] = t_ref[...] + 1

  return pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((idx.shape[0] * 4, table.shape[1]), f32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(n,),
          in_specs=[pl.BlockSpec((4, table.shape[1]), lambda i, idx: (idx[i], 0))],
          out_specs=pl.BlockSpec((4, table.shape[1]), lambda i, idx: (i, 0))))(idx, table)


def test_traced_size_with_scalar_prefetch():
  table = random_array((40, 8))
  idx = jnp.array([3, 0, 7, 7, 2, 9], jnp.int32)
  n = 4
  out = _gather_rows(table, idx, jnp.int32(n))
  blocks = table.reshape(10, 4, 8)[idx[:n]].reshape(n * 4, 8)
  assert_close(out[:n * 4], blocks + 1)


def test_prefetch_operand_may_be_a_pytree():
  # megablox passes its group metadata (a tuple of arrays) as one prefetch operand
  def kernel(meta, o_ref):
    starts, scale = meta
    o_ref[...] = jnp.full(o_ref.shape, starts[pl.program_id(0)] * scale[0], f32)

  meta = (jnp.array([4, 5, 6], jnp.int32), jnp.array([10], jnp.int32))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((3, 2), f32),
                    grid_spec=pltpu.PrefetchScalarGridSpec(
                        num_scalar_prefetch=1, grid=(3,),
                        out_specs=pl.BlockSpec((1, 2), lambda i, meta: (meta[0][i] - 4, 0))))(
                            meta)
  assert_close(out, jnp.broadcast_to(jnp.array([[40.], [50.], [60.]]), (3, 2)))


def test_vmap_over_data_with_a_traced_size():
  xs = random_array((3, 64, 16))
  out = jax.jit(jax.vmap(_first_blocks_doubled, in_axes=(0, None)))(xs, jnp.int32(5))
  assert_close(out, jax.vmap(_doubled_reference, in_axes=(0, None))(xs, 5))


def test_vmap_over_the_size_itself():
  xs = random_array((3, 64, 16))
  ns = jnp.array([0, 2, 7], jnp.int32)
  out = jax.vmap(_first_blocks_doubled)(xs, ns)
  assert_close(out, jnp.stack([_doubled_reference(x, int(n)) for x, n in zip(xs, ns)]))


def test_jvp_through_a_traced_grid():
  x, t = random_array((32, 64)), random_array((32, 64))
  f = functools.partial(_row_sums_of_first_columns, n_cols=jnp.int32(3))
  primal, tangent = jax.jvp(f, (x,), (t,))
  ref = lambda x: jnp.sum(x[:, :48], axis=1, keepdims=True)
  assert_close(primal, ref(x))
  assert_close(tangent, ref(t))


def test_traced_grid_entry_must_be_an_integer_scalar():
  x = random_array((64, 16))
  with pytest.raises(PalletError, match="grid entries must be integers or traced integer"):
    jax.jit(lambda x, n: _first_blocks_doubled(x, n))(x, jnp.float32(2))


def _blocks_doubled_in_parallel(x, n, bounds):
  """Row block i of x doubled, plus 100 * i and the traced size n, for i < n: an axis
  of traced size declared parallel, with a bound on it for the Triton backend."""
  def kernel(x_ref, o_ref):
    o_ref[...] = (2 * x_ref[...] + pl.program_id(0).astype(f32) * 100
                  + pl.num_programs(0).astype(f32))
  spec = pl.BlockSpec((8, 16), lambda i, j: (i, j))
  return pallas_call(kernel, out_shape=sds(x), grid=(n, 2), in_specs=[spec], out_specs=spec,
                     input_output_aliases={0: 0},
                     compiler_params=plt.CompilerParams(
                         dimension_semantics=("parallel", "parallel"), grid_bounds=bounds))(x)


@pytest.mark.parametrize("bounds", [(3, None), None])
def test_parallel_axis_of_traced_size_below_at_and_past_its_bound(bounds):
  # The Triton backend launches 3 programs along axis 0 (or its default number): they
  # exit at once past the size, and take several blocks each where it is larger.
  x = random_array((64, 32))
  run = jax.jit(functools.partial(_blocks_doubled_in_parallel, bounds=bounds))
  for n in (0, 2, 3, 8):
    rows = jnp.arange(64)[:, None]
    expected = jnp.where(rows < 8 * n, 2 * x + (rows // 8) * 100.0 + n, x)
    assert_close(run(x, jnp.int32(n)), expected)


def test_grouped_matmul_over_a_traced_number_of_active_tiles():
  """megablox's gmm in small: 16-row tiles each in one group, out[t] = x[t] @ w[g[t]]
  for the first `active` tiles (traced), the tiles' groups as scalar prefetch; the
  tile axis is parallel and of traced size, the output columns a static parallel axis."""
  groups = jnp.array([1, 1, 0, 2, 2, 0], jnp.int32)
  x, w = random_array((96, 48)), random_array((3, 48, 64))

  def kernel(group_ref, x_ref, w_ref, o_in_ref, o_ref):
    del group_ref, o_in_ref      # o_in_ref: the poisoned buffer aliased to the output
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], precision=jax.lax.Precision.HIGHEST)

  @jax.jit
  def gmm(groups, x, w, active):
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(2, active),
        in_specs=[pl.BlockSpec((16, 48), lambda j, t, g: (t, 0)),
                  pl.BlockSpec((None, 48, 32), lambda j, t, g: (g[t], 0, j)),
                  pl.BlockSpec((16, 32), lambda j, t, g: (t, j))],
        out_specs=pl.BlockSpec((16, 32), lambda j, t, g: (t, j)))
    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((96, 64), f32), grid_spec=spec,
                       input_output_aliases={3: 0},
                       compiler_params=plt.CompilerParams(
                           dimension_semantics=("parallel", "parallel"),
                           grid_bounds=(None, 6)))(groups, x, w, poisoned((96, 64)))

  tiles = jnp.einsum("tik,tkn->tin", x.reshape(6, 16, 48), w[groups],
                     precision=jax.lax.Precision.HIGHEST).reshape(96, 64)
  for active in (0, 4, 6):
    out = gmm(groups, x, w, jnp.int32(active))
    assert_close(out[:16 * active], tiles[:16 * active], rtol=1e-4, atol=1e-4)
    assert np.isnan(np.asarray(out[16 * active:])).all()     # untouched: still poisoned


@pytest.mark.parametrize("bounds,message", [
    ((4, None, 2), r"grid_bounds must be a tuple with one entry per grid axis"),
    ((0, None), r"grid_bounds\[0\] must be None or a positive int, got 0"),
    ((4, 3), r"grid_bounds\[1\] is 3, but grid axis 1 has the static size 2")])
def test_bad_grid_bounds_are_clear_errors_on_the_triton_backend(bounds, message):
  x = random_array((64, 32))

  def bounded_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  def run(x, n):
    spec = pl.BlockSpec((8, 16), lambda i, j: (i, j))
    return pl.pallas_call(bounded_kernel, out_shape=sds(x), grid=(n, 2), in_specs=[spec],
                          out_specs=spec, backend="triton",
                          compiler_params=plt.CompilerParams(
                              dimension_semantics=("parallel", "parallel"),
                              grid_bounds=bounds))(x)

  with pytest.raises(TritonLoweringError, match=r"kernel 'bounded_kernel' \(.*"
                                                r"test_dynamic_grid\.py:\d+\): " + message):
    plt.source(run, x, jnp.int32(3))

"""`pltpu.emit_pipeline`: an inner grid of blocks over whole (`ANY`) refs inside a kernel,
on the backend under test (a loop of plain block copies, which the Triton backend runs too)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import pallet as pl
from pallet import tpu as pltpu
from helpers import assert_close, pallas_call, random_array, sds

ANY = pl.BlockSpec(memory_space=pltpu.ANY)


def _matmul_body(x_ref, y_ref, o_ref):
  @pl.when(pl.program_id(2) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)


@pytest.mark.parametrize("m, k, n", [(64, 48, 32), (40, 32, 40)])   # the second overhangs
def test_emit_pipeline_matmul(m, k, n):
  bm, bk, bn = 16, 16, 16
  x, y = random_array((m, k)), random_array((k, n))

  def kernel(x_hbm, y_hbm, o_hbm):
    pltpu.emit_pipeline(
        _matmul_body, grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)))(x_hbm, y_hbm, o_hbm)

  out = pallas_call(kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), in_specs=[ANY, ANY],
                    out_specs=ANY)(x, y)
  assert_close(out, x @ y, matmul=True)


def test_overhanging_blocks_of_different_sizes():
  """Edge blocks read unspecified values outside the array and write only inside it."""
  x = random_array((20, 40))

  def body(x_blk, o_blk):
    o_blk[...] = x_blk[...] + 1.0

  def kernel(x_hbm, o_hbm):
    spec = pl.BlockSpec((8, 16), lambda i, j: (i, j))
    pltpu.emit_pipeline(body, grid=(3, 3), in_specs=[spec], out_specs=[spec])(x_hbm, o_hbm)

  out = pallas_call(kernel, sds(x), in_specs=[ANY], out_specs=ANY)(x)
  assert_close(out, x + 1.0)


def test_bounded_slice_windows_move_only_their_slice():
  # pl.BoundedSlice(n): the index map's pl.ds(start, size) (size <= n, changing per
  # step) fills the first `size` rows of the window; only those are written back.
  # The windows run from the end backwards and overlap, and the body adds each row's
  # position in its window, so writing a whole window back would show.
  x = random_array((16, 8, 256))
  starts, sizes = [12, 8, 4, 0], [4, 5, 5, 5]

  def body(x_blk, o_blk):
    assert x_blk.shape == (6, 8, 128)
    o_blk[...] = x_blk[...] + lax.broadcasted_iota(jnp.float32, (6, 8, 128), 0)

  def kernel(x_hbm, o_hbm):
    spec = pl.BlockSpec((pl.BoundedSlice(6), 8, 128),
                        lambda i, j: (pl.ds((3 - i) * 4, 4 + (i > 0).astype(jnp.int32)), 0, j))
    pltpu.emit_pipeline(body, grid=(4, 2), in_specs=[spec], out_specs=[spec])(x_hbm, o_hbm)

  out = pallas_call(kernel, sds(x), in_specs=[ANY], out_specs=ANY)(x)
  expected = x
  for start, size in zip(starts, sizes):
    window = x[start:start + size] + jnp.arange(size, dtype=jnp.float32)[:, None, None]
    expected = expected.at[start:start + size].set(window)
  assert_close(out, expected)


def test_bounded_slice_window_from_scalar_prefetch_bounds():
  """Data-dependent slice bounds, read from SMEM, tile the rows unevenly."""
  bounds = jnp.array([[11, 16], [8, 11], [3, 8], [0, 3]], jnp.int32)
  x = random_array((16, 128))

  def body(x_blk, o_blk):
    o_blk[...] = x_blk[...] * 2.0

  def kernel(bounds_ref, x_hbm, o_hbm):
    def index_map(i):
      start = bounds_ref[i, 0]
      return pl.ds(start, bounds_ref[i, 1] - start), 0
    spec = pl.BlockSpec((pl.BoundedSlice(8), 128), index_map)
    pltpu.emit_pipeline(body, grid=(4,), in_specs=[spec], out_specs=spec)(x_hbm, o_hbm)

  out = pallas_call(kernel, sds(x), grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, in_specs=[ANY], out_specs=ANY))(bounds, x)
  assert_close(out, x * 2.0)


def test_bounded_slice_size_over_its_bound_is_an_error():
  """A pl.ds size over the pl.BoundedSlice bound: known while tracing, an error then;
  read from SMEM, a run-time failure (pallet would otherwise copy only n rows)."""
  x = random_array((16, 128))

  def body(x_blk, o_blk):
    o_blk[...] = x_blk[...] * 2.0

  def kernel(bounds_ref, x_hbm, o_hbm, static_size=None):
    def index_map(i):
      start = bounds_ref[i, 0]
      size = bounds_ref[i, 1] - start if static_size is None else static_size
      return pl.ds(start, size), 0
    spec = pl.BlockSpec((pl.BoundedSlice(4), 128), index_map)
    pltpu.emit_pipeline(body, grid=(4,), in_specs=[spec], out_specs=spec)(x_hbm, o_hbm)

  def call(bounds, kernel=kernel):
    return pl.pallas_call(kernel, sds(x), grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, in_specs=[ANY], out_specs=ANY))(bounds, x)

  assert_close(call(jnp.array([[12, 16], [8, 12], [4, 8], [0, 4]], jnp.int32)), x * 2.0)
  with pytest.raises(Exception, match=r"pl.BoundedSlice size check failed in kernel "
                     r"'kernel'.*input 0: index_map result 0 is pl.ds\(..., size\) but its "
                     r"pl.BoundedSlice\(4\) block holds at most 4 elements"):
    jax.block_until_ready(call(jnp.array([[11, 16], [8, 11], [3, 8], [0, 3]], jnp.int32)))
  with pytest.raises(ValueError, match=r"emit_pipeline in kernel 'kernel' at .*, input 0: "
                     r"index_map result 0 is pl.ds\(..., size\) but its pl.BoundedSlice\(4\) "
                     r"block holds at most 4 elements; got size 6"):
    call(jnp.zeros((4, 2), jnp.int32), functools.partial(kernel, static_size=6))


def test_bounded_slice_index_map_must_return_a_ds():
  x = random_array((16, 128))

  def kernel(x_hbm, o_hbm):
    spec = pl.BlockSpec((pl.BoundedSlice(8), 128), lambda i: (0, 0))
    pltpu.emit_pipeline(lambda a, b: None, grid=(1,), in_specs=[spec],
                        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)))(x_hbm, o_hbm)
  with pytest.raises(ValueError, match=r"emit_pipeline in kernel 'kernel' at .*, input 0: "
                     r"index_map result 0 is 0. Must return a pl.ds from the index_map for "
                     r"a BoundedSlice dimension"):
    pl.pallas_call(kernel, sds(x), in_specs=[ANY], out_specs=ANY)(x)


@pytest.mark.parametrize("grid", [(0, 2), (2, -1)])
def test_pipeline_grid_sizes_must_be_positive(grid):
  # Pallas's wording (JAX's tests match it), with the kernel and the user's line.
  def kernel(o_hbm):
    pltpu.emit_pipeline(lambda o: None, grid=grid,
                        out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)))(o_hbm)
  with pytest.raises(ValueError, match=r"emit_pipeline in kernel 'kernel' at .*test_pipeline"
                     r"\.py:\d+: All elements in the grid must be strictly positive, got "
                     r"grid=\(" + ", ".join(map(str, grid))):
    pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 256), jnp.float32), out_specs=ANY)()


def test_emit_pipeline_with_allocations_reused():
  m = k = n = 32
  x, y = random_array((m, k)), random_array((k, n))

  def kernel(x_hbm, y_hbm, o_hbm, o2_hbm):
    pipeline, make_allocations = pltpu.emit_pipeline_with_allocations(
        _matmul_body, grid=(2, 2, 2),
        in_specs=[pl.BlockSpec((16, 16), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((16, 16), lambda i, j, kk: (kk, j))],
        out_specs=[pl.BlockSpec((16, 16), lambda i, j, kk: (i, j))])

    def run(allocations):
      pipeline(x_hbm, y_hbm, o_hbm, allocations=allocations)
      pipeline(y_hbm, x_hbm, o2_hbm, allocations=allocations)
    pl.run_scoped(run, make_allocations(x_hbm, y_hbm, o_hbm))

  out = pallas_call(kernel, (sds(x), sds(x)), in_specs=[ANY, ANY], out_specs=(ANY, ANY))(x, y)
  assert_close(out, (x @ y, y @ x), matmul=True)


def test_inner_pipeline_per_outer_step_sees_its_own_program_ids():
  rows, cols, block = 3, 40, 8
  x = random_array((rows, cols))

  def kernel(x_hbm, o_hbm):
    row = pl.program_id(0)

    def body(x_blk, o_blk):
      o_blk[...] = x_blk[...] * 2.0 + pl.program_id(0).astype(jnp.float32)

    pltpu.emit_pipeline(
        body, grid=(cols // block,),
        in_specs=[pl.BlockSpec((None, block), lambda j: (row, j))],
        out_specs=[pl.BlockSpec((None, block), lambda j: (row, j))])(x_hbm, o_hbm)

  out = pallas_call(kernel, sds(x), grid=(rows,), in_specs=[ANY], out_specs=ANY)(x)
  steps = jnp.repeat(jnp.arange(cols // block, dtype=x.dtype), block)
  assert_close(out, x * 2.0 + steps)


def _reversed_pipeline(x_hbm, o_hbm, rows_at):
  """A pipeline over 3 column blocks whose input index map counts down from
  pl.num_programs(0) - 1 and whose output one is pl.program_id(0); the body adds its
  own step, pl.program_id(0)."""
  def body(x_blk, o_blk):
    o_blk[...] = x_blk[...] * 2.0 + pl.program_id(0).astype(jnp.float32)

  pltpu.emit_pipeline(
      body, grid=(3,),
      in_specs=[pl.BlockSpec((8, 16), lambda j: (rows_at, pl.num_programs(0) - 1 - j))],
      out_specs=[pl.BlockSpec((8, 16), lambda j: (rows_at, pl.program_id(0)))])(x_hbm, o_hbm)


def _reversed_expected(x):
  blocks = x.reshape(x.shape[0], 3, 16)
  return (blocks[:, ::-1] * 2.0 + jnp.arange(3.0)[:, None]).reshape(x.shape)


@pytest.mark.parametrize("outer", [None, 1, 2, 3])
def test_index_maps_of_a_pipeline_see_its_own_grid(outer):
  # Issue 28: pl.num_programs / pl.program_id in a pipeline's index map answered for
  # the enclosing pallas_call's grid (or failed with "the grid () has 0 axes").
  x = random_array(((outer or 1) * 8, 48))

  def kernel(x_hbm, o_hbm):
    _reversed_pipeline(x_hbm, o_hbm, pl.program_id(0) if outer else 0)

  out = pallas_call(kernel, sds(x), grid=(outer,) if outer else (), in_specs=[ANY],
                    out_specs=ANY)(x)
  assert_close(out, _reversed_expected(x))


@pytest.mark.parametrize("outer", [1, 2, 3])
def test_index_maps_of_a_pipeline_over_at_windows_see_its_own_grid(outer):
  x = random_array((outer * 8, 48))

  def kernel(x_hbm, o_hbm):
    rows = pl.ds(pl.program_id(0) * 8, 8)
    _reversed_pipeline(x_hbm.at[rows], o_hbm.at[rows], 0)

  out = pallas_call(kernel, sds(x), grid=(outer,), in_specs=[ANY], out_specs=ANY)(x)
  assert_close(out, _reversed_expected(x))


@pytest.mark.parametrize("outer", [1, 2])
def test_revisited_reduction_in_a_pipeline_counts_its_own_steps(outer):
  # An order-sensitive fold over the pipeline's last axis, visiting the input blocks
  # backwards; the output block stays put along that axis and is zeroed at its start.
  x = random_array((outer * 16, 48))

  def body(x_blk, o_blk):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_blk[...] = jnp.zeros_like(o_blk)
    o_blk[...] = o_blk[...] * 0.5 + x_blk[...]

  def kernel(x_hbm, o_hbm):
    r = pl.program_id(0)
    pltpu.emit_pipeline(
        body, grid=(2, 3),
        in_specs=[pl.BlockSpec((8, 16),
                               lambda i, k: (2 * r + i, pl.num_programs(1) - 1 - k))],
        out_specs=[pl.BlockSpec((8, 16), lambda i, k: (2 * r + i, 0))])(x_hbm, o_hbm)

  out = pallas_call(kernel, jax.ShapeDtypeStruct((outer * 16, 16), jnp.float32),
                    grid=(outer,), in_specs=[ANY], out_specs=ANY)(x)
  b = x.reshape(outer * 16, 3, 16)
  assert_close(out, (b[:, 2] * 0.5 + b[:, 1]) * 0.5 + b[:, 0])


def test_body_prologue_runs_before_every_step():
  x = random_array((4, 8))

  def kernel(x_hbm, o_hbm, count):
    count[0] = 0

    def prologue():
      count[0] += pl.program_id(0) + 1

    def body(x_blk, o_blk):
      o_blk[...] = x_blk[...] * count[0].astype(jnp.float32)

    spec = pl.BlockSpec((None, 8), lambda i: (i, 0))
    pltpu.emit_pipeline(body, grid=(4,), in_specs=[spec], out_specs=[spec])(
        x_hbm, o_hbm, body_prologue=prologue)

  out = pallas_call(kernel, sds(x), in_specs=[ANY], out_specs=ANY,
                    scratch_shapes=[pltpu.SMEM((1,), jnp.int32)])(x)
  assert_close(out, x * jnp.array([1.0, 3.0, 6.0, 10.0])[:, None])


def test_explicit_indices_give_the_body_a_pipeline_step():
  x = random_array((4, 16))

  def body(step, x_blk, o_blk):
    i, j = step.index
    o_blk[...] = x_blk[...] + (10 * i + j + 100 * step.local_index).astype(jnp.float32)

  def kernel(x_hbm, o_hbm):
    spec = pl.BlockSpec((None, 8), lambda i, j: (i, j))
    pltpu.emit_pipeline(body, grid=(4, 2), in_specs=[spec], out_specs=[spec],
                        _explicit_indices=True)(x_hbm, o_hbm)

  out = pallas_call(kernel, sds(x), in_specs=[ANY], out_specs=ANY)(x)
  i, j = jnp.meshgrid(jnp.arange(4), jnp.repeat(jnp.arange(2), 8), indexing="ij")
  assert_close(out, x + (10 * i + j + 100 * (2 * i + j)).astype(x.dtype))


def test_scheduler_internals_are_clear_errors():
  with pytest.raises(pl.PalletError, match="pltpu.BufferType is not supported"):
    pltpu.BufferType.INPUT


def test_pipeline_input_blocks_are_copies():
  """Writing an input block changes the buffer, not the array (as in VMEM on a TPU)."""
  x = random_array((16, 8))

  def body(x_blk, o_blk):
    x_blk[...] = x_blk[...] + 100.0
    o_blk[...] = x_blk[...]

  def kernel(x_hbm, o_hbm, o2_hbm):
    pltpu.emit_pipeline(body, grid=(2,), in_specs=[pl.BlockSpec((8, 8), lambda i: (i, 0))],
                        out_specs=[pl.BlockSpec((8, 8), lambda i: (i, 0))])(x_hbm, o_hbm)
    o2_hbm[...] = x_hbm[...]

  out, unchanged = pallas_call(kernel, (sds(x), sds(x)), in_specs=[ANY],
                               out_specs=(ANY, ANY))(x)
  assert_close(out, x + 100.0)
  assert_close(unchanged, x)


def test_pipeline_spec_count_mismatch_is_a_clear_error():
  def kernel(x_hbm, o_hbm):
    spec = pl.BlockSpec((8, 8), lambda i: (i, 0))
    pltpu.emit_pipeline(lambda a, b: None, grid=(2,), in_specs=[spec],
                        out_specs=[spec])(x_hbm, o_hbm, o_hbm)

  with pytest.raises(pl.PalletError,
                     match=r"emit_pipeline in kernel 'kernel'.*1 output specs for 2 output"):
    pallas_call(kernel, jax.ShapeDtypeStruct((16, 8), jnp.float32), in_specs=[ANY],
                out_specs=ANY)(random_array((16, 8)))


def _nested_kernel(outer_space):
  """An outer pipeline over 2x2 blocks whose body runs an inner pipeline over each."""
  def inner(x_blk, o_blk):
    o_blk[...] = x_blk[...] * 2.0 + 1.0

  def outer_body(x_ref, o_ref):
    spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
    pltpu.emit_pipeline(inner, grid=(2,), in_specs=[spec], out_specs=[spec])(x_ref, o_ref)

  def kernel(x_hbm, o_hbm):
    spec = pl.BlockSpec((8, 8), lambda i, j: (i, j), memory_space=outer_space)
    pltpu.emit_pipeline(outer_body, grid=(2, 2), in_specs=[spec], out_specs=[spec])(
        x_hbm, o_hbm)
  return kernel


def test_nested_pipeline_over_copied_outer_blocks():
  x = random_array((16, 16))
  out = pallas_call(_nested_kernel(None), sds(x), in_specs=[ANY], out_specs=ANY)(x)
  assert_close(out, x * 2.0 + 1.0)


def test_any_block_specs_in_a_pipeline_are_refused():
  # Issue 28: an ANY spec with a block shape ran the body on the whole ref, so a nested
  # pipeline wrote only the first outer block. Pallas refuses such specs; so does pallet.
  x = random_array((16, 16))
  with pytest.raises(pl.PalletError,
                     match=r"emit_pipeline in kernel 'kernel' at .*test_pipeline.py:\d+, "
                           r"input 0: BlockSpec\(block_shape=\(8, 8\), memory_space=ANY\) "
                           r"is not a pipeline block.*Leave memory_space out"):
    pallas_call(_nested_kernel(pltpu.ANY), sds(x), in_specs=[ANY], out_specs=ANY)(x)


def test_any_block_spec_of_a_pipeline_output_is_refused():
  def kernel(x_hbm, o_hbm):
    pltpu.emit_pipeline(
        lambda x_blk, o_blk: o_blk.__setitem__(..., x_blk[...]), grid=(2,),
        in_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0), memory_space=pl.ANY)])(
            x_hbm, o_hbm)

  x = random_array((16, 16))
  with pytest.raises(pl.PalletError, match=r"kernel 'kernel' at .*, output 0: BlockSpec"):
    pallas_call(kernel, sds(x), in_specs=[ANY], out_specs=ANY)(x)


@pytest.mark.parametrize("num_cores", [1, 2])
def test_pipeline_body_sees_the_kernels_mesh_axes(num_cores):
  # Inside emit_pipeline, program_id answers for the inner grid, while
  # lax.axis_index/axis_size of the enclosing pl.kernel's mesh axis still answer
  # for the core (JAX's megacore tests query both from the pipeline body).
  x = random_array((16, 128 * 2 * num_cores))
  mesh = pltpu.create_tensorcore_mesh("core", num_cores=num_cores)

  @pl.kernel(out_type=sds(x), mesh=mesh)
  def run(x_hbm, o_hbm):
    core = lax.axis_index("core")

    def body(x_ref, o_ref):
      o_ref[...] = (x_ref[...] + 10.0 * lax.axis_index("core") + 100.0 * pl.program_id(0)
                    + 1000.0 * lax.axis_size("core"))
    pltpu.emit_pipeline(
        body, grid=(2,),
        in_specs=[pl.BlockSpec((16, 128), lambda i: (0, 2 * core + i))],
        out_specs=[pl.BlockSpec((16, 128), lambda i: (0, 2 * core + i))])(x_hbm, o_hbm)

  blocks = jnp.arange(2 * num_cores) // 2 * 10.0 + jnp.arange(2 * num_cores) % 2 * 100.0
  expected = x + jnp.repeat(blocks, 128)[None, :] + 1000.0 * num_cores
  assert_close(run(x), expected)


def test_key_memory_space_passes_a_prng_key_whole():
  # pl.MemorySpace.KEY (JAX 0.12): a typed PRNG key held whole, in a pipeline and in
  # pallas_call alike; the kernel's draws equal jax.random's on the same key outside.
  key = pltpu.to_pallas_key(jax.random.key(int(random_array((), jnp.int32, low=1,
                                                            high=10**6))))
  out_shape = jax.ShapeDtypeStruct((8, 128), jnp.float32)

  def draw(key_ref, o_ref):
    o_ref[...] = jax.random.uniform(key_ref[...], shape=o_ref.shape)

  def kernel(key_hbm, o_hbm):
    pltpu.emit_pipeline(draw, grid=(), in_specs=[pl.BlockSpec(memory_space=pl.MemorySpace.KEY)],
                        out_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)])(key_hbm, o_hbm)
  expected = jax.random.uniform(key, (8, 128))
  out = pl.pallas_call(kernel, out_shape, in_specs=[pl.BlockSpec(memory_space=pltpu.HBM)],
                       out_specs=pl.BlockSpec(memory_space=pltpu.HBM))(key)
  assert_close(out, expected, rtol=0, atol=0)
  direct = pl.pallas_call(draw, out_shape,
                          in_specs=[pl.BlockSpec(memory_space=pl.MemorySpace.KEY)])(key)
  assert_close(direct, expected, rtol=0, atol=0)

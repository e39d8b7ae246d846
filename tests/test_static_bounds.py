"""Indices known while tracing that fall outside their ref are errors when the kernel is
traced (naming the kernel, the ref, the index, the shape and the user's line), never a
clamped read (a warning, where the access is in a branch that data decides); errors inside emit_pipeline bodies, DMAs and pl.kernel name the kernel and
line like every other kernel error. What JAX allows still runs: Python slices clip as in
NumPy, negative indices count from the end, blocks may overhang the array edge."""
from __future__ import annotations

import inspect
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
from pallet import tpu as pltpu
from helpers import assert_close, current_test_backend, pallas_call, random_array, sds

f32 = jnp.float32
X = random_array((128,))
ANY = pl.BlockSpec(memory_space=pl.ANY)
xla_only = pytest.mark.skipif(current_test_backend() != "xla",
                              reason="DMAs and emit_pipeline run on the XLA backend")


def _line(fn, marker: str) -> str:
  lines, start = inspect.getsourcelines(fn)
  [offset] = [i for i, text in enumerate(lines) if marker in text]
  return f"{os.path.basename(__file__)}:{start + offset}"


def _raises(*fragments):
  return pytest.raises(pl.PalletError, match=".*".join(re.escape(f) for f in fragments))


def test_static_index_past_the_end_of_a_load():
  def reads_past(x_ref, o_ref):
    o_ref[...] = jnp.full((8,), x_ref[200])

  with _raises("kernel 'reads_past'", _line(reads_past, "x_ref[200]"), "index 200",
               "dimension 0", "input 0 ('x_ref')", "(128,)", "[-128, 128)"):
    pallas_call(reads_past, out_shape=jax.ShapeDtypeStruct((8,), f32))(X)


def test_static_index_past_the_end_of_a_store_and_of_a_view():
  def writes_past(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[1, 17] = 1.0

  x2 = random_array((4, 16))
  with _raises("kernel 'writes_past'", _line(writes_past, "o_ref[1, 17]"), "index 17",
               "dimension 1", "output 0 ('o_ref')", "(4, 16)"):
    pallas_call(writes_past, out_shape=sds(x2))(x2)

  def view_past(x_ref, o_ref):
    o_ref[...] = x_ref[...] + x_ref.at[3][20]

  with _raises("kernel 'view_past'", _line(view_past, "at[3][20]"), "index 20",
               "a view (shape (16,)) of input 0 ('x_ref')"):
    pallas_call(view_past, out_shape=sds(x2))(x2)


def test_negative_index_past_the_start_and_negative_slice_start():
  def before_start(x_ref, o_ref):
    o_ref[...] = jnp.full((8,), x_ref[-129])

  with _raises("kernel 'before_start'", "index -129", "(128,)"):
    pallas_call(before_start, out_shape=jax.ShapeDtypeStruct((8,), f32))(X)

  def negative_start(x_ref, o_ref):   # JAX's discharge fails on it deep inside lax.slice
    o_ref[...] = x_ref[pl.ds(-8, 8)]

  with _raises("kernel 'negative_start'", _line(negative_start, "pl.ds(-8, 8)"),
               "pl.ds(-8, 8)", "input 0 ('x_ref')", "(128,)"):
    pallas_call(negative_start, out_shape=jax.ShapeDtypeStruct((8,), f32))(X)


def test_static_pl_ds_past_the_end_names_ref_and_shape():
  def ds_past(x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(100, 64)][:8]

  with _raises("kernel 'ds_past'", _line(ds_past, "pl.ds(100, 64)"), "input 0 ('x_ref')",
               "start=100, size=64", "size 128", "shape (128,)"):
    pallas_call(ds_past, out_shape=jax.ShapeDtypeStruct((8,), f32))(X)

  def ds_from_zero(x_ref, o_ref):   # JAX 0.10 does not check a slice starting at 0
    o_ref[...] = x_ref[pl.ds(0, 200)][:8]

  with _raises("kernel 'ds_from_zero'", _line(ds_from_zero, "pl.ds(0, 200)"), "x_ref"):
    pallas_call(ds_from_zero, out_shape=jax.ShapeDtypeStruct((8,), f32))(X)


def test_what_jax_allows_still_runs():
  """Python slices clip at the end (as NumPy and JAX do), negative indices count from
  the end, and edge blocks overhang the array while indexing inside the block."""
  def kernel(x_ref, o_ref):
    o_ref[pl.ds(0, 28)] = x_ref[100:200]       # 28 elements, as x[100:200]
    o_ref[pl.ds(28, 4)] = jnp.full((4,), x_ref[-1])

  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32,), f32))(X)
  assert_close(out, jnp.concatenate([X[100:200], jnp.full((4,), X[-1])]))

  def edge_blocks(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
    o_ref[31] = x_ref[31] + 1.0               # the last row of a block, in its ref

  x = random_array((100,))
  spec = pl.BlockSpec((32,), lambda i: (i,))
  out = pallas_call(edge_blocks, out_shape=sds(x), grid=(4,), in_specs=[spec],
                    out_specs=spec)(x)
  expected = (x * 2.0).at[31::32].set(x[31::32] + 1.0)
  assert_close(out, expected)


def test_index_inside_control_flow():
  def in_loop(x_ref, o_ref):
    def body(i, acc):
      return acc + x_ref[130]
    o_ref[...] = jnp.full((8,), jax.lax.fori_loop(0, 3, body, 0.0))

  with _raises("kernel 'in_loop'", _line(in_loop, "x_ref[130]"), "index 130",
               "input 0 ('x_ref')"):
    pallas_call(in_loop, out_shape=jax.ShapeDtypeStruct((8,), f32))(X)

  def in_when(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(pl.program_id(0) == 1)
    def _():
      o_ref[9] = x_ref[0]

  with _raises("kernel 'in_when'", _line(in_when, "o_ref[9]"), "index 9",
               "output 0 ('o_ref')", "(8,)"):
    pallas_call(in_when, out_shape=jax.ShapeDtypeStruct((16,), f32), grid=(2,),
                out_specs=pl.BlockSpec((8,), lambda i: (i,)))(X)


def _unrolled_gather(idx_ref_size=4):
  """TPU kernels unroll a loop to a fixed bound and guard each step with data: here
  8 steps over a ref of 4 slot numbers, `count` (<= 4 when called correctly) of which
  are used. Steps 4..7 index past `idx_ref` inside branches that must never run."""
  def unrolled(n_ref, idx_ref, x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    for i in range(8):
      @pl.when(i < n_ref[0])
      def _():
        o_ref[pl.ds(i, 1), :] = x_ref[pl.ds(idx_ref[i], 1), :]   # the guarded read
  smem, vmem = pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)
  return unrolled, dict(in_specs=[smem, smem, vmem], out_specs=vmem)


def test_index_in_a_branch_decided_by_data_warns_and_runs():
  kernel, specs = _unrolled_gather()
  x, idx = random_array((8, 128)), jnp.array([3, 1, 2, 0], jnp.int32)
  with pytest.warns(pl.IndexBoundsWarning) as caught:
    call = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), f32), **specs)
    out = call(jnp.array([3], jnp.int32), idx, x)
  message = str(caught[0].message)
  for fragment in ("kernel 'unrolled'", _line(kernel, "the guarded read"), "input 1 ('idx_ref')",
                   "(4,)", "branch decided at run time", "PALLET_CHECKS=1"):
    assert fragment in message, message
  expected = np.zeros((8, 128), np.float32)
  expected[:3] = np.asarray(x)[[3, 1, 2]]
  assert_close(out, expected)


@xla_only
def test_checking_mode_reports_the_guarded_index_when_its_branch_runs():
  kernel, specs = _unrolled_gather()
  x, idx = random_array((8, 128)), jnp.array([3, 1, 2, 0], jnp.int32)
  call = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), f32),
                     interpret=pltpu.InterpretParams(), **specs)
  with pytest.warns(pl.IndexBoundsWarning):
    assert_close(call(jnp.array([4], jnp.int32), idx, x)[:4], x[idx])   # branches 0..3: fine
    with pytest.raises(pl.KernelCheckError, match=r"out_of_bounds.*kernel 'unrolled'.*idx_ref"):
      jax.block_until_ready(call(jnp.array([5], jnp.int32), idx, x))     # step 4 runs


def test_index_in_a_branch_no_grid_step_takes_is_dead_code():
  def never(x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(0, 8)]

    @pl.when(pl.program_id(0) == 7)   # the grid has 2 steps
    def _():
      o_ref[9] = x_ref[200]

  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = pallas_call(never, out_shape=jax.ShapeDtypeStruct((16,), f32), grid=(2,),
                      in_specs=[pl.BlockSpec((128,), lambda i: (0,))],
                      out_specs=pl.BlockSpec((8,), lambda i: (i,)))(X)
  assert_close(out, jnp.concatenate([X[:8], X[:8]]))


def test_jax_tpu_interpreter_also_fails_the_read():
  """The oracle: JAX's TPU interpreter refuses the same read (at run time)."""
  from jax.experimental import pallas as jpl
  from jax.experimental.pallas import tpu as jpltpu

  def reads_past(x_ref, o_ref):
    o_ref[...] = jnp.full((8,), x_ref[200])

  with pytest.raises(Exception, match="Out-of-bounds read"):
    jax.block_until_ready(jpl.pallas_call(reads_past, out_shape=jax.ShapeDtypeStruct((8,), f32),
                                          interpret=jpltpu.InterpretParams())(X))


@xla_only
def test_dma_and_semaphore_indices():
  x = random_array((16, 16))

  def dma_past(x_hbm, o_hbm, sem):
    pltpu.async_copy(x_hbm.at[20], o_hbm.at[0], sem).wait()

  with _raises("kernel 'dma_past'", _line(dma_past, "at[20]"), "index 20",
               "input 0 ('x_hbm')", "(16, 16)"):
    pallas_call(dma_past, out_shape=sds(x), in_specs=[ANY], out_specs=ANY,
                scratch_shapes=[pltpu.SemaphoreType.DMA])(x)

  def sem_past(x_hbm, o_hbm, sems):
    pltpu.async_copy(x_hbm, o_hbm, sems.at[3]).wait()

  with _raises("kernel 'sem_past'", _line(sem_past, "sems.at[3]"), "index 3",
               "scratch 0 ('sems')", "(2,)"):
    pallas_call(sem_past, out_shape=sds(x), in_specs=[ANY], out_specs=ANY,
                scratch_shapes=[pltpu.SemaphoreType.DMA((2,))])(x)

  def dma_slice_past(x_hbm, o_hbm, sem):
    pltpu.async_copy(x_hbm.at[pl.ds(10, 8)], o_hbm.at[pl.ds(0, 8)], sem).wait()

  with _raises("kernel 'dma_slice_past'", _line(dma_slice_past, "pl.ds(10, 8)"),
               "input 0 ('x_hbm')", "start=10, size=8", "shape (16, 16)"):
    pallas_call(dma_slice_past, out_shape=sds(x), in_specs=[ANY], out_specs=ANY,
                scratch_shapes=[pltpu.SemaphoreType.DMA])(x)


def _pipelined(body):
  def kernel(x_hbm, o_hbm):
    pltpu.emit_pipeline(body, grid=(2,), in_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0))],
                        out_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0))])(x_hbm, o_hbm)
  kernel.__name__ = f"pipeline_of_{body.__name__}"
  x = random_array((16, 16))
  return pallas_call(kernel, out_shape=sds(x), in_specs=[ANY], out_specs=ANY), x


@xla_only
def test_errors_in_emit_pipeline_bodies_name_kernel_line_and_block():
  def index_past(x_ref, o_ref):
    o_ref[...] = x_ref[...] + x_ref[9, 0]

  call, x = _pipelined(index_past)
  with _raises("kernel 'pipeline_of_index_past'", _line(index_past, "x_ref[9, 0]"),
               "x_ref[9, 0]", "index 9", "a block buffer of pltpu.emit_pipeline", "(8, 16)"):
    call(x)

  def slice_past(x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(4, 8)]

  call, x = _pipelined(slice_past)
  with _raises("kernel 'pipeline_of_slice_past'", _line(slice_past, "pl.ds(4, 8)"),
               "ref 'x_ref'", "start=4, size=8", "shape (8, 16)"):
    call(x)

  def wrong_dtype(x_ref, o_ref):
    o_ref[...] = x_ref[...].astype(jnp.int32)

  call, x = _pipelined(wrong_dtype)
  with _raises("kernel 'pipeline_of_wrong_dtype'", _line(wrong_dtype, "astype"),
               "dtype int32 into ref 'o_ref'"):
    call(x)


@xla_only
def test_errors_in_pl_kernel_bodies_name_kernel_and_line():
  mesh = pltpu.create_tensorcore_mesh("core")
  x = random_array((16, 16))

  def mesh_body(x_hbm, o_hbm):
    o_hbm[...] = x_hbm[...] + x_hbm[0, 40]

  with _raises("kernel 'mesh_body'", _line(mesh_body, "x_hbm[0, 40]"), "index 40",
               "input 0 ('x_hbm')", "(16, 16)"):
    pl.kernel(mesh_body, out_type=sds(x), mesh=mesh)(x)


def test_in_bounds_static_indices_match_jax_numpy():
  """The checks leave every in-bounds static index alone (first, last, negative)."""
  x = random_array((6, 8))

  def kernel(x_ref, o_ref):
    o_ref[0] = x_ref[5]
    o_ref[1] = x_ref[-6]
    o_ref[2, 7] = x_ref[0, -1]
    o_ref[2, pl.ds(0, 7)] = x_ref.at[2][pl.ds(1, 7)]
    o_ref[pl.ds(3, 3)] = x_ref[pl.ds(0, 3)] * 2.0

  out = pallas_call(kernel, out_shape=sds(x))(x)
  expected = np.asarray(x).copy()
  expected[0], expected[1] = x[5], x[0]
  expected[2, 7], expected[2, :7] = x[0, -1], x[2, 1:]
  expected[3:] = x[:3] * 2.0
  assert_close(out, expected)

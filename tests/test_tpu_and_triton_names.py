"""pallet.tpu (memory spaces, scratch, dimension_semantics, scalar prefetch) and
pallet.triton (compiler params) run on every backend."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
import pallet.tpu as pltpu
import pallet.triton as pltriton
from helpers import assert_close, pallas_call, random_array, sds

f32 = jnp.float32
i32 = jnp.int32


def test_prefetch_scalars_select_blocks_and_reach_the_kernel():
  # Data-dependent block selection: block_ids picks which row block each step reads;
  # the kernel also reads the scalars (here: a per-step scale).
  def kernel(block_ids_ref, scales_ref, x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = x_ref[...] * scales_ref[i] + block_ids_ref[i].astype(f32)

  x = random_array((16, 8))
  block_ids = jnp.array([3, 0, 0, 2, 1], i32)
  scales = jnp.array([1.0, -2.0, 0.5, 3.0, 10.0], f32)
  gs = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(5,),
      in_specs=[pl.BlockSpec((4, 8), lambda i, ids, sc: (ids[i], 0))],
      out_specs=pl.BlockSpec((4, 8), lambda i, ids, sc: (i, 0)))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((20, 8), f32),
                    grid_spec=gs)(block_ids, scales, x)
  blocks = x.reshape(4, 4, 8)[block_ids]
  expected = blocks * scales[:, None, None] + block_ids[:, None, None].astype(f32)
  assert_close(out, expected.reshape(20, 8))


def test_prefetch_selects_output_blocks_too():
  # Scatter rows: output block chosen by data; unselected rows keep the aliased input.
  # Alias indices count every operand of the call, the prefetch ones included.
  def kernel(dest_ref, x_ref, base_ref, o_ref):
    o_ref[...] = x_ref[...]

  x, base = random_array((3, 4)), random_array((6, 4))
  dest = jnp.array([4, 1, 5], i32)
  gs = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(3,),
      in_specs=[pl.BlockSpec((None, 4), lambda i, d: (i, 0)),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((None, 4), lambda i, d: (d[i], 0)))
  out = pallas_call(kernel, out_shape=sds(base), grid_spec=gs,
                    input_output_aliases={2: 0})(dest, x, base)
  assert_close(out, base.at[dest].set(x))


def test_prefetch_under_jit_with_new_data_each_call():
  def kernel(ids_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  @jax.jit
  def f(ids, x):
    gs = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(ids.shape[0],),
        in_specs=[pl.BlockSpec((None, 5), lambda i, ids: (ids[i], 0))],
        out_specs=pl.BlockSpec((None, 5), lambda i, ids: (i, 0)))
    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((ids.shape[0], 5), f32),
                       grid_spec=gs)(ids, x)

  x = random_array((6, 5))
  for ids in ([5, 0, 2], [1, 1, 4]):
    ids = jnp.array(ids, i32)
    assert_close(f(ids, x), x[ids] * 2)


def test_prefetch_with_scratch_and_reduction():
  # Sum selected rows into an SMEM-style accumulator (a segment sum).
  def kernel(ids_ref, x_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      acc_ref[...] = jnp.zeros(acc_ref.shape, f32)
    acc_ref[...] += x_ref[...]
    o_ref[...] = acc_ref[...]

  x = random_array((7, 3))
  ids = jnp.array([6, 2, 2, 0], i32)
  gs = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(4,),
      in_specs=[pl.BlockSpec((None, 3), lambda k, ids: (ids[k], 0))],
      out_specs=pl.BlockSpec((3,), lambda k, ids: (0,)),
      scratch_shapes=[pltpu.VMEM((3,), f32)])
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((3,), f32), grid_spec=gs)(ids, x)
  assert_close(out, x[ids].sum(0), rtol=1e-5, atol=1e-5)


def test_smem_inputs_and_vmem_scratch():
  def kernel(coef_ref, x_ref, o_ref, tmp_ref):
    tmp_ref[...] = x_ref[...] * coef_ref[0]
    o_ref[...] = tmp_ref[...] + coef_ref[1]

  coef = jnp.array([2.5, -1.0], f32)
  x = random_array((8, 16))
  out = pallas_call(kernel, out_shape=sds(x), grid=(2,),
                    in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                              pl.BlockSpec((4, 16), lambda i: (i, 0))],
                    out_specs=pl.BlockSpec((4, 16), lambda i: (i, 0)),
                    scratch_shapes=[pltpu.VMEM((4, 16), f32)])(coef, x)
  assert_close(out, x * 2.5 - 1.0)


def test_any_memory_space_operand_is_whole_array():
  def kernel(x_ref, table_ref, o_ref):
    assert table_ref.shape == (5, 3)
    o_ref[...] = x_ref[...] + table_ref[pl.program_id(0), :]

  x, table = random_array((4, 3)), random_array((5, 3))
  spec = pl.BlockSpec((None, 3), lambda i: (i, 0))
  out = pallas_call(kernel, out_shape=sds(x), grid=(4,),
                    in_specs=[spec, pl.BlockSpec(memory_space=pltpu.ANY)],
                    out_specs=spec)(x, table)
  assert_close(out, x + table[:4])


def test_memory_space_scratch_descriptions():
  s = pltpu.VMEM((8, 128), f32)
  assert s.shape == (8, 128) and s.dtype == f32 and s.memory_space is pltpu.VMEM
  assert pltpu.SMEM((2,), i32).memory_space is pltpu.SMEM
  assert pltpu.TPUMemorySpace.SMEM is pltpu.SMEM


@pytest.mark.parametrize("semantics", [("parallel", "arbitrary"), ("arbitrary", "arbitrary"),
                                       ("PARALLEL", "ARBITRARY"), ("parallel", "sequential")])
def test_dimension_semantics_variants_give_the_same_result(semantics):
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, f32)
    o_ref[...] += x_ref[...]

  x = random_array((8, 12))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 4), f32), grid=(2, 3),
                    in_specs=[pl.BlockSpec((4, 4), lambda i, k: (i, k))],
                    out_specs=pl.BlockSpec((4, 4), lambda i, k: (i, 0)),
                    compiler_params=pltpu.CompilerParams(dimension_semantics=semantics))(x)
  assert_close(out, x.reshape(8, 3, 4).sum(1), rtol=1e-5, atol=1e-5)


def test_triton_compiler_params():
  params = pltriton.CompilerParams(num_warps=8, num_stages=3)
  assert params.num_warps == 8 and params.num_stages == 3
  assert pltriton.TritonCompilerParams is pltriton.CompilerParams
  x = random_array((64,))
  spec = pl.BlockSpec((16,), lambda i: (i,))
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., jnp.abs(x_ref[...])),
                    out_shape=sds(x), grid=(4,), in_specs=[spec], out_specs=spec,
                    compiler_params=params)(x)
  assert_close(out, jnp.abs(x))

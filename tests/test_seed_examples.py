"""Every runnable code example of the seed documents, run through pallet and checked
against jax.numpy.

Examples that name another library (`plgpu.triton_call`, `plgpu.kernel`,
`pipelines.PipelineParams`) run with pallet's equivalent names. Examples that are
broken as written are run twice: (a) as written, in a configuration where they mean
something (or asserting the failure they produce), and (b) with the minimal fix. The
reasoning is in each test's comment and in docs/semantics.md ("Seed examples").
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet as pl
import pallet.tpu as pltpu
from helpers import assert_close, current_test_backend, pallas_call, random_array, runs_on_gpu

f32 = jnp.float32
# A Python slice with a traced bound fails while tracing (JAX's concretization error,
# or a pallet error that points at pl.ds).
_TRACED_SLICE_ERRORS = (pl.PalletError,)


# ============================================================ 000: Pallas Refs
def add_vectors_kernel(x_ref, y_ref, o_ref):
  x, y = x_ref[...], y_ref[...]
  o_ref[...] = x + y


@jax.jit
def add_vectors(x: jax.Array, y: jax.Array) -> jax.Array:
  return pallas_call(add_vectors_kernel,
                     out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)


def test_add_vectors_on_arange_as_in_the_docs():
  out = add_vectors(jnp.arange(8), jnp.arange(8))
  assert_close(out, jnp.arange(8) * 2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bfloat16])
def test_add_vectors_random(dtype):
  x, y = random_array((37,), dtype), random_array((37,), dtype)
  assert_close(add_vectors(x, y), x + y)


def add_sliced_kernel(x_ref, y_ref, o_ref):
  mid = x_ref.shape[0] // 2

  x_left = x_ref[:mid][...]
  x_right = x_ref[mid:][...]
  y_left = y_ref[:mid][...]
  y_right = y_ref[mid:][...]

  # The output shape is (4, mid).
  o_ref.at[0][...] = x_left + y_left
  o_ref.at[1][...] = x_left + y_right
  o_ref.at[2][...] = x_right + y_left
  o_ref.at[3][...] = x_right + y_right


def test_add_sliced_kernel():
  x, y = random_array((16,)), random_array((16,))
  out = pallas_call(add_sliced_kernel, out_shape=jax.ShapeDtypeStruct((4, 8), f32))(x, y)
  xl, xr, yl, yr = x[:8], x[8:], y[:8], y[8:]
  assert_close(out, jnp.stack([xl + yl, xl + yr, xr + yl, xr + yr]))


def test_at_slicing_and_striding_views_from_the_refs_doc():
  # "ref.at[0:128] creates a view of the first 128 elements; ref.at[::2] a strided view."
  def kernel(x_ref, first_ref, even_ref):
    first_ref[...] = x_ref.at[0:128][...]
    even_ref[...] = x_ref.at[::2][...]

  x = random_array((256,))
  first, even = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((128,), f32),) * 2)(x)
  assert_close(first, x[:128])
  assert_close(even, x[::2])


# ============================================================ 001: overview
def kernel_function(x_ref, y_ref, output_ref):
  # Read from refs
  x_value = x_ref[...]
  y_value = y_ref[...]
  # Perform computation
  result = x_value + y_value
  # Write to output ref
  output_ref[...] = result


@pytest.mark.parametrize("grid", [(8,), (4, 5)])
def test_grid_programming_whole_array_kernel(grid):
  # `pl.pallas_call(kernel, out_shape=..., grid=grid)(inputs)`: without BlockSpecs
  # every program sees the whole arrays, so all of them write the same sum.
  x, y = random_array((8, 16)), random_array((8, 16))
  out = pallas_call(kernel_function, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                    grid=grid)(x, y)
  assert_close(out, x + y)


def test_blockspec_example_grid_10_by_5():
  block_spec = pl.BlockSpec(
      block_shape=(64, 128),  # Size of each block
      index_map=lambda i, j: (i, j)  # How to map grid indices to blocks
  )

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + 1

  x = random_array((640, 640))
  out = pallas_call(kernel, grid=(10, 5), in_specs=[block_spec], out_specs=block_spec,
                    out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
  assert_close(out, x * 2 + 1)


def test_working_with_grid_indices():
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)  # Get current index along first grid axis
    j = pl.program_id(1)  # Get current index along second grid axis
    # Process block based on grid position
    o_ref[...] = x_ref[...] * i + j

  x = random_array((32, 48))
  spec = pl.BlockSpec((8, 16), lambda i, j: (i, j))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4, 3),
                    in_specs=[spec], out_specs=spec)(x)
  i = (jnp.arange(32) // 8)[:, None].astype(f32)
  j = (jnp.arange(48) // 16)[None, :].astype(f32)
  assert_close(out, x * i + j)


# ------------------------------------------------------------ TPU matmul example
def tpu_matmul_kernel_as_written(x_ref, y_ref, o_ref):
  # Each invocation handles a 128x128 block
  i, j = pl.program_id(0), pl.program_id(1)
  # Load blocks from VMEM
  x_block = x_ref[i * 128:(i + 1) * 128, :]
  y_block = y_ref[:, j * 128:(j + 1) * 128]
  # Compute and store result
  o_ref[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = jnp.dot(x_block, y_block)


def test_tpu_matmul_as_written_is_rejected():
  # As written the example passes `dimension_semantics=` straight to pallas_call,
  # which (like Pallas) has no such parameter: it belongs in compiler_params.
  with pytest.raises(TypeError, match="dimension_semantics"):
    functools.partial(pl.pallas_call, out_shape=jax.ShapeDtypeStruct((512, 512), f32),
                      grid=(4, 4), dimension_semantics=("parallel", "parallel"))(
                          tpu_matmul_kernel_as_written)
  # And Python slices `x_ref[i*128:(i+1)*128]` need a concrete start, but
  # program_id is traced (even on a one-step grid), so tracing fails.
  x, y = random_array((128, 64)), random_array((64, 128))
  with pytest.raises(_TRACED_SLICE_ERRORS):
    pallas_call(tpu_matmul_kernel_as_written,
                out_shape=jax.ShapeDtypeStruct((128, 128), f32), grid=(1, 1))(x, y)


def test_tpu_matmul_as_written_with_static_slices_on_a_one_step_grid():
  # The meaningful configuration of the example's body: one 128x128 tile, the
  # slices written with the (static) index 0 that program_id takes there.
  def kernel(x_ref, y_ref, o_ref):
    i, j = 0, 0
    x_block = x_ref[i * 128:(i + 1) * 128, :]
    y_block = y_ref[:, j * 128:(j + 1) * 128]
    o_ref[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = jnp.dot(x_block, y_block)

  x, y = random_array((128, 64)), random_array((64, 128))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128, 128), f32), grid=(1, 1),
                    compiler_params=pltpu.CompilerParams(
                        dimension_semantics=("parallel", "parallel")))(x, y)
  assert_close(out, x @ y, matmul=True)


def test_tpu_matmul_minimal_fix():
  # Fix: dimension_semantics goes into pallet.tpu.CompilerParams, and traced
  # starts use pl.ds(start, size). Without BlockSpecs each program sees the whole
  # arrays and writes its own 128x128 tile of the output.
  @functools.partial(
      pallas_call,
      out_shape=jax.ShapeDtypeStruct((512, 512), jnp.float32),
      grid=(4, 4),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")))
  def tpu_matmul_kernel(x_ref, y_ref, o_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    x_block = x_ref[pl.ds(i * 128, 128), :]
    y_block = y_ref[:, pl.ds(j * 128, 128)]
    o_ref[pl.ds(i * 128, 128), pl.ds(j * 128, 128)] = jnp.dot(x_block, y_block)

  x, y = random_array((512, 96)), random_array((96, 512))
  assert_close(tpu_matmul_kernel(x, y), x @ y, matmul=True)


# ------------------------------------------------------------ Triton example
def test_triton_example_as_written_fails_on_traced_slice():
  # `o_ref[idx:idx+128]` with idx = program_id(0) * 128: a Python slice needs a
  # concrete start; program_id is traced, so this cannot be traced on any grid.
  def triton_kernel(x_ref, y_ref, o_ref):
    idx = pl.program_id(0) * 128
    o_ref[idx:idx + 128] = x_ref[idx:idx + 128] + y_ref[idx:idx + 128]

  x, y = random_array((128,)), random_array((128,))
  with pytest.raises(_TRACED_SLICE_ERRORS):
    pallas_call(triton_kernel, out_shape=jax.ShapeDtypeStruct((128,), f32), grid=(1,))(x, y)


def test_triton_example_minimal_fix():
  # plgpu.triton_call -> pl.pallas_call; the slice becomes pl.ds(idx, 128).
  @functools.partial(pallas_call, out_shape=jax.ShapeDtypeStruct((1024,), jnp.float32),
                     grid=(8,))
  def triton_kernel(x_ref, y_ref, o_ref):
    idx = pl.program_id(0) * 128
    o_ref[pl.ds(idx, 128)] = x_ref[pl.ds(idx, 128)] + y_ref[pl.ds(idx, 128)]

  x, y = random_array((1024,)), random_array((1024,))
  assert_close(triton_kernel(x, y), x + y)


def test_mosaic_gpu_example():
  # plgpu.kernel -> pl.pallas_call; the body already uses pl.ds.
  @functools.partial(pallas_call, out_shape=jax.ShapeDtypeStruct((256,), jnp.float32),
                     grid=(2,))
  def mosaic_kernel(x_ref, y_ref):
    block_slice = pl.ds(pl.program_id(0) * 128, 128)
    y_ref[block_slice] = x_ref[block_slice] + 1

  x = random_array((256,))
  assert_close(mosaic_kernel(x), x + 1)


def test_gpu_memory_space_load_store():
  # `pl.load(x_ref, indices, memory_space=plgpu.SMEM)` / `pl.store(..., memory_space=GMEM)`
  def kernel(x_ref, o_ref):
    indices = (pl.ds(pl.program_id(0) * 32, 32),)
    x_in_smem = pl.load(x_ref, indices, memory_space=pl.MemorySpace.SMEM)
    pl.store(o_ref, indices, x_in_smem * 3, memory_space=pl.MemorySpace.GMEM)

  x = random_array((128,))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), f32), grid=(4,))(x)
  assert_close(out, x * 3)


# ------------------------------------------------------------ pipelining example
def test_pipelined_kernel():
  # pipelines.PipelineParams(num_stages=3, prefetch=True) -> pl.CompilerParams(num_stages=3)
  @functools.partial(
      pallas_call,
      out_shape=jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
      grid=(8, 8),
      in_specs=[pl.BlockSpec((128, 128), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((128, 128), lambda i, j: (i, j)),
      compiler_params=pl.CompilerParams(num_stages=3))
  def pipelined_kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...])

  x = random_array((1024, 1024))
  assert_close(pipelined_kernel(x), jnp.exp(x))


# ------------------------------------------------------------ API reference
def test_pallas_call_signature_matches_the_reference():
  params = inspect.signature(pl.pallas_call).parameters
  assert list(params)[:2] == ["kernel", "out_shape"]
  for name in ["grid_spec", "grid", "in_specs", "out_specs", "scratch_shapes",
               "input_output_aliases", "debug", "interpret", "name", "compiler_params",
               "cost_estimate", "backend"]:
    assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
  assert params["in_specs"].default is pl.no_block_spec
  assert params["out_specs"].default is pl.no_block_spec
  assert params["debug"].default is False and params["interpret"].default is False


def test_blockspec_and_gridspec_fields():
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0), memory_space=pltpu.VMEM)
  assert spec.block_shape == (8, 128) and spec.index_map(3) == (3, 0)
  assert spec.memory_space is pltpu.VMEM
  gs = pl.GridSpec(grid=(2,), in_specs=[spec], out_specs=spec, scratch_shapes=())
  assert gs.grid == (2,) and gs.in_specs == (spec,) and gs.out_specs is spec  # lists become tuples, as in JAX


def test_atomic_api_reference_calls():
  # Each call of the reference, on a single int32 cell, in sequence.
  def kernel(o_ref, olds_ref):
    o_ref[0] = jnp.int32(12)
    olds_ref[0] = pl.atomic_add(o_ref, 0, jnp.int32(5))                 # 17
    olds_ref[1] = pl.atomic_cas(o_ref, 0, jnp.int32(17), jnp.int32(6))  # 6
    olds_ref[2] = pl.atomic_max(o_ref, 0, jnp.int32(10))                # 10
    olds_ref[3] = pl.atomic_min(o_ref, 0, jnp.int32(7))                 # 7
    olds_ref[4] = pl.atomic_and(o_ref, 0, jnp.int32(0b0110))            # 6
    olds_ref[5] = pl.atomic_or(o_ref, 0, jnp.int32(0b1001))             # 15
    olds_ref[6] = pl.atomic_xor(o_ref, 0, jnp.int32(0b0101))            # 10

  out, olds = pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((1,), jnp.int32),
                                             jax.ShapeDtypeStruct((7,), jnp.int32)))()
  v, expected_olds = 12, []
  for op, arg in [("add", 5), ("cas", (17, 6)), ("max", 10), ("min", 7), ("and", 6),
                  ("or", 9), ("xor", 5)]:
    expected_olds.append(v)
    v = {"add": lambda: v + arg, "cas": lambda: arg[1] if v == arg[0] else v,
         "max": lambda: max(v, arg), "min": lambda: min(v, arg), "and": lambda: v & arg,
         "or": lambda: v | arg, "xor": lambda: v ^ arg}[op]()
  np.testing.assert_array_equal(olds, expected_olds)
  np.testing.assert_array_equal(out, [v])


def test_debug_print_and_when_reference(capfd):
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 1)
    def _():
      pl.debug_print("second program sees {}", x_ref[0])
    o_ref[...] = x_ref[...]

  x = jnp.arange(6, dtype=jnp.int32) * 7 + 3
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((6,), jnp.int32), grid=(3,),
                    in_specs=[pl.BlockSpec((2,), lambda i: (i,))],
                    out_specs=pl.BlockSpec((2,), lambda i: (i,)))(x)
  jax.effects_barrier()
  np.testing.assert_array_equal(out, x)
  assert "second program sees" in capfd.readouterr().out


# ------------------------------------------------------------ matmul with activation
def matmul_kernel(x_ref, y_ref, o_ref, *, activation):
  x = x_ref[...]
  y = y_ref[...]
  result = jnp.dot(x, y)

  if activation == "relu":
    result = jnp.maximum(result, 0)
  elif activation == "silu":
    result = result * jax.nn.sigmoid(result)

  o_ref[...] = result


@functools.partial(jax.jit, static_argnames=['activation'])
def matmul(x, y, *, activation=None):
  return pallas_call(
      functools.partial(matmul_kernel, activation=activation),
      out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype),
      grid=(2, 2),
      in_specs=[
          pl.BlockSpec((x.shape[0] // 2, x.shape[1]), lambda i, j: (i, 0)),
          pl.BlockSpec((y.shape[0], y.shape[1] // 2), lambda i, j: (0, j))
      ],
      out_specs=pl.BlockSpec((x.shape[0] // 2, y.shape[1] // 2), lambda i, j: (i, j))
  )(x, y)


@pytest.mark.parametrize("activation", [None, "relu", "silu"])
def test_matmul_with_activation(activation):
  x, y = random_array((64, 32)), random_array((32, 48))
  ref = x @ y
  if activation == "relu":
    ref = jnp.maximum(ref, 0)
  elif activation == "silu":
    ref = ref * jax.nn.sigmoid(ref)
  assert_close(matmul(x, y, activation=activation), ref, matmul=True)


def test_batched_matmul_as_written_passes_arrays_to_pallas_call():
  # As written, `functools.partial(pl.pallas_call, matmul_kernel, out_shape=...)` is
  # called with the arrays, so they land in pallas_call's own parameters instead of
  # reaching the kernel (and matmul_kernel's `activation` is never bound): this can
  # not run in any configuration.
  single_matmul = functools.partial(
      pallas_call, matmul_kernel, out_shape=jax.ShapeDtypeStruct((256, 256), jnp.float32),
      grid=(2, 2))
  x, y = random_array((256, 256)), random_array((256, 256))
  with pytest.raises(TypeError):
    single_matmul(x, y)


def _single_matmul():
  # Minimal fix: pallas_call(kernel, ...) returns the function to vmap; the
  # elided specs are the ones of `matmul` above for 256x256 operands.
  return pallas_call(
      functools.partial(matmul_kernel, activation=None),
      out_shape=jax.ShapeDtypeStruct((256, 256), jnp.float32),
      grid=(2, 2),
      in_specs=[pl.BlockSpec((128, 256), lambda i, j: (i, 0)),
                pl.BlockSpec((256, 128), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((128, 128), lambda i, j: (i, j)))


def test_batched_matmul_with_vmap_minimal_fix():
  batched_matmul = jax.vmap(_single_matmul())
  x = jnp.ones((10, 256, 256))  # as in the docs ...
  y = jnp.ones((10, 256, 256))
  if current_test_backend() == "triton" and runs_on_gpu():
    # Its (128, 256) x (256, 128) float32 tiles need 256 KiB of shared memory: more than
    # any GPU has (an H100: 227 KiB). That is a clear error, not a crash at launch.
    with pytest.raises(Exception, match="needs 262144 bytes of shared memory"):
      batched_matmul(x, y)
    return
  result = batched_matmul(x, y)
  assert result.shape == (10, 256, 256)
  assert_close(result, jnp.full((10, 256, 256), 256.0))
  x, y = random_array((3, 256, 256)), random_array((3, 256, 256))  # ... and random
  assert_close(batched_matmul(x, y), jnp.einsum("bij,bjk->bik", x, y), matmul=True)


# ------------------------------------------------------------ sum reduction
def sum_reduction_kernel(x_ref, o_ref):
  # Read input block
  x = x_ref[...]
  # Perform reduction
  sum_val = jnp.sum(x, axis=-1, keepdims=True)
  # Store result
  o_ref[...] = sum_val


def parallel_sum_as_written(x):
  return pallas_call(
      sum_reduction_kernel,
      out_shape=jax.ShapeDtypeStruct((x.shape[0], 1), x.dtype),
      grid=(x.shape[0] // 128,),
      in_specs=pl.BlockSpec((128, x.shape[1]), lambda i: (i * 128, 0)),
      out_specs=pl.BlockSpec((128, 1), lambda i: (i * 128, 0))
  )(x)


def test_parallel_sum_as_written_on_a_one_step_grid():
  # The index maps return element offsets (i * 128) for Blocked dims, where block
  # indices are expected. With one grid step i == 0, so offset and index agree.
  x = random_array((128, 40))
  assert_close(parallel_sum_as_written(x), jnp.sum(x, axis=-1, keepdims=True))


def test_parallel_sum_as_written_on_several_steps_leaves_rows_unwritten():
  # With more steps, block index i*128 lies past the array: its write is dropped
  # (docs/semantics.md, "Blocks past the array edge"), so only block 0 is right.
  x = random_array((256, 40))
  out = parallel_sum_as_written(x)
  assert_close(out[:128], jnp.sum(x[:128], axis=-1, keepdims=True))
  assert not np.allclose(out[128:], jnp.sum(x[128:], axis=-1, keepdims=True))


@pytest.mark.parametrize("fix", ["element", "block_index"])
def test_parallel_sum_minimal_fix(fix):
  def parallel_sum(x):
    if fix == "element":   # keep the element offsets, declare them with pl.Element
      rows, index_map = pl.Element(128), lambda i: (i * 128, 0)
    else:                  # or keep Blocked dims and return block indices
      rows, index_map = 128, lambda i: (i, 0)
    return pallas_call(
        sum_reduction_kernel,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], 1), x.dtype),
        grid=(x.shape[0] // 128,),
        in_specs=pl.BlockSpec((rows, x.shape[1]), index_map),
        out_specs=pl.BlockSpec((rows, 1), index_map))(x)

  x = random_array((512, 40))
  assert_close(parallel_sum(x), jnp.sum(x, axis=-1, keepdims=True))


# ------------------------------------------------------------ attention
def attention_kernel(q_ref, k_ref, v_ref, o_ref, *, block_size):
  q = q_ref[...]
  k = k_ref[...]
  v = v_ref[...]
  # Compute attention scores
  scores = jnp.dot(q, k.T) / jnp.sqrt(k.shape[-1])
  # Apply softmax
  attn_weights = jax.nn.softmax(scores, axis=-1)
  # Compute output
  o_ref[...] = jnp.dot(attn_weights, v)


def blocked_attention_as_written(q, k, v, block_size=64):
  seq_len, d_model = q.shape

  return pallas_call(
      functools.partial(attention_kernel, block_size=block_size),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(seq_len // block_size,),
      in_specs=[
          pl.BlockSpec((block_size, d_model), lambda i: (i * block_size, 0)),
          pl.BlockSpec(k.shape, lambda i: (0, 0)),  # Full K matrix
          pl.BlockSpec(v.shape, lambda i: (0, 0)),  # Full V matrix
      ],
      out_specs=pl.BlockSpec((block_size, d_model), lambda i: (i * block_size, 0))
  )(q, k, v)


def blocked_attention_fixed(q, k, v, block_size=64):
  # Minimal fix: the query/output rows are pl.Element dims (element offsets).
  seq_len, d_model = q.shape
  return pallas_call(
      functools.partial(attention_kernel, block_size=block_size),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(seq_len // block_size,),
      in_specs=[
          pl.BlockSpec((pl.Element(block_size), d_model), lambda i: (i * block_size, 0)),
          pl.BlockSpec(k.shape, lambda i: (0, 0)),
          pl.BlockSpec(v.shape, lambda i: (0, 0)),
      ],
      out_specs=pl.BlockSpec((pl.Element(block_size), d_model),
                             lambda i: (i * block_size, 0)))(q, k, v)


def attention_reference(q, k, v):
  return jax.nn.softmax(q @ k.T / jnp.sqrt(k.shape[-1]), axis=-1) @ v


def test_attention_as_written_on_a_one_step_grid():
  q, k, v = random_array((64, 32)), random_array((96, 32)), random_array((96, 32))
  assert_close(blocked_attention_as_written(q, k, v), attention_reference(q, k, v),
               matmul=True)


def test_attention_minimal_fix():
  q, k, v = random_array((256, 32)), random_array((96, 32)), random_array((96, 32))
  assert_close(blocked_attention_fixed(q, k, v), attention_reference(q, k, v), matmul=True)


# ============================================================ 002 / 004: add_one
def identity_kernel(input_ref, output_ref):
  value = input_ref[...]  # Uses NumPy-like indexing semantics to read values
  output_ref[...] = value  # Writes value to `output_ref`


def test_identity_kernel():
  x = random_array((5, 7))
  assert_close(pallas_call(identity_kernel, out_shape=jax.ShapeDtypeStruct(x.shape,
                                                                           x.dtype))(x), x)


def add_one_kernel(x_ref, o_ref, *, block_size: int):
  i = pl.program_id(0)
  offsets = i * block_size + jnp.arange(block_size)
  o_ref[offsets] = x_ref[offsets] + 1


@jax.jit
def add_one(x):
  return pallas_call(
      functools.partial(add_one_kernel, block_size=8),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=pl.cdiv(x.shape[0], 8))(x)


def test_add_one_as_in_the_docs():
  x = jnp.arange(32)
  np.testing.assert_allclose(add_one(x), x + 1)


def test_add_one_vmap_as_in_the_docs():
  x = jnp.arange(4 * 32).reshape((4, 32))
  np.testing.assert_allclose(jax.vmap(add_one)(x), x + 1)


def test_add_one_random_and_vmap_random():
  x = random_array((40,))
  assert_close(add_one(x), x + 1)
  xb = random_array((3, 40), jnp.int32)
  assert_close(jax.vmap(add_one)(xb), xb + 1)


def test_grid_pseudocode_runs_every_index_once_in_row_major_order():
  # "for ndindex in np.ndenumerate(grid): run_kernel(ndindex, kernel)" for grid (1, 2, 3)
  grid = (1, 2, 3)

  def kernel(o_ref, count_ref):
    @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0) & (pl.program_id(2) == 0))
    def _():
      count_ref[0] = jnp.int32(0)
    n = count_ref[0]
    o_ref[pl.program_id(0), pl.program_id(1), pl.program_id(2)] = n
    count_ref[0] = n + 1

  order, _ = pallas_call(kernel, grid=grid,
                         out_shape=(jax.ShapeDtypeStruct(grid, jnp.int32),
                                    jax.ShapeDtypeStruct((1,), jnp.int32)))()
  np.testing.assert_array_equal(order, np.arange(6).reshape(grid))

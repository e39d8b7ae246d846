"""Out-of-bounds reads and writes, and index maps placing blocks outside the array."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import pallet as pl
from bugs.corpus import bug_case
from helpers import random_array

F32 = jnp.float32


# ------------------------------------------------------------------ pl.ds past the end
def _next_block_reference(x):
  blocks = x.reshape(8, 16)
  nxt = blocks[jnp.minimum(jnp.arange(8) + 1, 7)]
  return (blocks + nxt).reshape(-1)


@bug_case(kind="out_of_bounds", ref="x_ref", inputs=lambda: (random_array((128,)),),
          reference=_next_block_reference)
def halo_reads_next_block_past_end(bug, **call):
  """Each program adds the next block; the last program has none."""
  n_blocks, b = 8, 16

  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    cur = x_ref[pl.ds(i * b, b)]
    nxt_block = i + 1 if bug else jnp.minimum(i + 1, n_blocks - 1)
    nxt = x_ref[pl.ds(nxt_block * b, b)]  # BUG: block n_blocks does not exist
    o_ref[...] = cur + nxt

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), F32), grid=(n_blocks,),
                        out_specs=pl.BlockSpec((b,), lambda i: (i,)), **call)


@bug_case(kind="out_of_bounds", ref="x_ref", inputs=lambda: (random_array((64,)),),
          reference=lambda x: x.reshape(4, 2, 8).sum(1).reshape(-1), static=True)
def static_ds_start_off_by_one(bug, **call):
  """Adds the two halves of each 16-element block; the second half starts at 8."""
  def kernel(x_ref, o_ref):
    lo = x_ref[pl.ds(0, 8)]
    hi = x_ref[pl.ds(9, 8)] if bug else x_ref[pl.ds(8, 8)]  # BUG: 9 + 8 > 16
    o_ref[...] = lo + hi

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32,), F32), grid=(4,),
                        in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
                        out_specs=pl.BlockSpec((8,), lambda i: (i,)), **call)


@bug_case(kind="out_of_bounds", ref="x_ref", inputs=lambda: (random_array((512,)),),
          reference=lambda x: (x.reshape(4, 128) - x.reshape(4, 128)[:, 127:]).reshape(-1),
          static=True)
def static_index_of_last_element_off_by_one(bug, **call):
  """Subtracts the block's last element, indexed as x_ref[128] instead of x_ref[127]."""
  def kernel(x_ref, o_ref):
    last = x_ref[128] if bug else x_ref[127]  # BUG: the block has 128 elements
    o_ref[...] = x_ref[...] - last

  spec = pl.BlockSpec((128,), lambda i: (i,))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((512,), F32), grid=(4,),
                        in_specs=[spec], out_specs=spec, **call)


@bug_case(kind="out_of_bounds", ref="x_ref", inputs=lambda: (random_array((16, 256)),),
          reference=lambda x: x.reshape(16, 4, 64).sum(1))
def fori_loop_one_chunk_too_many(bug, **call):
  """Sums the 64-column chunks of each row in a loop whose trip count is one too many."""
  chunks = 256 // 64

  def kernel(x_ref, o_ref):
    def body(t, acc):
      return acc + x_ref[:, pl.ds(t * 64, 64)]  # BUG: chunk 4 is past column 256

    trips = chunks + 1 if bug else chunks
    first = x_ref[:, pl.ds(0, 64)]
    o_ref[...] = lax.fori_loop(1, trips, body, first)

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 64), F32), **call)


@bug_case(kind="out_of_bounds", ref="x_ref", inputs=lambda: (random_array((8, 300)),),
          reference=lambda x: 2.0 * x)
def manual_column_blocks_overhang(bug, **call):
  """Blocks 300 columns by hand in 128s; the last block overhangs the array."""
  b = 128

  def kernel(x_ref, o_ref):
    j = pl.program_id(0)
    cols = pl.ds(j * b, b)
    valid = (j * b + jnp.arange(b))[None, :] < 300
    if bug:
      y = x_ref[:, cols] * 2.0  # BUG: columns 300..383 of the last block do not exist
    else:
      y = pl.load(x_ref, (slice(None), cols), mask=valid, other=0.0) * 2.0
    pl.store(o_ref, (slice(None), cols), y, mask=valid)

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 300), F32),
                        grid=(pl.cdiv(300, b),), **call)


# ------------------------------------------------------------------ masks
@bug_case(kind="out_of_bounds", ref="x_ref", inputs=lambda: (random_array((100,)),),
          reference=lambda x: 2.0 * x)
def masked_load_mask_off_by_one(bug, **call):
  """Triton-style masked loads over 100 elements in blocks of 32; the mask is `<=`."""
  n, b = 100, 32

  def kernel(x_ref, o_ref):
    offs = pl.program_id(0) * b + jnp.arange(b)
    mask = offs <= n if bug else offs < n
    x = pl.load(x_ref, pl.ds(pl.program_id(0) * b, b), mask=mask, other=0.0)  # BUG: lane 100
    pl.store(o_ref, pl.ds(pl.program_id(0) * b, b), 2.0 * x, mask=offs < n)

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), F32),
                        grid=(pl.cdiv(n, b),), **call)


@bug_case(kind="out_of_bounds", ref="o_ref", inputs=lambda: (random_array((100,)),),
          reference=lambda x: 3.0 * x[:90])
def masked_store_uses_input_length(bug, **call):
  """Writes the first 90 of 100 elements; the store mask reuses the input's length."""
  n_in, n_out, b = 100, 90, 32

  def kernel(x_ref, o_ref):
    offs = pl.program_id(0) * b + jnp.arange(b)
    x = pl.load(x_ref, pl.ds(pl.program_id(0) * b, b), mask=offs < n_in, other=0.0)
    store_mask = offs < n_in if bug else offs < n_out
    pl.store(o_ref, pl.ds(pl.program_id(0) * b, b), 3.0 * x, mask=store_mask)  # BUG: 90..95

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n_out,), F32),
                        grid=(pl.cdiv(n_out, b),), **call)


@bug_case(kind="out_of_bounds", ref="o_ref", inputs=lambda: (random_array((100,)),),
          reference=lambda x: x + 1.0)
def store_without_mask_in_last_block(bug, **call):
  """Masks the load of the last partial block but forgets the store."""
  n, b = 100, 32

  def kernel(x_ref, o_ref):
    offs = pl.program_id(0) * b + jnp.arange(b)
    x = pl.load(x_ref, pl.ds(pl.program_id(0) * b, b), mask=offs < n, other=0.0)
    if bug:
      pl.store(o_ref, pl.ds(pl.program_id(0) * b, b), x + 1.0)  # BUG: no mask
    else:
      pl.store(o_ref, pl.ds(pl.program_id(0) * b, b), x + 1.0, mask=offs < n)

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), F32),
                        grid=(pl.cdiv(n, b),), **call)


# ------------------------------------------------------------------ integer-array indices
def _forward_difference(x):
  nxt = x[jnp.minimum(jnp.arange(x.shape[0]) + 1, x.shape[0] - 1)]
  return nxt - x


@bug_case(kind="out_of_bounds", ref="x_ref", inputs=lambda: (random_array((64,)),),
          reference=_forward_difference)
def gather_next_neighbour_past_end(bug, **call):
  """A forward difference by gathering x[k + 1]; k + 1 reaches 64."""
  n = 64

  def kernel(x_ref, o_ref):
    k = jnp.arange(n)
    idx = k + 1 if bug else jnp.minimum(k + 1, n - 1)
    o_ref[...] = x_ref[idx] - x_ref[...]  # BUG: index 64

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), F32), **call)


def _ids(vocab: int = 32, tokens: int = 16):
  # One-based token ids 1..vocab (the last id always present).
  ids = random_array((tokens,), jnp.int32, low=1, high=vocab)
  return ids.at[-1].set(vocab)


@bug_case(kind="out_of_bounds", ref="table_ref",
          inputs=lambda: (random_array((32, 8)), _ids()),
          reference=lambda table, ids: table[ids - 1])
def embedding_lookup_one_based_ids(bug, **call):
  """Looks up one-based token ids without subtracting one."""
  def kernel(table_ref, ids_ref, o_ref):
    ids = ids_ref[...] if bug else ids_ref[...] - 1
    o_ref[...] = table_ref[ids, :]  # BUG: id 32 is row 32 of a 32-row table

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 8), F32), **call)


# ------------------------------------------------------------------ index maps
@bug_case(kind="index_map", ref="x_ref", inputs=lambda: (random_array((256,)),),
          reference=lambda x: x * x)
def index_map_returns_element_offsets(bug, **call):
  """The index map returns the block's first element instead of its block index."""
  b = 32
  if bug:
    x_spec = pl.BlockSpec((b,), lambda i: (i * b,))  # BUG: element offset
  else:
    x_spec = pl.BlockSpec((b,), lambda i: (i,))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * x_ref[...]

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((256,), F32), grid=(8,),
                        in_specs=[x_spec], out_specs=pl.BlockSpec((b,), lambda i: (i,)), **call)


@bug_case(kind="index_map", ref="x_ref", inputs=lambda: (random_array((64, 512)),),
          reference=lambda x: x + 1.0)
def index_map_swaps_grid_axes(bug, **call):
  """A 2 x 4 grid of (32, 128) blocks whose input index map swaps i and j."""
  if bug:
    x_spec = pl.BlockSpec((32, 128), lambda i, j: (j, i))  # BUG: block row j > 1
  else:
    x_spec = pl.BlockSpec((32, 128), lambda i, j: (i, j))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 512), F32), grid=(2, 4),
                        in_specs=[x_spec],
                        out_specs=pl.BlockSpec((32, 128), lambda i, j: (i, j)), **call)


@bug_case(kind="index_map", ref="y_ref",
          inputs=lambda: (random_array((64, 128)), random_array((128, 256))),
          reference=lambda x, y: jnp.dot(x, y, precision="highest"), matmul=True)
def matmul_rhs_index_map_transposed(bug, **call):
  """Blocked matmul whose right-hand index map is (j, k) instead of (k, j)."""
  bm, bn, bk = 32, 64, 64
  if bug:
    y_spec = pl.BlockSpec((bk, bn), lambda i, j, k: (j, k))  # BUG: block row j > 1
  else:
    y_spec = pl.BlockSpec((bk, bn), lambda i, j, k: (k, j))

  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += jnp.dot(x_ref[...], y_ref[...], precision="highest")

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 256), F32),
                        grid=(2, 4, 2),
                        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)), y_spec],
                        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)), **call)


@bug_case(kind="index_map", ref="o_ref", inputs=lambda: (random_array((128,)),),
          reference=lambda x: jnp.concatenate([x[96:], x[:96]]) * 0.5)
def output_index_map_rolls_without_wrap(bug, **call):
  """Rolls blocks right by one; the output index map forgets the wrap-around."""
  n_blocks, b = 4, 32
  if bug:
    o_spec = pl.BlockSpec((b,), lambda i: (i + 1,))  # BUG: block 4 of 4
  else:
    o_spec = pl.BlockSpec((b,), lambda i: ((i + 1) % n_blocks,))

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 0.5

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), F32), grid=(n_blocks,),
                        in_specs=[pl.BlockSpec((b,), lambda i: (i,))], out_specs=o_spec,
                        **call)

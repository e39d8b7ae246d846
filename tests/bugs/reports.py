"""Bugs modeled on reports against other kernel libraries and compilers (each cites its
thread): outputs left partly unwritten, NaN from finite inputs, int32 offsets that
overflow."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallet as pl
from bugs.corpus import bug_case
from helpers import random_array

F32 = jnp.float32


def _gemv_inputs():
  return random_array((64, 32)), random_array((32,))


@bug_case(kind="unwritten", ref="y_ref", inputs=_gemv_inputs, reference=lambda a, x: a @ x)
def gemv_block_computes_half_its_rows(bug, **call):
  """A matrix-vector product whose programs each own 16 rows but compute only the first
  8 (the work split assumed 8 rows per program). Modeled on
  https://github.com/1bit-MONSTER/1bit-MONSTER/issues/678 (a GEMV kernel launched with
  16 rows per block that writes 8)."""
  rows = 8 if bug else 16

  def kernel(a_ref, x_ref, y_ref):  # BUG: rows 8..15 of each block of y_ref
    a = a_ref[pl.ds(0, rows), :]
    y_ref[pl.ds(0, rows)] = jnp.sum(a * x_ref[...][None, :], axis=1)

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(4,),
                        in_specs=[pl.BlockSpec((16, 32), lambda i: (i, 0)),
                                  pl.BlockSpec((32,), lambda i: (0,))],
                        out_specs=pl.BlockSpec((16,), lambda i: (i,)), **call)


def _col2im(cols):
  """Sums 2x2 patches with stride 2 and dilation 2 back into a 16x16 image: only the
  even rows and columns receive anything; the others are zero."""
  image = jnp.zeros((16, 16), F32)
  patches = cols.reshape(4, 4, 2, 2)
  for di in range(2):
    for dj in range(2):
      image = image.at[2 * di:2 * di + 8:2, 2 * dj:2 * dj + 8:2].add(patches[:, :, di, dj])
  return image


@bug_case(kind="unwritten", ref="img_ref", inputs=lambda: (random_array((4 * 4 * 4,)),),
          reference=_col2im)
def col2im_zeroes_only_where_patches_land(bug, **call):
  """Folds 2x2 patches (stride 2, dilation 2) back into an image, zeroing only the
  pixels the patches land on: with this stride and dilation they cover the even rows
  and columns, and the other pixels are never written. Modeled on
  https://github.com/openvinotoolkit/openvino/pull/38208 (col2im zero-initialized the
  output only where its kernel window landed). The fix zeroes the whole image."""
  def kernel(cols_ref, img_ref):  # BUG: odd rows and columns of img_ref stay unwritten
    patches = cols_ref[...].reshape(4, 4, 2, 2)
    windows = [(pl.ds(2 * di, 4, 2), pl.ds(2 * dj, 4, 2)) for di in range(2) for dj in range(2)]
    if bug:
      for window in windows:
        img_ref[window] = jnp.zeros((4, 4), F32)
    else:
      img_ref[...] = jnp.zeros((16, 16), F32)
    for k, window in enumerate(windows):
      img_ref[window] += patches[:, :, k // 2, k % 2]

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), F32), **call)


@bug_case(kind="unwritten", ref="o_ref",
          inputs=lambda: (random_array((16,)), random_array((16,))),
          reference=lambda x, y: x * y)
def product_written_only_between_start_and_end(bug, **call):
  """Multiplies x[start:end] * y[start:end] into an output the size of the whole
  arrays, leaving the rest as whatever memory held. Modeled on
  https://github.com/jax-ml/jax/issues/20227 (a Pallas kernel writing o_ref[start:end]
  whose other elements came back as garbage)."""
  start, end = (4, 12) if bug else (0, 16)

  def kernel(x_ref, y_ref, o_ref):  # BUG: o_ref outside [start, end) is never written
    o_ref[start:end] = x_ref[start:end] * y_ref[start:end]

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), F32), **call)


def _masked_scores():
  scores = random_array((8, 128))
  mask = jnp.asarray(np.random.default_rng(3).random((8, 128)) < 0.5)
  return scores, mask.at[5].set(False)    # row 5: nothing to attend to


def _safe_softmax(scores, mask):
  e = jnp.where(mask, jnp.exp(scores - jnp.max(scores, axis=1, keepdims=True)), 0.0)
  total = jnp.sum(e, axis=1, keepdims=True)
  return e / jnp.maximum(total, 1e-30)


@bug_case(kind="nan", ref=None, inputs=_masked_scores, reference=_safe_softmax)
def masked_softmax_of_a_fully_masked_row(bug, **call):
  """Masked softmax normalized by the sum of the kept terms: a row with every score
  masked divides 0 by 0. Modeled on https://github.com/iree-org/iree/pull/24178
  (attention softmax produced NaN for fully-masked rows)."""
  def kernel(s_ref, m_ref, o_ref):
    s = s_ref[...]
    e = jnp.where(m_ref[...], jnp.exp(s - jnp.max(s, axis=1, keepdims=True)), 0.0)
    total = jnp.sum(e, axis=1, keepdims=True)
    o_ref[...] = e / (total if bug else jnp.maximum(total, 1e-30))  # BUG: 0 / 0

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), F32), **call)


N_BUCKETS = 4096
ROW_STRIDE = 65536     # elements per row of the (conceptual) table
FOLD = 4096            # rows of the table share one bucket per FOLD elements


def _token_rows():
  return (jnp.asarray(np.random.default_rng(5).integers(30000, 50000, 64), jnp.int32),
          random_array((N_BUCKETS,)))


def _buckets(rows):
  return (rows * (ROW_STRIDE // FOLD)) % N_BUCKETS


@bug_case(kind="overflow", ref=None, inputs=_token_rows,
          reference=lambda rows, table: table[_buckets(rows)])
def row_offset_times_stride_overflows(bug, **call):
  """Maps rows to buckets through their flat offset `row * stride // fold`, computed in
  int32: for row ids past 32767 the product passes 2**31 and wraps (the fix divides
  the stride first). Modeled on https://github.com/databricks/megablocks/pull/185
  (int32 `offset * NUM_COLUMNS` overflowing in Triton pointer arithmetic)."""
  def kernel(rows_ref, table_ref, o_ref):
    rows = rows_ref[...]
    if bug:
      flat = rows * ROW_STRIDE  # BUG: passes 2**31 for rows > 32767
      bucket = (flat // FOLD) % N_BUCKETS
    else:
      bucket = _buckets(rows)
    o_ref[...] = table_ref[bucket]

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), **call)


def _tiles():
  return random_array((256,)), jnp.zeros((1,), jnp.int32)


@bug_case(kind="race", ref="count_ref", inputs=_tiles,
          reference=lambda x, zeros: (2.0 * x, zeros + 4))
def work_counter_zeroed_inside_the_kernel(bug, **call):
  """Each program doubles its tile and counts it in a work counter with an atomic add;
  the first program zeroes the counter with a plain store, which races with the other
  programs' atomic adds (on a GPU the store may land after some of them). Modeled on
  https://github.com/vllm-project/vllm-xpu-kernels/pull/586 (a persistent kernel's
  work counter zeroed in-kernel by one workgroup while the others atomically add to
  it). The fix zeroes the counter before the call: an input aliased to it."""
  def kernel(x_ref, zeros_ref, o_ref, count_ref):
    del zeros_ref  # aliased to count_ref: the counter starts at zero
    if bug:
      @pl.when(pl.program_id(0) == 0)
      def _():
        count_ref[0] = 0  # BUG: a plain store the other programs' atomics race with

    o_ref[...] = 2.0 * x_ref[...]
    pl.atomic_add(count_ref, 0, jnp.int32(1))

  block = pl.BlockSpec((64,), lambda i: (i,))
  whole = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(kernel, grid=(4,),
                        out_shape=(jax.ShapeDtypeStruct((256,), F32),
                                   jax.ShapeDtypeStruct((1,), jnp.int32)),
                        in_specs=[block, whole], out_specs=(block, whole),
                        input_output_aliases={1: 1}, **call)


def _rows_to_reduce():
  return random_array((512,)), jnp.zeros((1,), F32)


@bug_case(kind="uninitialized", ref="o_ref", inputs=_rows_to_reduce,
          reference=lambda x, zeros: zeros + jnp.sum(x, keepdims=True))
def atomic_sum_into_an_unzeroed_output(bug, **call):
  """A grid-wide sum: every program reduces its tile and atomically adds the partial
  sum into the one output cell, which nothing set to zero (an atomic add reads the
  cell first). Modeled on https://github.com/ByteDance-Seed/Triton-distributed/issues/182
  (`tl.atomic_add` accumulating into a `torch.empty` output). The fix starts the cell
  from zeros aliased to it."""
  def kernel(x_ref, o_ref):
    partial = jnp.sum(x_ref[...], keepdims=True)
    pl.atomic_add(o_ref, pl.ds(0, 1), partial)  # BUG: o_ref was never zeroed

  def fixed_kernel(x_ref, zeros_ref, o_ref):
    del zeros_ref  # aliased to o_ref: the sum starts at zero
    kernel(x_ref, o_ref)

  block = pl.BlockSpec((128,), lambda i: (i,))
  whole = pl.BlockSpec(memory_space=pl.ANY)
  program = pl.pallas_call(kernel if bug else fixed_kernel, grid=(4,), out_shape=jax.ShapeDtypeStruct((1,), F32),
                           in_specs=[block] + ([] if bug else [whole]), out_specs=whole,
                           input_output_aliases={} if bug else {1: 0}, **call)
  return (lambda x, zeros: program(x)) if bug else program

"""Races: programs of a parallel axis writing the same element, one program writing
what another reads, a carry across a declared-parallel axis, stores mixed with atomics."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallet as pl
from pallet import tpu as pltpu
from bugs.corpus import bug_case
from helpers import random_array

F32 = jnp.float32
PARALLEL = pl.CompilerParams(dimension_semantics=("parallel",))


@bug_case(kind="race", ref="o_ref", inputs=lambda: (random_array((256,)),),
          reference=lambda x: 2.0 * x)
def parallel_programs_write_one_block(bug, **call):
  """Each program doubles its block, but the output index map ignores the grid index."""
  b = 64
  o_map = (lambda i: (0,)) if bug else (lambda i: (i,))

  def kernel(x_ref, o_ref):
    o_ref[...] = 2.0 * x_ref[...]  # BUG: every program writes output block 0

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((256,), F32), grid=(4,),
                        in_specs=[pl.BlockSpec((b,), lambda i: (i,))],
                        out_specs=pl.BlockSpec((b,), o_map), compiler_params=PARALLEL, **call)


@bug_case(kind="race", ref="o_ref", inputs=lambda: (random_array((64, 256)),),
          reference=lambda x: jnp.tanh(x))
def output_index_map_forgets_column_axis(bug, **call):
  """A 2-D elementwise kernel whose output index map drops the column block index."""
  o_map = (lambda i, j: (i, 0)) if bug else (lambda i, j: (i, j))

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.tanh(x_ref[...])  # BUG: programs (i, 0..3) all write block (i, 0)

  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((64, 256), F32), grid=(2, 4),
      in_specs=[pl.BlockSpec((32, 64), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((32, 64), o_map),
      compiler_params=pl.CompilerParams(dimension_semantics=("parallel", "parallel")), **call)


@bug_case(kind="race", ref="o_ref", inputs=lambda: (random_array((128, 64)),),
          reference=lambda x: jnp.sum(x, axis=0))
def reduction_axis_declared_parallel(bug, **call):
  """Column sums whose row-block (reduction) axis is declared parallel."""
  semantics = ("parallel", "parallel") if bug else ("parallel", "arbitrary")

  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += jnp.sum(x_ref[...], axis=0)  # BUG: the row blocks share this block

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(2, 4),
                        in_specs=[pl.BlockSpec((32, 32), lambda j, i: (i, j))],
                        out_specs=pl.BlockSpec((32,), lambda j, i: (j,)),
                        compiler_params=pl.CompilerParams(dimension_semantics=semantics),
                        **call)


@bug_case(kind="race", ref="carry_ref", inputs=lambda: (random_array((256,)),),
          reference=jnp.cumsum)
def carry_across_declared_parallel_axis(bug, **call):
  """Blocked prefix sum carrying the running total in scratch, axis declared parallel."""
  b = 32

  def kernel(x_ref, o_ref, carry_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      carry_ref[...] = jnp.zeros_like(carry_ref)

    sums = jnp.cumsum(x_ref[...]) + carry_ref[0]  # BUG: carry written by program i - 1
    o_ref[...] = sums
    carry_ref[0] = sums[b - 1]

  params = {"compiler_params": PARALLEL} if bug else {}
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((256,), F32), grid=(8,),
                        in_specs=[pl.BlockSpec((b,), lambda i: (i,))],
                        out_specs=pl.BlockSpec((b,), lambda i: (i,)),
                        scratch_shapes=[pltpu.VMEM((1,), F32)], **params, **call)


def _smoothed(x):
  prev = jnp.concatenate([x[:1], x[:-1]])
  return 0.5 * (x + prev)


@bug_case(kind="race", ref="o_ref", inputs=lambda: (random_array((128,)),),
          reference=_smoothed)
def reads_neighbour_output_written_by_another_program(bug, **call):
  """Smooths with the previous element, read from the output another program wrote."""
  n, b = 128, 32

  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[pl.ds(i * b, b)] = x_ref[pl.ds(i * b, b)]
    prev = jnp.maximum(i * b - 1 + jnp.arange(b), 0)
    src = o_ref if bug else x_ref
    o_ref[pl.ds(i * b, b)] = 0.5 * (o_ref[pl.ds(i * b, b)] + src[prev])  # BUG: block i - 1

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), F32),
                        grid=(n // b,), compiler_params=PARALLEL, **call)


def _histogram_inputs():
  return (random_array((256,), jnp.int32, low=0, high=15), jnp.zeros((16,), jnp.int32))


@bug_case(kind="race", ref="o_ref", inputs=_histogram_inputs,
          reference=lambda v, zeros: zeros + jnp.bincount(v, length=16).astype(jnp.int32))
def histogram_zeroed_with_plain_store(bug, **call):
  """Atomic histogram whose first program clears the bins with a plain store."""
  b = 64

  def kernel(v_ref, zeros_ref, o_ref):
    del zeros_ref  # aliased to o_ref: the bins start at zero
    if bug:
      @pl.when(pl.program_id(0) == 0)
      def _():
        o_ref[...] = jnp.zeros_like(o_ref)  # BUG: races with the other programs' atomics

    counts = jnp.sum(v_ref[...][:, None] == jnp.arange(16)[None, :], axis=0, dtype=jnp.int32)
    pl.atomic_add(o_ref, pl.ds(0, 16), counts)

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.int32), grid=(4,),
                        in_specs=[pl.BlockSpec((b,), lambda i: (i,)), None],
                        input_output_aliases={1: 0}, compiler_params=PARALLEL, **call)


def _segment_inputs():
  ids = np.sort(np.asarray(random_array((256,), jnp.int32, low=0, high=31)))
  return random_array((256,)), jnp.asarray(ids), jnp.zeros((32,), F32)


@bug_case(kind="race", ref="o_ref", inputs=_segment_inputs,
          reference=lambda x, ids, zeros: zeros + jax.ops.segment_sum(x, ids, 32))
def segment_sum_with_plain_scatter(bug, **call):
  """Segment sums by scatter; segments span blocks, so programs update the same sums."""
  b = 64

  def kernel(x_ref, ids_ref, zeros_ref, o_ref):
    del zeros_ref  # aliased to o_ref: the sums start at zero
    ids, x = ids_ref[...], x_ref[...]
    if bug:
      o_ref[ids] += x  # BUG: read-modify-write of sums other programs update
    else:
      pl.atomic_add(o_ref, ids, x)

  spec = pl.BlockSpec((b,), lambda i: (i,))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32,), F32), grid=(4,),
                        in_specs=[spec, spec, None], input_output_aliases={2: 0},
                        compiler_params=PARALLEL, **call)


@bug_case(kind="race", ref="o_ref", inputs=_histogram_inputs,
          reference=lambda v, zeros: zeros + jnp.bincount(v, length=16).astype(jnp.int32))
def histogram_cleared_by_first_program_no_semantics(bug, **call):
  """The atomic histogram again, without dimension_semantics (a GPU-style kernel): the
  first program clears the bins with a plain store that the others' atomics race with.
  Sequential order makes it right here; on a GPU the clear may land after updates."""
  b = 64

  def kernel(v_ref, zeros_ref, o_ref):
    del zeros_ref  # aliased to o_ref: the bins start at zero
    if bug:
      @pl.when(pl.program_id(0) == 0)
      def _():
        o_ref[...] = jnp.zeros_like(o_ref)  # BUG: other programs update the bins at once

    counts = jnp.sum(v_ref[...][:, None] == jnp.arange(16)[None, :], axis=0, dtype=jnp.int32)
    pl.atomic_add(o_ref, pl.ds(0, 16), counts)

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.int32), grid=(4,),
                        in_specs=[pl.BlockSpec((b,), lambda i: (i,)), None],
                        input_output_aliases={1: 0}, **call)

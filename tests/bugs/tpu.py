"""TPU-style kernels: scratch accumulators, `run_scoped` buffers, DMAs and
scalar-prefetched block indices (`pallet.tpu`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import pallet as pl
from pallet import tpu as pltpu
from bugs.corpus import bug_case
from helpers import random_array

F32 = jnp.float32
NO_TRITON_DMA = "DMAs and semaphores run on the XLA backend only"


def _matmul_inputs():
  return random_array((64, 128)), random_array((128, 128))


def _matmul_reference(x, y):
  return jnp.dot(x, y, precision="highest")


def _tpu_matmul(kernel, **call):
  """A (64, 128) @ (128, 128) matmul in (32, 64, 64) blocks with a VMEM accumulator."""
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((64, 128), F32), grid=(2, 2, 2),
      in_specs=[pl.BlockSpec((32, 64), lambda i, j, k: (i, k)),
                pl.BlockSpec((64, 64), lambda i, j, k: (k, j))],
      out_specs=pl.BlockSpec((32, 64), lambda i, j, k: (i, j)),
      scratch_shapes=[pltpu.VMEM((32, 64), F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")), **call)


@bug_case(kind="uninitialized", ref="acc_ref", inputs=_matmul_inputs,
          reference=_matmul_reference, matmul=True)
def scratch_accumulator_never_zeroed(bug, **call):
  """A TPU matmul accumulating in VMEM scratch without zeroing it at k == 0."""
  def kernel(x_ref, y_ref, o_ref, acc_ref):
    k = pl.program_id(2)
    if not bug:
      @pl.when(k == 0)
      def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], precision="highest")  # BUG: garbage

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
      o_ref[...] = acc_ref[...]

  return _tpu_matmul(kernel, **call)


@bug_case(kind="uninitialized", ref="acc_ref", inputs=_matmul_inputs,
          reference=_matmul_reference, matmul=True)
def scratch_accumulator_zeroed_on_wrong_step(bug, **call):
  """The accumulator is zeroed at the last k step instead of the first."""
  def kernel(x_ref, y_ref, o_ref, acc_ref):
    k, nk = pl.program_id(2), pl.num_programs(2)
    dot = jnp.dot(x_ref[...], y_ref[...], precision="highest")

    @pl.when(k == (nk - 1 if bug else 0))
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] = acc_ref[...] + dot  # BUG: at k == 0 it was never written

    @pl.when(k == nk - 1)
    def _():
      o_ref[...] = acc_ref[...]

  return _tpu_matmul(kernel, **call)


@bug_case(kind="race", ref="acc_ref", inputs=_matmul_inputs,
          reference=_matmul_reference, matmul=True)
def scratch_accumulator_zeroed_on_wrong_axis(bug, **call):
  """The accumulator is zeroed when i == 0 (a parallel axis) instead of when k == 0."""
  def kernel(x_ref, y_ref, o_ref, acc_ref):
    i, k = pl.program_id(0), pl.program_id(2)

    @pl.when((i if bug else k) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], precision="highest")  # BUG: i > 0 carries

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
      o_ref[...] = acc_ref[...]

  return _tpu_matmul(kernel, **call)


@bug_case(kind="uninitialized", ref="total_ref", inputs=lambda: (random_array((16, 256)),),
          reference=lambda x: x.reshape(16, 4, 64).sum(1))
def run_scoped_buffer_never_zeroed(bug, **call):
  """Sums column chunks into a `run_scoped` VMEM buffer that starts unzeroed."""
  def kernel(x_ref, o_ref):
    def body(total_ref):
      if not bug:
        total_ref[...] = jnp.zeros_like(total_ref)

      def add_chunk(t, carry):
        total_ref[...] += x_ref[:, pl.ds(t * 64, 64)]  # BUG: first += reads garbage
        return carry

      lax.fori_loop(0, 4, add_chunk, 0)
      o_ref[...] = total_ref[...]

    pl.run_scoped(body, pltpu.VMEM((16, 64), F32))

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 64), F32), **call)


@bug_case(kind="uninitialized", ref="count_ref",
          inputs=lambda: (random_array((128,), jnp.int32, low=-5, high=5),),
          reference=lambda v: jnp.sum(v > 0).astype(jnp.int32).reshape(1))
def smem_counter_never_initialized(bug, **call):
  """Counts positive entries in an SMEM scratch counter that is never set to 0."""
  def kernel(v_ref, o_ref, count_ref):
    if not bug:
      @pl.when(pl.program_id(0) == 0)
      def _():
        count_ref[0] = 0

    count_ref[0] += jnp.sum(v_ref[...] > 0).astype(jnp.int32)  # BUG: starts from garbage

    @pl.when(pl.program_id(0) == pl.num_programs(0) - 1)
    def _():
      o_ref[0] = count_ref[0]

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32), grid=(4,),
                        in_specs=[pl.BlockSpec((32,), lambda i: (i,))],
                        out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
                        scratch_shapes=[pltpu.SMEM((1,), jnp.int32)], **call)


@bug_case(kind="uninitialized", ref="buf", inputs=lambda: (random_array((128, 8)),),
          reference=lambda x: 3.0 * x, triton=NO_TRITON_DMA, triton_runs=False)
def dma_started_but_never_waited(bug, **call):
  """Copies a block from HBM into VMEM and reads it without waiting for the copy."""
  def kernel(x_hbm, o_ref, buf, sem):
    i = pl.program_id(0)
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(i * 32, 32)], buf, sem)
    copy.start()
    if not bug:
      copy.wait()
    o_ref[...] = 3.0 * buf[...]  # BUG: the copy has not landed
    if bug:
      copy.wait()

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128, 8), F32), grid=(4,),
                        in_specs=[pl.BlockSpec(memory_space=pltpu.ANY)],
                        out_specs=pl.BlockSpec((32, 8), lambda i: (i, 0)),
                        scratch_shapes=[pltpu.VMEM((32, 8), F32), pltpu.SemaphoreType.DMA],
                        **call)


@bug_case(kind="race", ref="buf", inputs=lambda: (random_array((128, 8)),),
          reference=lambda x: 2.0 * x, triton=NO_TRITON_DMA, triton_runs=False)
def dma_source_overwritten_before_its_wait(bug, **call):
  """Double-buffered copies out of VMEM: each step fills slot i % 2 and copies it to HBM,
  waiting for the copy of step i - 2 out of the same slot only after refilling it.
  Modeled on vllm-project/tpu-inference's gated-delta recurrent scan (its decode loop
  stores a state slot before waiting for the store DMA of two iterations earlier)."""
  def kernel(x_ref, o_hbm, buf, sems):
    i = pl.program_id(0)
    slot = i % 2

    def copy(step, s):
      return pltpu.make_async_copy(buf.at[s], o_hbm.at[pl.ds(step * 32, 32)], sems.at[s])

    def wait_two_steps_back():
      @pl.when(i >= 2)
      def _():
        copy(i - 2, slot).wait()

    if not bug:
      wait_two_steps_back()
    buf[slot] = 2.0 * x_ref[...]  # BUG: the copy of step i - 2 may still read this slot
    if bug:
      wait_two_steps_back()
    copy(i, slot).start()

    @pl.when(i == pl.num_programs(0) - 1)
    def _():
      copy(i - 1, 1 - slot).wait()
      copy(i, slot).wait()

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128, 8), F32), grid=(4,),
                        in_specs=[pl.BlockSpec((32, 8), lambda i: (i, 0))],
                        out_specs=pl.BlockSpec(memory_space=pltpu.ANY),
                        scratch_shapes=[pltpu.VMEM((2, 32, 8), F32),
                                        pltpu.SemaphoreType.DMA((2,))],
                        compiler_params=pltpu.CompilerParams(
                            dimension_semantics=("arbitrary",)), **call)


def _shifted_windows(x):
  return jnp.concatenate([x[min(i * 32 + 1, 96):][:32] for i in range(4)])


@bug_case(kind="out_of_bounds", ref="x_hbm", inputs=lambda: (random_array((128, 8)),),
          reference=_shifted_windows, triton=NO_TRITON_DMA, triton_runs=False)
def dma_source_window_past_end(bug, **call):
  """Copies 32-row windows shifted by one; the last window passes row 127."""
  def kernel(x_hbm, o_ref, buf):
    i = pl.program_id(0)
    start = i * 32 + 1 if bug else jnp.minimum(i * 32 + 1, 128 - 32)
    pltpu.sync_copy(x_hbm.at[pl.ds(start, 32)], buf)  # BUG: rows 97..128 at i == 3
    o_ref[...] = buf[...]

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128, 8), F32), grid=(4,),
                        in_specs=[pl.BlockSpec(memory_space=pltpu.ANY)],
                        out_specs=pl.BlockSpec((32, 8), lambda i: (i, 0)),
                        scratch_shapes=[pltpu.VMEM((32, 8), F32)], **call)


def _block_ids():
  # One-based ids of 4 selected blocks out of 4 (block 4 always chosen).
  ids = random_array((4,), jnp.int32, low=1, high=4)
  return ids.at[0].set(4)


@bug_case(kind="index_map", ref="x_ref", inputs=lambda: (_block_ids(), random_array((64, 16))),
          reference=lambda ids, x: 2.0 * x.reshape(4, 16, 16)[ids - 1].reshape(64, 16))
def prefetched_block_ids_one_based(bug, **call):
  """Gathers blocks by scalar-prefetched ids that are one-based."""
  def x_map(i, ids_ref):
    return (ids_ref[i] if bug else ids_ref[i] - 1, 0)  # BUG: block 4 of 4

  def kernel(ids_ref, x_ref, o_ref):
    del ids_ref
    o_ref[...] = 2.0 * x_ref[...]

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(4,),
      in_specs=[pl.BlockSpec((16, 16), x_map)],
      out_specs=pl.BlockSpec((16, 16), lambda i, ids_ref: (i, 0)))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 16), F32),
                        grid_spec=grid_spec, **call)

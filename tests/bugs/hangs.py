"""Kernels that never finish: a program waiting for a value only a later program writes
(deadlock), and loops whose condition never turns false (hang)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallet as pl
from pallet import tpu as pltpu
from bugs.corpus import bug_case
from helpers import random_array

F32 = jnp.float32
I32 = jnp.int32
WHOLE = pl.BlockSpec(memory_space=pl.ANY)
# Loops that never finish stop after this many iterations in these cases (the default
# bound, 2**20, would take hours under Triton's interpreter).
SHORT_LOOPS = {"max_loop_iterations": 1 << 8}


def _with_flags(call, n_blocks):
  """The program of x: flags and carries start at zero, only the result comes back."""
  def program(x):
    return call(x, jnp.zeros((n_blocks,), I32), jnp.zeros((n_blocks,), F32))[0]
  return program


@bug_case(kind="deadlock", ref="flags_ref", inputs=lambda: (random_array((256,)),),
          reference=jnp.cumsum)
def look_back_waits_on_the_next_block(bug, **call):
  """A chained (decoupled look-back) prefix sum: each program waits for the previous
  block's published total; the bug looks the wrong way and waits for the next one."""
  b, nb = 32, 8

  def kernel(x_ref, flags_in, carry_in, o_ref, flags_ref, carry_ref):
    del flags_in, carry_in   # aliased: the flags and totals start at zero
    i = pl.program_id(0)
    x = x_ref[...]
    j = i + 1 if bug else i - 1

    def wait_for_block_j():
      lax.while_loop(lambda c: flags_ref[j] == 0, lambda c: c, 0)  # BUG: block i + 1's flag
      return carry_ref[j]

    before = lax.cond(i > 0, wait_for_block_j, lambda: jnp.float32(0))
    o_ref[...] = jnp.cumsum(x) + before
    carry_ref[i] = before + jnp.sum(x)
    flags_ref[i] = 1

  call_ = pl.pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((nb * b,), F32),
                         jax.ShapeDtypeStruct((nb,), I32), jax.ShapeDtypeStruct((nb,), F32)),
      grid=(nb,), in_specs=[pl.BlockSpec((b,), lambda i: (i,)), WHOLE, WHOLE],
      out_specs=(pl.BlockSpec((b,), lambda i: (i,)), WHOLE, WHOLE),
      input_output_aliases={1: 1, 2: 2}, **call)
  return _with_flags(call_, nb)


@bug_case(kind="deadlock", ref="count_ref", inputs=lambda: (random_array((256,)),),
          reference=lambda x: x / jnp.sum(x))
def grid_barrier_waits_for_later_programs(bug, **call):
  """Normalizes by the global sum with a grid-wide spin barrier (every program adds
  one to a counter, then spins until all have): a program waits for programs that
  run after it. Modeled on https://github.com/flagos-ai/FlagTree/issues/1029 (a
  cross-block spin barrier that hangs where not all blocks are resident). The fix
  splits the kernel in two launches."""
  b, nb = 32, 8
  block = pl.BlockSpec((b,), lambda i: (i,))

  def barrier_kernel(x_ref, part_in, count_in, o_ref, part_ref, count_ref):
    del part_in, count_in   # aliased: partial sums and the counter start at zero
    i = pl.program_id(0)
    part_ref[i] = jnp.sum(x_ref[...])
    pl.atomic_add(count_ref, 0, 1)
    lax.while_loop(lambda seen: seen < nb,
                   lambda seen: pl.atomic_add(count_ref, 0, 0), 0)  # BUG: waits for all
    o_ref[...] = x_ref[...] / jnp.sum(part_ref[...])

  def sums_kernel(x_ref, part_ref):
    part_ref[pl.program_id(0)] = jnp.sum(x_ref[...])

  def scale_kernel(x_ref, part_ref, o_ref):
    o_ref[...] = x_ref[...] / jnp.sum(part_ref[...])

  def program(x):
    if bug:
      out = pl.pallas_call(
          barrier_kernel, out_shape=(jax.ShapeDtypeStruct((nb * b,), F32),
                                     jax.ShapeDtypeStruct((nb,), F32),
                                     jax.ShapeDtypeStruct((1,), I32)),
          grid=(nb,), in_specs=[block, WHOLE, WHOLE], out_specs=(block, WHOLE, WHOLE),
          input_output_aliases={1: 1, 2: 2}, **call)
      return out(x, jnp.zeros((nb,), F32), jnp.zeros((1,), I32))[0]
    part = pl.pallas_call(sums_kernel, out_shape=jax.ShapeDtypeStruct((nb,), F32),
                          grid=(nb,), in_specs=[block], out_specs=WHOLE, **call)(x)
    return pl.pallas_call(scale_kernel, out_shape=jax.ShapeDtypeStruct((nb * b,), F32),
                          grid=(nb,), in_specs=[block, WHOLE], out_specs=block,
                          **call)(x, part)

  return program


@bug_case(kind="deadlock", ref="ready", inputs=lambda: (random_array((128,)),),
          reference=lambda x: 2.0 * x, triton="semaphores are TPU-only", triton_runs=False)
def pipeline_step_waits_for_a_later_signal(bug, **call):
  """Steps hand over through a semaphore: each step signals when its block is done and
  waits for the previous step's signal. The bug makes step 0 wait as well, for a
  signal only step 1 gives."""
  def kernel(x_ref, o_ref, ready):
    i = pl.program_id(0)

    @pl.when(i > 0 if not bug else True)
    def _():
      pltpu.semaphore_wait(ready, 1)  # BUG: step 0 waits for step 1's signal

    o_ref[...] = 2.0 * x_ref[...]
    pltpu.semaphore_signal(ready, 1)

  spec = pl.BlockSpec((32,), lambda i: (i,))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), F32), grid=(4,),
                        in_specs=[spec], out_specs=spec,
                        scratch_shapes=[pltpu.SemaphoreType.REGULAR], **call)


def _segments():
  bounds = np.array([0, 13, 40, 41, 70, 100, 128], np.int32)   # lengths not multiples of 8
  return random_array((128,)), jnp.asarray(bounds)


def _segment_sums(x, bounds):
  ids = jnp.searchsorted(bounds[1:], jnp.arange(x.shape[0]), side="right")
  return jax.ops.segment_sum(x, ids, num_segments=bounds.shape[0] - 1)


@bug_case(kind="hang", ref=None, inputs=_segments, reference=_segment_sums,
          params=SHORT_LOOPS)
def ragged_walk_steps_past_its_end(bug, **call):
  """Sums ragged segments 8 elements at a time; the loop runs while `k != end`, and k
  (which steps by 8) jumps over an end that is not a multiple of 8."""
  def kernel(bounds_ref, x_ref, o_ref):
    s = pl.program_id(0)
    start, end = bounds_ref[s], bounds_ref[s + 1]

    def body(c):
      k, total = c
      lanes = k + jnp.arange(8)
      chunk = pl.load(x_ref, pl.ds(k, 8), mask=lanes < end, other=0.0)
      return k + 8, total + jnp.sum(chunk)

    go = (lambda c: c[0] != end) if bug else (lambda c: c[0] < end)
    _, total = lax.while_loop(go, body, (start, jnp.float32(0)))  # BUG: k never equals end
    o_ref[s] = total

  def program(x, bounds):
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(bounds.shape[0] - 1,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)], out_specs=pl.BlockSpec(memory_space=pl.ANY))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((bounds.shape[0] - 1,), F32),
                          grid_spec=grid_spec, **call)(bounds, x)

  return program


@bug_case(kind="hang", ref=None,
          inputs=lambda: (jnp.abs(random_array((64,))) * 10.0 + 0.5,),
          reference=jnp.cbrt)
def bisection_tolerance_below_float_precision(bug, **call):
  """Cube roots by bisection until the bracket is narrower than `tol`: 1e-12 is below
  float32's resolution at these values, so lo and hi stop moving and the loop spins."""
  tol = 1e-12 if bug else 1e-6

  def kernel(x_ref, o_ref):
    x = x_ref[...]

    def body(c):
      lo, hi = c
      mid = 0.5 * (lo + hi)
      above = mid * mid * mid > x
      return jnp.where(above, lo, mid), jnp.where(above, mid, hi)

    start = (jnp.zeros_like(x), jnp.maximum(x, 1.0))
    lo, hi = lax.while_loop(lambda c: jnp.any(c[1] - c[0] > tol), body, start)  # BUG: tol
    o_ref[...] = 0.5 * (lo + hi)

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), **call)

"""In-place aliasing hazards: with `input_output_aliases` the input and the output are
one buffer on a TPU or GPU, and a program reads input elements another program has
already overwritten (or overwrites them before that program reads them). pallet keeps
the input's values, so these give the intended result here by luck."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallet as pl
from bugs.corpus import bug_case
from helpers import random_array

F32 = jnp.float32
WHOLE = pl.BlockSpec(memory_space=pl.ANY)


def _shift_left(x):
  blocks = x.reshape(4, 32)
  return 2.0 * blocks[np.minimum(np.arange(4) + 1, 3)].reshape(-1)


@bug_case(kind="aliasing", ref="x_ref", inputs=lambda: (random_array((128,)),),
          reference=_shift_left)
def in_place_shift_reads_the_next_block(bug, **call):
  """Doubles each block's right neighbour into it, in place: program i reads block
  i + 1, which program i + 1 overwrites (on a GPU it may run first). The fix writes
  a new array."""
  def kernel(x_ref, o_ref):
    o_ref[...] = 2.0 * x_ref[...]  # BUG: block i + 1 of the buffer being overwritten

  aliases = {0: 0} if bug else {}
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), F32), grid=(4,),
                        in_specs=[pl.BlockSpec((32,), lambda i: (jnp.minimum(i + 1, 3),))],
                        out_specs=pl.BlockSpec((32,), lambda i: (i,)),
                        input_output_aliases=aliases, **call)


def _accumulate_inputs():
  return random_array((64,)), random_array((4, 64))


@bug_case(kind="aliasing", ref="acc_in_ref", inputs=_accumulate_inputs,
          reference=lambda acc, updates: acc + jnp.sum(updates, axis=0))
def shared_output_tile_reloaded_from_the_input(bug, **call):
  """Adds a stack of updates into an accumulator in place; the output tile is shared
  by the update axis and every program first copies the input tile into it, so later
  programs reload the original and erase earlier updates (where input and output are
  one buffer, they reload the partial sums). Modeled on
  https://github.com/pytorch/helion/pull/2637 (an in-place output preload run by every
  program sharing the tile). The fix preloads on the first program only."""
  def kernel(acc_in_ref, u_ref, o_ref):
    @pl.when(True if bug else pl.program_id(0) == 0)
    def _():
      o_ref[...] = acc_in_ref[...]  # BUG: every program reloads the tile

    o_ref[...] += u_ref[0]

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(4,),
                        in_specs=[pl.BlockSpec((64,), lambda k: (0,)),
                                  pl.BlockSpec((1, 64), lambda k: (k, 0))],
                        out_specs=pl.BlockSpec((64,), lambda k: (0,)),
                        input_output_aliases={0: 0}, **call)


def _differences(x):
  return x - jnp.concatenate([jnp.zeros(1, F32), x[:-1]])


@bug_case(kind="aliasing", ref="x_ref", inputs=lambda: (random_array((128,)),),
          reference=_differences)
def in_place_difference_reads_a_replaced_element(bug, **call):
  """First differences y[k] = x[k] - x[k - 1] computed in place over the whole buffer,
  one block per program: each program also reads the last element of the previous
  block, which the previous program has already replaced by its difference on a
  shared buffer (pallet keeps the input's value, the intended one). The fix writes a
  new array."""
  b = 32

  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    x = x_ref[pl.ds(i * b, b)]
    pos = i * b - 1 + jnp.arange(b)
    prev = pl.load(x_ref, pl.ds(i * b - 1, b), mask=pos >= 0, other=0.0)  # BUG: lane 0
    o_ref[pl.ds(i * b, b)] = x - prev

  aliases = {0: 0} if bug else {}
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), F32), grid=(4,),
                        in_specs=[WHOLE], out_specs=WHOLE, input_output_aliases=aliases,
                        compiler_params=pl.CompilerParams(dimension_semantics=("arbitrary",)),
                        **call)

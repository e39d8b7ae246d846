"""Reads of memory no one wrote: outputs, and edge-block padding reaching an output."""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallet as pl
from bugs.corpus import bug_case
from helpers import random_array

F32 = jnp.float32


@bug_case(kind="uninitialized", ref="o_ref", inputs=lambda: (random_array((128, 64)),),
          reference=lambda x: jnp.sum(x * x, axis=0))
def reduction_output_never_zeroed(bug, **call):
  """Column sums of squares accumulated into the output without zeroing it first."""
  def kernel(x_ref, o_ref):
    if not bug:
      @pl.when(pl.program_id(1) == 0)
      def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    x = x_ref[...]
    o_ref[...] += jnp.sum(x * x, axis=0)  # BUG: first step adds to garbage

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(2, 4),
                        in_specs=[pl.BlockSpec((32, 32), lambda j, i: (i, j))],
                        out_specs=pl.BlockSpec((32,), lambda j, i: (j,)), **call)


@bug_case(kind="uninitialized", ref="o_ref", inputs=lambda: (random_array((64, 96)),),
          reference=lambda x: jnp.max(x, axis=1))
def running_max_never_initialized(bug, **call):
  """Row maxima over column blocks, folded into the output without a first value."""
  def kernel(x_ref, o_ref):
    if not bug:
      @pl.when(pl.program_id(1) == 0)
      def _():
        o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, o_ref.dtype)

    o_ref[...] = jnp.maximum(o_ref[...], jnp.max(x_ref[...], axis=1))  # BUG: no first value

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32), grid=(2, 3),
                        in_specs=[pl.BlockSpec((32, 32), lambda i, j: (i, j))],
                        out_specs=pl.BlockSpec((32,), lambda i, j: (i,)), **call)


@bug_case(kind="uninitialized", ref="o_ref",
          inputs=lambda: (random_array((256,)), random_array((256,))),
          reference=lambda x, acc: acc + x)
def in_place_update_without_alias(bug, **call):
  """`o += x` meant to update `acc` in place, but the output is not aliased to it."""
  def kernel(x_ref, acc_ref, o_ref):
    del acc_ref  # the output is the same buffer (when aliased)
    o_ref[...] += x_ref[...]  # BUG: without input_output_aliases o_ref starts empty

  spec = pl.BlockSpec((64,), lambda i: (i,))
  aliases = {} if bug else {1: 0}
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((256,), F32), grid=(4,),
                        in_specs=[spec, spec], out_specs=spec,
                        input_output_aliases=aliases, **call)


@bug_case(kind="uninitialized", ref="x_ref", inputs=lambda: (random_array((100, 64)),),
          reference=lambda x: jnp.sum(x, axis=0))
def edge_block_padding_summed(bug, **call):
  """Column sums over 100 rows in blocks of 32: the last block has 28 rows of padding."""
  n, b = 100, 32

  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)

    if bug:
      o_ref[...] += jnp.sum(x_ref[...], axis=0)  # BUG: padding rows reach the sum
    else:
      rows = pl.program_id(0) * b + jnp.arange(b)[:, None]
      o_ref[...] += jnp.sum(jnp.where(rows < n, x_ref[...], 0.0), axis=0)

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64,), F32),
                        grid=(pl.cdiv(n, b),),
                        in_specs=[pl.BlockSpec((b, 64), lambda i: (i, 0))],
                        out_specs=pl.BlockSpec((64,), lambda i: (0,)), **call)


@bug_case(kind="uninitialized", ref="x_ref", inputs=lambda: (random_array((16, 100)),),
          reference=lambda x: jnp.max(x, axis=1, keepdims=True))
def edge_block_padding_in_row_max(bug, **call):
  """Row maxima over 100 columns in blocks of 32, the last block partly padding."""
  n, b = 100, 32

  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, o_ref.dtype)

    if bug:
      block_max = jnp.max(x_ref[...], axis=1, keepdims=True)  # BUG: padding columns
    else:
      cols = pl.program_id(0) * b + jnp.arange(b)[None, :]
      block_max = jnp.max(jnp.where(cols < n, x_ref[...], -jnp.inf), axis=1, keepdims=True)
    o_ref[...] = jnp.maximum(o_ref[...], block_max)

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 1), F32),
                        grid=(pl.cdiv(n, b),),
                        in_specs=[pl.BlockSpec((16, b), lambda j: (0, j))],
                        out_specs=pl.BlockSpec((16, 1), lambda j: (0, 0)), **call)


def _moving_sums(x):
  return jnp.convolve(x, jnp.ones(5, F32), mode="same")


@bug_case(kind="uninitialized", ref="x_ref", inputs=lambda: (random_array((64,)),),
          reference=_moving_sums)
def element_window_padding_assumed_zero(bug, **call):
  """A 5-wide moving sum over pl.Element windows with 2 elements of padding on each
  side: the kernel sums the shifted window as if the padding held zeros, but its
  contents are unspecified (the fix masks the lanes outside the array)."""
  b, halo, n = 16, 2, 64

  def kernel(x_ref, o_ref):
    x = x_ref[...]
    if not bug:
      pos = pl.program_id(0) * b - halo + jnp.arange(b + 2 * halo)
      x = jnp.where((pos >= 0) & (pos < n), x, 0.0)
    o_ref[...] = sum(x[k:k + b] for k in range(2 * halo + 1))  # BUG: padding summed in

  window = pl.BlockSpec((pl.Element(b + 2 * halo, (halo, halo)),), lambda i: (i * b,))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), F32), grid=(n // b,),
                        in_specs=[window], out_specs=pl.BlockSpec((b,), lambda i: (i,)),
                        **call)

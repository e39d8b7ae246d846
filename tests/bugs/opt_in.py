"""Bugs only the opt-in checks see: NaN/Inf produced, int32 overflow in index
arithmetic, output elements never written, a failed `pl.debug_check`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallet as pl
from bugs.corpus import bug_case
from helpers import random_array

F32 = jnp.float32


def _logits():
  return (100.0 * random_array((16, 128)),)


@bug_case(kind="nan", ref=None, inputs=_logits,
          reference=lambda x: jax.nn.softmax(x, axis=1))
def softmax_without_max_subtraction(bug, **call):
  """Softmax of large logits without subtracting the row maximum: exp overflows."""
  def kernel(x_ref, o_ref):
    x = x_ref[...]
    if not bug:
      x = x - jnp.max(x, axis=1, keepdims=True)
    o_ref[...] = jnp.exp(x) / jnp.sum(jnp.exp(x), axis=1, keepdims=True)  # BUG: inf / inf

  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 128), F32), grid=(2,),
                        in_specs=[spec], out_specs=spec, **call)


@bug_case(kind="nan", ref=None, inputs=_logits,
          reference=lambda x: jax.nn.log_softmax(x, axis=1))
def log_softmax_as_log_of_softmax(bug, **call):
  """log(softmax(x)): probabilities underflow to 0 and their log is -inf."""
  def kernel(x_ref, o_ref):
    x = x_ref[...]
    shifted = x - jnp.max(x, axis=1, keepdims=True)
    total = jnp.sum(jnp.exp(shifted), axis=1, keepdims=True)
    if bug:
      o_ref[...] = jnp.log(jnp.exp(shifted) / total)  # BUG: log(0) = -inf
    else:
      o_ref[...] = shifted - jnp.log(total)

  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 128), F32), grid=(2,),
                        in_specs=[spec], out_specs=spec, **call)


N_SQUARES = 65536


def _squares_reference(x):
  k = jnp.arange(N_SQUARES, dtype=jnp.uint32)
  return x[((k * k) % N_SQUARES).astype(jnp.int32)]


@bug_case(kind="overflow", ref=None, inputs=lambda: (random_array((N_SQUARES,)),),
          reference=_squares_reference)
def squared_index_overflows_int32(bug, **call):
  """Gathers x[k * k mod n]; k * k overflows int32 for k > 46340."""
  n = N_SQUARES

  def kernel(x_ref, o_ref):
    k = jnp.arange(n, dtype=jnp.int32 if bug else jnp.uint32)
    o_ref[...] = x_ref[((k * k) % n).astype(jnp.int32)]  # BUG: k * k wraps negative

  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), F32), **call)


@bug_case(kind="unwritten", ref="o_ref", inputs=lambda: (random_array((32, 128)),),
          reference=lambda x: jnp.concatenate([jnp.abs(x[:, :64]), -jnp.abs(x[:, 64:])], 1))
def output_half_written(bug, **call):
  """Writes |x| into the left half and forgets the right half."""
  def kernel(x_ref, o_ref):  # BUG: the right half of o_ref is never written
    o_ref[:, :64] = jnp.abs(x_ref[:, :64])
    if not bug:
      o_ref[:, 64:] = -jnp.abs(x_ref[:, 64:])

  spec = pl.BlockSpec((16, 128), lambda i: (i, 0))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32, 128), F32), grid=(2,),
                        in_specs=[spec], out_specs=spec, **call)


@bug_case(kind="unwritten", ref="o_ref", inputs=lambda: (random_array((100,)),),
          reference=lambda x: x * x)
def grid_rounds_down(bug, **call):
  """100 elements in blocks of 32 with grid n // b: the last 4 are never written."""
  n, b = 100, 32

  def kernel(x_ref, o_ref):  # BUG: with grid n // b, elements 96..99 of o_ref
    o_ref[...] = x_ref[...] * x_ref[...]

  spec = pl.BlockSpec((b,), lambda i: (i,))
  grid = (n // b,) if bug else (pl.cdiv(n, b),)
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), F32), grid=grid,
                        in_specs=[spec], out_specs=spec, **call)


@bug_case(kind="debug_check", ref=None, inputs=lambda: (random_array((64,)),),
          reference=lambda x: jnp.convolve(x, jnp.ones(9, F32), mode="same"))
def window_start_checked_negative(bug, **call):
  """A 9-wide moving sum reading a pre-padded input; the bug forgets the padding."""
  n, b, halo = 64, 16, 4

  def kernel(xp_ref, o_ref):
    i = pl.program_id(0)
    start = i * b - halo if bug else i * b
    pl.debug_check(start >= 0, "window start must be non-negative")  # BUG
    window = xp_ref[pl.ds(jnp.maximum(start, 0), b + 2 * halo)]
    o_ref[...] = sum(window[k:k + b] for k in range(2 * halo + 1))

  def program(x):
    xp = jnp.pad(x, (halo, halo))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), F32), grid=(n // b,),
                          out_specs=pl.BlockSpec((b,), lambda i: (i,)), **call)(xp)

  return program

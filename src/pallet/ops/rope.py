"""Rotary position embedding (RoPE), "rotate half" layout (GPT-NeoX, Llama).

For x (batch, seq, heads, head_dim) with halves x1 = x[..., :d/2], x2 = x[..., d/2:],
angle a = position * theta^(-2i/d) (i < d/2):
  out = concat(x1 cos a - x2 sin a, x2 cos a + x1 sin a).
The VJP is the inverse rotation (the same kernel with sin negated). One kernel per
(batch, sequence block); angles are computed in the kernel from the positions, so no
(seq, head_dim) tables are read.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallet as pl
from pallet.ops import launch_table
from pallet.ops._common import F32, cdiv, check_block, check_float, fail
from pallet.core.helpers import next_power_of_2

__all__ = ["rotary_embedding", "rotary_embedding_reference"]


def _inverse_frequencies(head_dim: int, theta: float) -> jax.Array:
  half = head_dim // 2
  return (1.0 / (theta ** (jnp.arange(half, dtype=F32) * 2.0 / head_dim))).astype(F32)


def rotary_embedding_reference(x: jax.Array, positions: jax.Array | None = None, *,
                               theta: float = 10000.0) -> jax.Array:
  """jax.numpy RoPE of x (batch, seq, heads, head_dim) at positions (batch, seq)."""
  batch, seq, _, d = x.shape
  positions = _positions(positions, batch, seq)
  angles = positions.astype(F32)[:, :, None] * _inverse_frequencies(d, theta)
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  xf = x.astype(F32)
  x1, x2 = xf[..., :d // 2], xf[..., d // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _positions(positions, batch, seq):
  if positions is None:
    return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  return jnp.broadcast_to(positions, (batch, seq))


def _kernel(sign: float, one_store: bool):
  """one_store: write the block at once as x * cos + (-x2, x1) * sin, the swapped
  halves one concatenation, a form XLA:CPU fuses into one vectorized pass over memory
  (two half-width stores cost it a concatenation of its own; zero-padded halves
  summed, or a reverse, make its loop scalar: issue 26); a Triton program stores
  each half."""
  def kernel(pos_ref, freq_ref, x_ref, o_ref):
    half = freq_ref.shape[0]
    angles = pos_ref[...].astype(F32)[:, None] * freq_ref[...][None, :]   # (block, half)
    cos, sin = jnp.cos(angles)[:, None, :], sign * jnp.sin(angles)[:, None, :]
    if one_store:
      rows, heads, d = x_ref.shape
      x = x_ref[...].astype(F32).reshape(rows, heads, 2, half)
      swapped = jnp.concatenate([-x[:, :, 1:], x[:, :, :1]], axis=2)
      y = x * cos[:, :, None, :] + swapped * sin[:, :, None, :]
      o_ref[...] = y.reshape(rows, heads, d).astype(o_ref.dtype)
      return
    x1 = x_ref[:, :, :half].astype(F32)
    x2 = x_ref[:, :, half:].astype(F32)
    o_ref[:, :, :half] = (x1 * cos - x2 * sin).astype(o_ref.dtype)
    o_ref[:, :, half:] = (x2 * cos + x1 * sin).astype(o_ref.dtype)
  return kernel


def _rotate(x, positions, freqs, sign, plan):
  block_seq, params, one_store = plan
  batch, seq, heads, d = x.shape
  spec = pl.BlockSpec((None, block_seq, heads, d), lambda b, s: (b, s, 0, 0))
  return pl.pallas_call(
      _kernel(sign, one_store), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(batch, cdiv(seq, block_seq)),
      in_specs=[pl.BlockSpec((None, block_seq), lambda b, s: (b, s)),
                pl.BlockSpec((d // 2,), lambda b, s: (0,)), spec],
      out_specs=spec, name="rope_fwd" if sign > 0 else "rope_bwd",
      compiler_params=params)(positions, freqs, x)


# plan: (block_seq, compiler params, one_store: the CPU's form of the kernel)
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rope(x, positions, freqs, plan):
  return _rotate(x, positions, freqs, 1.0, plan)


def _rope_fwd(x, positions, freqs, plan):
  return _rotate(x, positions, freqs, 1.0, plan), (positions, freqs)


def _rope_bwd(plan, saved, dy):
  positions, freqs = saved
  return _rotate(dy, positions, freqs, -1.0, plan), None, None


_rope.defvjp(_rope_fwd, _rope_bwd)


def rotary_embedding(x: jax.Array, positions: jax.Array | None = None, *,
                     theta: float = 10000.0, block_seq: int | None = None) -> jax.Array:
  """RoPE of x (batch, seq, heads, head_dim), "rotate half" layout.

  `positions`: int (batch, seq) or (seq,), default 0..seq-1. `block_seq` sequence
  positions per grid step (default: the whole sequence on the CPU; on a GPU a power of
  two fitting the launch table's `elements` (~4K) with all heads).
  Differentiable in x.
  """
  op = "rotary_embedding"
  check_float(op, "x", x)
  if x.ndim != 4 or x.shape[-1] % 2:
    raise fail(op, f"x must be (batch, seq, heads, head_dim) with an even head_dim, got "
                   f"shape {x.shape}")
  batch, seq, heads, d = x.shape
  if positions is not None:
    if not jnp.issubdtype(positions.dtype, jnp.integer):
      raise fail(op, f"positions must be integers, got {positions.dtype}")
    if positions.shape not in ((seq,), (batch, seq)):
      raise fail(op, f"positions has shape {positions.shape}, expected ({seq},) or "
                     f"({batch}, {seq})")
  launch = launch_table.lookup(op, width=heads * d, itemsize=jnp.dtype(x.dtype).itemsize)
  params = launch.compiler_params("fwd", explicit=block_seq is not None)
  if block_seq is None and not launch.on_gpu:
    block_seq = seq  # XLA fuses the whole pass; smaller blocks only add layout temporaries
  if block_seq is None:
    block_seq = max(1, min(64, launch.get("fwd", "elements") // next_power_of_2(heads * d)))
  check_block(op, "block_seq", block_seq)
  pos = _positions(positions, batch, seq).astype(jnp.int32)
  return _rope(x, pos, _inverse_frequencies(d, theta), (block_seq, params, not launch.on_gpu))

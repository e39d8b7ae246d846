"""Shared plumbing of pallet.ops: argument checks, row views, block-size defaults.

Errors raised here are `PalletError`s naming the op and the offending argument, so a
wrong call reads as a message about the user's arrays, never a deep JAX traceback.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pallet.errors import PalletError
from pallet.core.helpers import next_power_of_2

F32 = jnp.float32


def fail(op: str, message: str) -> PalletError:
  """The error an op raises for arguments that do not fit together."""
  return PalletError(f"pallet.ops.{op}: {message}")


def check_float(op: str, name: str, x: Any) -> None:
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    raise fail(op, f"{name} must be a floating-point array, got "
                   f"{getattr(x, 'dtype', type(x).__name__)}")


def check_shape(op: str, name: str, x: Any, shape: tuple[int, ...]) -> None:
  if tuple(x.shape) != tuple(shape):
    raise fail(op, f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def check_block(op: str, name: str, value: int) -> None:
  if not isinstance(value, int) or value < 1:
    raise fail(op, f"{name} must be a positive int, got {value!r}")


def rows_per_block(width: int, total_rows: int | None = None, budget: int = 4096,
                   cap: int = 64) -> int:
  """A power-of-two row count whose (rows, width) block holds about `budget` elements
  (what one Triton program keeps in registers without spilling); down to an eighth
  of that to divide `total_rows`, since ragged blocks need masks."""
  rows = max(1, min(cap, budget // next_power_of_2(max(1, width))))
  if total_rows:
    for smaller in (rows, rows // 2, rows // 4, rows // 8):
      if smaller >= 1 and total_rows % smaller == 0:
        return smaller
  return rows


def row_plan(op: str, launch: Any, width: int, total_rows: int,
             block_rows: int | None) -> tuple[int, Any, Any]:
  """(block_rows, forward compiler params, backward compiler params) of a row-wise op
  from its launch table entry ("fwd": elements per step, num_warps, num_stages; "bwd":
  num_warps, num_stages), or from `block_rows` the caller chose."""
  explicit = block_rows is not None
  if block_rows is None:
    block_rows = rows_per_block(width, total_rows, budget=launch.get("fwd", "elements", 4096))
  check_block(op, "block_rows", block_rows)
  return (block_rows, launch.compiler_params("fwd", explicit=explicit),
          launch.compiler_params("bwd", explicit=explicit))


def as_rows(x: jax.Array) -> jax.Array:
  """x viewed as (rows, last dimension)."""
  return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def row_mask(block_rows: int, total_rows: int, step: Any) -> jax.Array:
  """(block_rows, 1) bool: which rows of grid step `step`'s block are inside the array."""
  rows = step * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
  return rows < total_rows


def target_backend() -> str:
  """The backend a pallas_call made here would run on ("xla" or "triton"): some block
  sizes differ per backend (a GPU program's registers versus XLA's whole arrays)."""
  from pallet.backends import resolve
  return resolve(None, False)[0]


def online_softmax_start(rows: int, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The empty (running max, running sum, accumulator) of an online softmax over
  key blocks, for `rows` queries and value width `width`."""
  return (jnp.full((rows,), -jnp.inf, F32), jnp.zeros((rows,), F32),
          jnp.zeros((rows, width), F32))


def online_softmax_step(carry: tuple[jax.Array, jax.Array, jax.Array], scores: jax.Array,
                        values: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One key block of an online softmax (flash attention's inner step): rescale what
  the earlier blocks summed to the new running max, add this block's exp(scores)
  and exp(scores) @ values. Masked scores are -inf; a row whose scores are all -inf
  so far keeps sum 0 (its max stays -inf, rescaled against 0, never NaN)."""
  m, l, acc = carry
  m_new = jnp.maximum(m, jnp.max(scores, axis=1))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  p = jnp.exp(scores - m_safe[:, None])
  alpha = jnp.exp(m - m_safe)
  acc = acc * alpha[:, None] + jnp.dot(p.astype(values.dtype), values,
                                       preferred_element_type=F32)
  return m_new, l * alpha + jnp.sum(p, axis=1), acc

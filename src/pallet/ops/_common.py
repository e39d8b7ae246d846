"""Shared plumbing of pallet.ops: argument checks, row views, block-size defaults.

Errors raised here are `PalletError`s naming the op and the offending argument, so a
wrong call reads as a message about the user's arrays, never a deep JAX traceback.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pallet.grid_mapping import PalletError
from pallet.helpers import next_power_of_2

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

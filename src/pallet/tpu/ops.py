"""TPU vector operations (`pltpu.roll`, `bitcast`, `repeat`, `einshape`, ...) as plain JAX.

On a TPU these lower to special vector instructions; their *values* are ordinary
array functions, which is all a CPU needs. Each one is written with jax.numpy and
lax, so every pallet backend traces it like any other kernel arithmetic.
Profiling and scheduling hints (`trace_value`, `annotate`, `touch`, `delay`) have
no effect on a value and are accepted and ignored.
"""
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallet.tpu.bits import bit_width
from pallet.errors import PalletError


def roll(x: jax.Array, shift: Any, axis: int, *, stride: int | None = None,
         stride_axis: int | None = None) -> jax.Array:
  """`jnp.roll(x, shift, axis)`; with `stride`, slice `i` along `stride_axis` is
  rolled by `shift + i * stride` (TPU's strided rotate). `shift` may be traced."""
  if isinstance(shift, (int, np.integer)) and shift < 0:
    raise PalletError(f"pltpu.roll: shift must be non-negative, got {shift}")
  if not 0 <= axis < x.ndim:
    raise PalletError(f"pltpu.roll: axis {axis} is out of range for rank {x.ndim} "
                      f"(TPU's roll takes a non-negative axis)")
  if (stride is None) != (stride_axis is None):
    raise PalletError("pltpu.roll: give both stride and stride_axis, or neither")
  if stride is None:
    return _roll(x, shift, axis)
  if stride < 0 or not 0 <= stride_axis < x.ndim or stride_axis == axis:
    raise PalletError(f"pltpu.roll: stride {stride} must be non-negative and "
                      f"stride_axis {stride_axis} a different axis of rank {x.ndim}")
  pieces = [_roll(piece, shift + i * stride, axis)
            for i, piece in enumerate(jnp.split(x, x.shape[stride_axis], stride_axis))]
  return jnp.concatenate(pieces, stride_axis)


def _roll(x: jax.Array, shift: Any, axis: int) -> jax.Array:
  n = x.shape[axis]
  if n == 0:
    return x
  shift = jnp.asarray(shift, jnp.int32) % n
  doubled = jnp.concatenate([x, x], axis)
  return lax.dynamic_slice_in_dim(doubled, n - shift, n, axis)


def bitcast(x: jax.Array, ty: Any, dim: int = -2) -> jax.Array:
  """Reinterprets the bits of `x` as dtype `ty`, keeping the rank.

  Dimension `dim` (the second-minor one by default, as on TPU, or the minor one)
  grows or shrinks by the ratio of bit widths: consecutive elements along it are
  packed into one wider element, lowest bits first (like `ndarray.view`).
  """
  ty = jnp.dtype(ty)
  if dim == -2 and x.ndim < 2:
    raise PalletError("pltpu.bitcast: a 1-D array has no second-minor dimension; "
                      "pass dim=-1")
  axis = dim % x.ndim if -x.ndim <= dim < x.ndim else None
  if axis is None or axis < x.ndim - 2:
    raise PalletError(f"pltpu.bitcast: dim {dim} must be the second-minor or the "
                      f"minor dimension of a rank-{x.ndim} array")
  src_bits, dst_bits = _bits(x.dtype), _bits(ty)
  if x.shape[axis] * src_bits % dst_bits:
    raise PalletError(f"pltpu.bitcast: dimension {axis} of size {x.shape[axis]} "
                      f"({x.dtype}) cannot be repacked as {ty}")
  moved = jnp.moveaxis(x, axis, -1)
  if src_bits == dst_bits:
    out = lax.bitcast_convert_type(moved, ty)
  elif src_bits > dst_bits:   # each element splits into several narrower ones
    out = lax.bitcast_convert_type(moved, ty)
    out = out.reshape(*moved.shape[:-1], -1)
  else:                       # several elements merge into one wider one
    ratio = dst_bits // src_bits
    grouped = moved.reshape(*moved.shape[:-1], moved.shape[-1] // ratio, ratio)
    out = lax.bitcast_convert_type(grouped, ty)
  return jnp.moveaxis(out, -1, axis)


def _bits(dtype: Any) -> int:
  if jnp.dtype(dtype) == jnp.bool_:
    raise PalletError("pltpu.bitcast: bool has no bit layout to reinterpret")
  return bit_width(dtype)


def repeat(x: jax.Array, repeats: int, axis: int) -> jax.Array:
  """Concatenates `repeats` copies of `x` along `axis` (a tile, not jnp.repeat)."""
  axis = axis % x.ndim
  return jnp.tile(x, [repeats if i == axis else 1 for i in range(x.ndim)])


# ------------------------------------------------------------------ einshape
_TERM = re.compile(r"\([a-zA-Z]*\)|[a-zA-Z]")


def _parse_side(side: str, equation: str) -> list[list[str]]:
  side = side.replace(" ", "")
  groups = _TERM.findall(side)
  if "".join(groups) != side:
    raise PalletError(f"einshape '{equation}': '{side}' must be single-letter dimension "
                      f"names, optionally grouped in parentheses")
  return [list(g.strip("()")) for g in groups]


def einshape(equation: str, x: jax.Array, assert_is_tile_preserving: bool = False,
             **sizes: int) -> jax.Array:
  """Reshape + transpose described by an einshape equation, e.g. "m(nk)->mnk" with
  `n=4`: parentheses on the left split a dimension, on the right merge dimensions.
  (`assert_is_tile_preserving` is about TPU register layout; there is none here.)"""
  del assert_is_tile_preserving
  if equation.count("->") != 1:
    raise PalletError(f"einshape '{equation}': expected one '->'")
  lhs_text, rhs_text = equation.split("->")
  lhs, rhs = _parse_side(lhs_text, equation), _parse_side(rhs_text, equation)
  names_in = [n for g in lhs for n in g]
  names_out = [n for g in rhs for n in g]
  if len(set(names_in)) != len(names_in) or sorted(names_in) != sorted(names_out):
    raise PalletError(f"einshape '{equation}': each name must appear once on each side")
  if len(lhs) != x.ndim:
    raise PalletError(f"einshape '{equation}': the left side has {len(lhs)} dimensions "
                      f"but the array has shape {x.shape}")
  dims = dict(sizes)
  for group, size in zip(lhs, x.shape):
    unknown = [n for n in group if n not in dims]
    known = int(np.prod([dims[n] for n in group if n in dims]))
    if len(unknown) > 1:
      raise PalletError(f"einshape '{equation}': give the sizes of all but one of "
                        f"{''.join(group)} as keywords")
    if unknown:
      if size % known:
        raise PalletError(f"einshape '{equation}': {size} does not split by {known}")
      dims[unknown[0]] = size // known
    elif known != size:
      raise PalletError(f"einshape '{equation}': sizes of ({''.join(group)}) multiply "
                        f"to {known}, not {size}")
  split = x.reshape([dims[n] for n in names_in])
  moved = jnp.transpose(split, [names_in.index(n) for n in names_out])
  return moved.reshape([int(np.prod([dims[n] for n in g])) for g in rhs])


# ------------------------------------------------------------------ rounding
def stochastic_round(x: jax.Array, random_bits: jax.Array, *, target_dtype: Any) -> jax.Array:
  """Rounds float32 `x` to bfloat16 up or down at random: the 16 discarded mantissa
  bits are compared with the low 16 of `random_bits` (uint32), so a value rounds
  away from zero with probability equal to its distance ratio."""
  if jnp.dtype(x.dtype) != jnp.float32 or jnp.dtype(target_dtype) != jnp.bfloat16:
    raise PalletError(f"pltpu.stochastic_round: pallet rounds float32 to bfloat16, got "
                      f"{x.dtype} -> {jnp.dtype(target_dtype)}")
  if jnp.dtype(random_bits.dtype) != jnp.uint32:
    raise PalletError(f"pltpu.stochastic_round: random_bits must be uint32, got "
                      f"{random_bits.dtype}")
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  up = (random_bits & jnp.uint32(0xFFFF)) < (bits & jnp.uint32(0xFFFF))
  kept = (bits & jnp.uint32(0xFFFF0000)) + jnp.where(up, jnp.uint32(0x10000), jnp.uint32(0))
  rounded = jnp.where(jnp.isfinite(x), lax.bitcast_convert_type(kept, jnp.float32), x)
  return rounded.astype(jnp.bfloat16)


# ------------------------------------------------------------------ hints (no value)
def trace_value(label: str, value: Any) -> None:
  """Sends a scalar to the TPU profiler's trace; there is no such trace here."""
  del label, value


def annotate(ref: Any, **assumptions: bool) -> Any:
  """Memory-access assumptions for the TPU scheduler; the ref itself is unchanged."""
  del assumptions
  return ref


def touch(ref: Any) -> None:
  """A fake read/write dependency that orders TPU instructions; pallet keeps program order."""
  del ref


def with_memory_space_constraint(x: jax.Array, memory_space: Any) -> jax.Array:
  """Asks XLA to place a pallas_call operand in a TPU memory; the value is unchanged."""
  del memory_space
  return x


def delay(nanos: Any) -> None:
  """`pl.delay`: sleeps for `nanos` nanoseconds on a device; meaningless for the value computed."""
  del nanos

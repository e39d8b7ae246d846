"""Bit packing helpers of `pltpu`: several narrow values in one wider word.

`pack_elementwise` / `unpack_elementwise` interleave values of a narrow dtype into
the bits of a wider one (the first value in the lowest bits); `join_bits` /
`split_bits` place 2- and 4-bit fields in a byte. All are plain shifts, masks
and bitcasts, so they run inside kernels on every backend that has those.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax


def bit_width(dtype: Any) -> int:
  """Bitwidth of a dtype, sub-byte ones (int4, uint2, float4_e2m1fn) included."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.finfo(dtype).bits
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.iinfo(dtype).bits
  return dtype.itemsize * 8


def _uint(bits: int) -> Any:
  return jnp.dtype(f"uint{bits}")


def _packing_factor(unpacked_dtype: Any, packed_dtype: Any, api: str) -> int:
  wide, narrow = bit_width(unpacked_dtype), bit_width(packed_dtype)
  if wide % narrow:
    raise ValueError(f"{api}: the unpacked bitwidth ({wide}, {jnp.dtype(unpacked_dtype)}) "
                     f"must be a multiple of the packed bitwidth ({narrow}, "
                     f"{jnp.dtype(packed_dtype)})")
  return wide // narrow


def _bfloat16_bits(x: jax.Array) -> jax.Array:
  """The bfloat16 encoding (rounded to nearest even) of float32 `x`, as uint32.

  Computed on the float32 bits, so that no bfloat16 value is needed (backends
  that hold bfloat16 in float32 registers cannot bitcast it)."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  odd = lax.shift_right_logical(bits, jnp.uint32(16)) & jnp.uint32(1)
  rounded = lax.shift_right_logical(bits + jnp.uint32(0x7FFF) + odd, jnp.uint32(16))
  sign = lax.shift_right_logical(bits, jnp.uint32(16)) & jnp.uint32(0x8000)
  return jnp.where(jnp.isnan(x), sign | jnp.uint32(0x7FC0), rounded)


def _low_bits(x: jax.Array, packed_dtype: Any, word: Any) -> jax.Array:
  """The `packed_dtype` encoding of x (converted: rounded for floats, truncated for
  integers) in the low bits of an unsigned `word`."""
  narrow = bit_width(packed_dtype)
  if jnp.issubdtype(packed_dtype, jnp.floating):
    if x.dtype == jnp.float32 and packed_dtype == jnp.bfloat16:
      return _bfloat16_bits(x).astype(word)
    encoded = lax.bitcast_convert_type(x.astype(packed_dtype), _uint(narrow))
    return encoded.astype(word)
  mask = (1 << narrow) - 1
  return lax.convert_element_type(x, word) & jnp.asarray(mask, word)


def pack_elementwise(xs: Sequence[jax.Array], *, packed_dtype: Any) -> jax.Array:
  """Packs `xs[k]` into bits `[k*b, (k+1)*b)` of each output word (b = packed bitwidth).

  `xs` share shape and dtype; there are as many as fit (e.g. two float32 into one
  word of two bfloat16, four int32 into int8 fields). Floats are rounded to
  `packed_dtype`, integers truncated to its width. The result is the unsigned
  integer of the inputs' width.
  """
  xs = [jnp.asarray(x) for x in xs]
  if not xs:
    raise ValueError("pltpu.pack_elementwise: at least one array is required")
  first = xs[0]
  if any(x.shape != first.shape or x.dtype != first.dtype for x in xs):
    raise ValueError(f"pltpu.pack_elementwise: all arrays must share shape and dtype, "
                     f"got {[f'{x.dtype}{list(x.shape)}' for x in xs]}")
  packed_dtype = jnp.dtype(packed_dtype)
  float_pair = first.dtype == jnp.float32 and packed_dtype == jnp.bfloat16
  int_pair = (jnp.issubdtype(first.dtype, jnp.integer)
              and jnp.issubdtype(packed_dtype, jnp.integer))
  if not (float_pair or int_pair):
    raise ValueError(f"pltpu.pack_elementwise: only float32 -> bfloat16 and integer -> "
                     f"integer packing are supported, got {first.dtype} -> {packed_dtype}")
  factor = _packing_factor(first.dtype, packed_dtype, "pltpu.pack_elementwise")
  if len(xs) != factor:
    raise ValueError(f"pltpu.pack_elementwise: {first.dtype} packs {factor} values of "
                     f"{packed_dtype}, got {len(xs)} arrays")
  word = _uint(bit_width(first.dtype))
  narrow = bit_width(packed_dtype)
  out = jnp.zeros(first.shape, word)
  for k, x in enumerate(xs):
    out = out | lax.shift_left(_low_bits(x, packed_dtype, word),
                               jnp.asarray(k * narrow, word))
  return out


def unpack_elementwise(x: jax.Array, *, index: int, packed_dtype: Any,
                       unpacked_dtype: Any) -> jax.Array:
  """Field `index` of each word of `x` (as `pack_elementwise` lays them out), read as
  `packed_dtype` and converted to `unpacked_dtype` (sign-extended for signed ints)."""
  x = jnp.asarray(x)
  packed_dtype, unpacked_dtype = jnp.dtype(packed_dtype), jnp.dtype(unpacked_dtype)
  wide = bit_width(unpacked_dtype)
  if bit_width(x.dtype) != wide:
    raise ValueError(f"pltpu.unpack_elementwise: x ({x.dtype}) must have the bitwidth of "
                     f"unpacked_dtype ({unpacked_dtype})")
  factor = _packing_factor(unpacked_dtype, packed_dtype, "pltpu.unpack_elementwise")
  if not 0 <= index < factor:
    raise ValueError(f"pltpu.unpack_elementwise: index {index} is out of range for "
                     f"{factor} fields per word")
  word = _uint(wide)
  narrow = bit_width(packed_dtype)
  bits = lax.bitcast_convert_type(x, word) if x.dtype != word else x
  if jnp.issubdtype(packed_dtype, jnp.floating):
    field = lax.shift_right_logical(bits, jnp.asarray(index * narrow, word))
    if packed_dtype == jnp.bfloat16 and unpacked_dtype == jnp.float32:
      # A bfloat16 is the top half of the float32 of the same value.
      top_half = lax.shift_left(field, jnp.uint32(16))
      return lax.bitcast_convert_type(top_half, jnp.float32)
    value = lax.bitcast_convert_type(field.astype(_uint(narrow)), packed_dtype)
    return value.astype(unpacked_dtype)
  # Move the field to the top of the word, then shift it back down: arithmetically
  # (sign-extending) for signed fields, logically for unsigned ones.
  top = lax.shift_left(bits, jnp.asarray(wide - (index + 1) * narrow, word))
  back = jnp.asarray(wide - narrow, word)
  if jnp.issubdtype(packed_dtype, jnp.signedinteger):
    signed = lax.bitcast_convert_type(top, jnp.dtype(f"int{wide}"))
    field = lax.shift_right_arithmetic(signed, back.astype(signed.dtype))
  else:
    field = lax.shift_right_logical(top, back)
  return lax.convert_element_type(field, unpacked_dtype)


def join_bits(*, two_bits: jax.Array | None = None,
              four_bits: jax.Array | None = None) -> jax.Array:
  """An int8 array with `four_bits` in bits [3:0] and `two_bits` in bits [5:4]
  (the rest zero); a lone segment goes in the lowest bits."""
  if two_bits is None and four_bits is None:
    raise ValueError("pltpu.join_bits: give two_bits, four_bits or both")
  if (two_bits is not None and four_bits is not None
      and jnp.shape(two_bits) != jnp.shape(four_bits)):
    raise ValueError(f"pltpu.join_bits: two_bits {jnp.shape(two_bits)} and four_bits "
                     f"{jnp.shape(four_bits)} must have the same shape")
  out = None
  if four_bits is not None:
    if bit_width(four_bits.dtype) != 4:
      raise ValueError(f"pltpu.join_bits: four_bits must be a 4-bit type, got "
                       f"{four_bits.dtype}")
    out = _low_bits(four_bits, jnp.uint4, jnp.uint8)
  if two_bits is not None:
    if bit_width(two_bits.dtype) != 2:
      raise ValueError(f"pltpu.join_bits: two_bits must be a 2-bit type, got "
                       f"{two_bits.dtype}")
    two = _low_bits(two_bits, jnp.uint2, jnp.uint8)
    out = two if out is None else out | lax.shift_left(two, jnp.uint8(4))
  return lax.bitcast_convert_type(out, jnp.int8)


def split_bits(x: jax.Array, bitwidths: tuple[int, ...]) -> tuple[jax.Array, ...]:
  """Consecutive fields of an 8-bit array, lowest bits first, as int4 / int2 arrays
  (e.g. `bitwidths=(4, 2)` gives bits [3:0] as int4 and bits [5:4] as int2)."""
  x = jnp.asarray(x)
  if bit_width(x.dtype) != 8:
    raise ValueError(f"pltpu.split_bits: expected an 8-bit array, got {x.dtype}")
  if sum(bitwidths) > 8:
    raise ValueError(f"pltpu.split_bits: bitwidths {tuple(bitwidths)} exceed 8 bits")
  results, shift = [], 0
  for width in bitwidths:
    if width not in (2, 4):
      raise ValueError(f"pltpu.split_bits: only 2- and 4-bit fields are supported, "
                       f"got {width}")
    results.append(_signed_field(x, shift, width))
    shift += width
  return tuple(results)


def _signed_field(x: jax.Array, shift: int, width: int) -> jax.Array:
  """Bits [shift, shift + width) of the 8-bit `x` as a signed `width`-bit integer."""
  as_byte = lax.bitcast_convert_type(x, jnp.uint8) if x.dtype != jnp.uint8 else x
  top = lax.shift_left(as_byte, jnp.uint8(8 - shift - width))
  signed = lax.shift_right_arithmetic(lax.bitcast_convert_type(top, jnp.int8),
                                      jnp.int8(8 - width))
  return signed.astype(jnp.int4 if width == 4 else jnp.int2)

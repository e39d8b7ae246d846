"""`pltpu.conv`: an N-D convolution inside a kernel, accumulated into an optional `acc`.

The meaning is XLA's general dilated convolution (`lax.conv_general_dilated`),
plus two things the TPU operation adds: `window_reversal` flips the kernel
window along chosen spatial dimensions, and the result is `acc + conv` (in the
accumulator's dtype) when an accumulator is given.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
from jax import lax


def conv(lhs: jax.Array, rhs: jax.Array, acc: jax.Array | None = None, *,
         dimension_numbers: Any,
         window_strides: Sequence[int] | None = None,
         padding: str | Sequence[tuple[int, int]] | None = None,
         lhs_dilation: Sequence[int] | None = None,
         rhs_dilation: Sequence[int] | None = None,
         window_reversal: Sequence[bool] | None = None,
         feature_group_count: int = 1, batch_group_count: int = 1,
         precision: Any = None, preferred_element_type: Any = None) -> jax.Array:
  """Convolution of `lhs` (activations) with `rhs` (kernel), as `pltpu.conv`.

  `dimension_numbers` is a `("NHWC", "HWIO", "NHWC")`-style triple or a
  `lax.ConvDimensionNumbers`; omitted strides, dilations and padding mean 1, 1
  and none. The result has `acc`'s dtype when `acc` is given, else
  `preferred_element_type` or `lhs`'s dtype.
  """
  dnums = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
  num_spatial = len(dnums.lhs_spec) - 2
  if window_reversal is not None:
    if len(window_reversal) != num_spatial:
      raise ValueError(f"pltpu.conv: window_reversal needs one entry per spatial "
                       f"dimension ({num_spatial}), got {tuple(window_reversal)}")
    flipped = [dnums.rhs_spec[2 + d] for d, rev in enumerate(window_reversal) if rev]
    if flipped:
      rhs = lax.rev(rhs, flipped)
  out_dtype = acc.dtype if acc is not None else preferred_element_type
  out = lax.conv_general_dilated(
      lhs, rhs,
      window_strides=(1,) * num_spatial if window_strides is None else tuple(window_strides),
      padding=((0, 0),) * num_spatial if padding is None else padding,
      lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
      dimension_numbers=dnums, feature_group_count=feature_group_count,
      batch_group_count=batch_group_count, precision=precision,
      preferred_element_type=out_dtype)
  if acc is None:
    return out
  if acc.shape != out.shape:
    raise ValueError(f"pltpu.conv: acc has shape {acc.shape} but the convolution gives "
                     f"{out.shape}")
  return acc + out

"""A window of a reshaped array as a window of the array before the reshape.

`ref.reshape(8, 8, 32).at[k][...] = v` writes rows 2k and 2k + 1 of a (16, 128) ref:
one `dynamic_update_slice` of the ref itself, with no reshape of its result (which
XLA:CPU can mis-compile, see ref_views). A window of the reshaped view is such a
rectangle when it is one run of consecutive elements (size 1 in its leading
dimensions, whole in its trailing ones) and that run starts and ends on whole rows of
some dimension j of the original shape without wrapping into the next row of the
dimension before j. Traced starts are allowed where divisibility alone proves this
for every value they may take (they are clamped into the view already).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from jax import lax

_MAX_ELEMENTS = 2 ** 31 - 1   # flat positions are computed in int32


def in_base(base: Sequence[int], view: Sequence[int], starts: Sequence[Any],
            sizes: Sequence[int]) -> tuple[list[Any], list[int]] | None:
  """(starts, sizes) in `base` of the window (`starts`, `sizes`) of `view`, an array
  of `base` reshaped; None where the window is not provably one rectangle of `base`."""
  if math.prod(base) > _MAX_ELEMENTS:
    return None
  partial = [d for d in range(len(view)) if sizes[d] != view[d]]
  d0 = partial[-1] if partial else -1
  if any(sizes[d] != 1 for d in range(d0)):
    return None   # not one run of consecutive elements
  view_strides = _strides(view)
  length = sizes[d0] * view_strides[d0] if d0 >= 0 else math.prod(view)
  static = sum(int(s) * view_strides[d] for d, s in enumerate(starts[:d0 + 1])
               if _is_static(s))
  traced = [d for d, s in enumerate(starts[:d0 + 1]) if not _is_static(s)]
  base_strides = _strides(base)
  for j in reversed(range(len(base))):
    if _fits_rows(j, base, base_strides, view, view_strides, sizes, d0, length, static,
                  traced):
      return _rectangle(j, base, base_strides, view_strides, starts, d0, length)
  return None


def _fits_rows(j: int, base: Sequence[int], base_strides: list[int], view: Sequence[int],
               view_strides: list[int], sizes: Sequence[int], d0: int, length: int,
               static: int, traced: list[int]) -> bool:
  """Whether the run covers whole rows of base dimension j, within one row of j - 1."""
  row, rows_in_j = base_strides[j], base[j]
  if length % row or length // row > rows_in_j or static % row:
    return False
  if any(view_strides[d] % row for d in traced):
    return False
  first = (static // row) % rows_in_j
  reach = 0   # the furthest a traced start of dimension d0 moves the run, in rows
  for d in traced:
    if d < d0 and view_strides[d] % (row * rows_in_j):
      return False   # could move the run by part of a row of dimension j - 1
    if d == d0:
      reach = (view[d0] - sizes[d0]) * view_strides[d0] // row
  return first + reach + length // row <= rows_in_j


def _rectangle(j: int, base: Sequence[int], base_strides: list[int],
               view_strides: list[int], starts: Sequence[Any], d0: int,
               length: int) -> tuple[list[Any], list[int]]:
  flat: Any = 0
  for d, s in enumerate(starts[:d0 + 1]):
    term = int(s) * view_strides[d] if _is_static(s) else lax.mul(
        lax.convert_element_type(s, np.int32), np.int32(view_strides[d]))
    flat = flat + term if _is_static(flat) and _is_static(term) else lax.add(
        lax.convert_element_type(flat, np.int32), lax.convert_element_type(term, np.int32))
  base_starts: list[Any] = []
  for i in range(len(base)):
    if i > j:
      base_starts.append(0)
    elif _is_static(flat):
      base_starts.append((int(flat) // base_strides[i]) % base[i])
    else:
      base_starts.append(lax.rem(lax.div(flat, np.int32(base_strides[i])), np.int32(base[i])))
  sizes = [1] * j + [length // base_strides[j]] + list(base[j + 1:])
  return base_starts, sizes


def _strides(shape: Sequence[int]) -> list[int]:
  return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def _is_static(x: Any) -> bool:
  return isinstance(x, (int, np.integer))

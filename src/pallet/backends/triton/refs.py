"""Refs in generated code: blocks of arrays in GPU memory, or values in registers.

A `MemoryRef` is a block of an array in global memory: a base pointer, the
element offset where the block starts along every array dimension, the array's
strides and extents. Reading `ref[idx]` becomes pointer arithmetic over the
view that `idx` selects, with masks that drop what lies outside the array
(reads are padded with zeros, writes are dropped) or in power-of-two padding.

A `RegisterRef` is a ref that the kernel only ever reads and writes whole; it
lives in a variable of the generated code, carried through loops, and touches
memory only where it is loaded and stored (for a resident output block: once
per program, which is what makes accumulation over a grid axis fast).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from pallet import _internals as internals
from pallet.backends.triton.values import (Value, constant, next_pow2, padded, python_literal,
                                           tl_dtype)


@dataclasses.dataclass
class ArrayDim:
  """One dimension of the array behind a MemoryRef."""
  start: Value | int      # element offset of the block along this dimension
  stride: int             # in elements
  extent: int             # array size along this dimension
  check_low: bool         # block may start before 0 (Element padding)
  check_high: bool        # block may end past the array
  visible: bool           # a dimension the kernel sees (not squeezed)


@dataclasses.dataclass
class MemoryRef:
  name: str
  pointer: str
  dims: list[ArrayDim]
  dtype: np.dtype
  shape: tuple[int, ...]     # what the kernel sees (squeezed dims dropped)

  @property
  def wide(self) -> bool:
    """Whether element offsets into the array can exceed int32."""
    size = 1
    for d in self.dims:
      size *= d.extent
    return size >= 2 ** 31


@dataclasses.dataclass
class RegisterRef:
  name: str
  var: str
  shape: tuple[int, ...]
  dtype: np.dtype

  @property
  def value(self) -> Value:
    return Value(self.var, self.shape, self.dtype)


# ------------------------------------------------------------------ views
@dataclasses.dataclass
class _Axis:
  """Base coordinate = start + stride * (position along view dim `dim`)."""
  dim: int
  start: Any   # int or Value
  stride: int


@dataclasses.dataclass
class _Fixed:
  index: Any   # int or scalar Value


@dataclasses.dataclass
class _Gathered:
  """Base coordinate = an integer tensor over the leading `rank` view dims at `first`."""
  index: Value
  first: int
  size: int    # the extent of the base dimension it indexes


def _affine(gen, start: Any, stride: int, pos: Any) -> Any:
  """start + stride * pos, folding constants (ints or Values)."""
  def num(v):
    if isinstance(v, Value) and v.is_constant:
      return int(v.constant)
    return v
  start, pos = num(start), num(pos)
  if isinstance(start, int) and isinstance(pos, int):
    return start + stride * pos
  scaled = pos if stride == 1 else (
      stride * pos if isinstance(pos, int) else f"{stride} * {_text(pos)}")
  if isinstance(start, int) and start == 0:
    return scaled
  return f"{_text(start)} + {_text(scaled)}"


def _text(v: Any) -> str:
  if isinstance(v, Value):
    return v.expr if not v.is_constant else python_literal(v.constant, v.dtype)
  return str(v)


def resolve_view(gen, base_shape: tuple[int, ...], transforms: list[Any]):
  """(view shape, one coordinate term per base dimension) for ref.at[...] chains."""
  shape = list(base_shape)
  terms: list[Any] = [_Axis(d, 0, 1) for d in range(len(base_shape))]
  for t in transforms:
    if not isinstance(t, internals.NDIndexer):
      gen.fail(f"ref transform {type(t).__name__} (only indexing is supported)")
    shape, terms = _apply_indexer(gen, t, shape, terms)
  return tuple(shape), terms


def _apply_indexer(gen, indexer, shape, terms):
  idx = list(indexer.indices)
  is_int = [not isinstance(i, internals.Slice) for i in idx]
  slices = [i for i in idx if isinstance(i, internals.Slice)]
  int_shape = tuple(indexer.int_indexer_shape)
  int_pos = [d for d, b in enumerate(is_int) if b]
  contiguous = all(b - a == 1 for a, b in zip(int_pos, int_pos[1:]))
  first_int = (0 if not contiguous else
               sum(1 for d in range(int_pos[0]) if not is_int[d])) if int_pos else 0
  new_shape = [s.size for s in slices]
  new_shape[first_int:first_int] = list(int_shape)
  # Where each old view dim goes: ('slice', new dim, start, stride) or ('int', index).
  placement, k = [], 0
  for d, i in enumerate(idx):
    if isinstance(i, internals.Slice):
      nd = k + (len(int_shape) if k >= first_int and int_shape else 0)
      placement.append(("slice", nd, i.start, i.stride))
      k += 1
    else:
      placement.append(("int", i))
  new_terms = []
  for term in terms:
    if isinstance(term, _Fixed):
      new_terms.append(term)
    elif isinstance(term, _Axis):
      p = placement[term.dim]
      if p[0] == "slice":
        _, nd, s, st = p
        new_terms.append(_Axis(nd, _affine(gen, term.start, term.stride, s),
                               term.stride * st))
      else:
        index = _scalarize(gen, p[1], shape[term.dim])
        if isinstance(index, Value) and index.shape:
          if term.start != 0 or term.stride != 1:
            gen.fail("integer-array indexing of a strided or offset ref view")
          new_terms.append(_Gathered(index, first_int, shape[term.dim]))
        else:
          new_terms.append(_Fixed(_affine(gen, term.start, term.stride, index)))
    else:
      identity = all(p[0] == "slice" and not _nonzero(p[2]) and p[3] == 1
                     for p in placement) and all(
                         s.size == n for s, n in zip(slices, shape))
      if not identity:
        gen.fail("indexing a ref view that was itself selected with an integer array")
      new_terms.append(term)
  return new_shape, new_terms


def _in_bounds(gen, index: Value, size: int, writes: bool) -> tuple[Value, str | None]:
  """An integer-array index as JAX reads and writes through one: negative entries count
  from the end; past that, reads clamp into [0, size) and writes are dropped (the mask
  returned; None where `writes` is False: reads, and atomic_cas, which Triton cannot
  mask and so clamps too). A GPU would read or write outside the array."""
  if index.is_constant:   # a splat
    i = int(index.constant)
    i = i + size if i < 0 else i
    if writes and not 0 <= i < size:
      gen.fail(f"a write at index {int(index.constant)} of a dimension of size {size}")
    return constant(min(max(i, 0), size - 1), index.dtype, index.shape), None
  e = index.expr
  wrapped = gen.let("gather_index", f"tl.where({e} < 0, {e} + {size}, {e})",
                    index.shape, index.dtype)
  w = wrapped.expr
  clamped = gen.let("gather_index", f"tl.minimum(tl.maximum({w}, 0), {size - 1})",
                    index.shape, index.dtype)
  return clamped, (f"(({w} >= 0) & ({w} < {size}))" if writes else None)


def _nonzero(v: Any) -> bool:
  if isinstance(v, Value):
    return not (v.is_constant and v.constant == 0)
  return v != 0


def _scalarize(gen, v: Any, size: int) -> Any:
  """A static index as an int (negative ones count from the end), else the Value."""
  if isinstance(v, Value):
    if not (v.is_constant and v.shape == ()):
      return v
    v = v.constant
  if np.ndim(v) == 0:
    i = int(np.asarray(v))
    return i + size if i < 0 else i
  return v


def _arange(n: int, rank: int, dim: int) -> str:
  expr = f"tl.arange(0, {next_pow2(n)})"
  if rank == 1:
    return expr
  return f"{expr}[{', '.join(':' if d == dim else 'None' for d in range(rank))}]"


def _expand_leading(expr: str, index_rank: int, first: int, rank: int) -> str:
  if index_rank == rank:
    return expr
  sel = ["None"] * rank
  for d in range(first, first + index_rank):
    sel[d] = ":"
  return f"{expr}[{', '.join(sel)}]"


def address(gen, ref: MemoryRef, transforms: list[Any], label: str, writes: bool = False):
  """(pointer expression, mask expression or None, view shape) for ref[transforms];
  `writes`: the access can be masked and stores (out-of-range integer-array lanes are
  then masked off)."""
  view_shape, terms = resolve_view(gen, ref.shape, transforms)
  rank = len(view_shape)
  offsets, masks, scalar_masks = [], [], []
  vt = iter(terms)
  for dim in ref.dims:
    coord = next(vt) if dim.visible else _Fixed(0)
    if isinstance(coord, _Fixed):
      c = _text(coord.index)
    elif isinstance(coord, _Axis):
      ar = _arange(view_shape[coord.dim], rank, coord.dim)
      c = _text(_affine(gen, coord.start, coord.stride, ar))
      c = f"({c})" if _compound(c) else c
    else:
      index, dropped = _in_bounds(gen, coord.index, coord.size, writes)
      c = _expand_leading(index.typed, len(index.shape), coord.first, rank)
      if dropped:
        masks.append(_expand_leading(dropped, len(index.shape), coord.first, rank))
    pos = c if (isinstance(dim.start, int) and dim.start == 0) else \
        f"{_text(dim.start)} + {c}" if c != "0" else _text(dim.start)
    static = _static_int(pos)
    if static is not None:
      # A position known now: check it now (Triton masks must be tensors).
      if (dim.check_low and static < 0) or (dim.check_high and static >= dim.extent):
        gen.fail(f"an access at position {static} of a dimension of size {dim.extent}")
    elif dim.check_high or dim.check_low:
      checks = []
      if dim.check_low:
        checks.append(f"({pos} >= 0)")
      if dim.check_high:
        checks.append(f"({pos} < {dim.extent})")
      (scalar_masks if isinstance(coord, _Fixed) else masks).append(" & ".join(checks))
    if pos != "0":
      wrapped = f"({pos})" if _compound(pos) else pos
      if ref.wide:    # 64-bit offsets for arrays of 2**31 elements or more
        wrapped = f"({pos}).to(tl.int64)"
      offsets.append(f"{wrapped} * {dim.stride}" if dim.stride != 1 else wrapped)
  for d, n in enumerate(view_shape):
    if next_pow2(n) != n:
      masks.append(f"({_arange(n, rank, d)} < {n})")
  offset = " + ".join(offsets) if offsets else "0"
  offs_var = gen.let(f"{label}_offsets", offset, view_shape, np.dtype(np.int32)).expr \
      if offsets else "0"
  pointer = f"{ref.pointer} + {offs_var}" if offs_var != "0" else ref.pointer
  if rank and not _covers(terms, rank):
    pointer = f"tl.broadcast_to({pointer}, {list(padded(view_shape))})"
  mask = None
  expr = " & ".join(masks)
  if scalar_masks:
    scalar = " & ".join(scalar_masks)
    if not rank:
      expr = scalar
    else:
      # `tensor & scalar` of booleans comes out as integers in Triton's interpreter;
      # select instead.
      full = expr or f"tl.full({list(padded(view_shape))}, True, tl.int1)"
      expr = f"tl.where({scalar}, {full}, False)"
  if expr:
    mask = gen.let(f"{label}_mask", expr, view_shape, np.dtype(bool)).expr
  return pointer, mask, view_shape


def _static_int(expr: str) -> int | None:
  try:
    return int(expr)
  except ValueError:
    return None


def _compound(expr: str) -> bool:
  """Whether `expr` needs parentheses before being multiplied."""
  return " + " in expr or " - " in expr or " * " in expr


def _covers(terms, rank) -> bool:
  dims = set()
  for t in terms:
    if isinstance(t, _Axis):
      dims.add(t.dim)
    elif isinstance(t, _Gathered):
      dims.update(range(t.first, t.first + len(t.index.shape)))
  return dims == set(range(rank))


def is_whole(transforms: list[Any], shape: tuple[int, ...]) -> bool:
  """Whether `transforms` select the whole ref (`ref[...]`, `ref[:, :]`)."""
  for t in transforms:
    if not isinstance(t, internals.NDIndexer):
      return False
    for i, n in zip(t.indices, shape):
      if not isinstance(i, internals.Slice):
        return False
      if not (isinstance(i.start, (int, np.integer)) and i.start == 0 and i.size == n
              and i.stride == 1):
        return False
  return True


def unflatten_transforms(tree: Any, leaves: list[Any]) -> list[Any]:
  return list(jax.tree_util.tree_unflatten(tree, leaves))


def zeros_like_ref(shape: tuple[int, ...], dtype: np.dtype) -> str:
  return f"tl.zeros({list(padded(shape))}, {tl_dtype(dtype)})"

"""Block shapes and block-index transforms: the currency of block spec propagation.

A `BlockIndexTransform` says, for one value inside a fusion, which block of it a
grid step needs, as a function of the block indices of the fusion's outputs.
Pulling walks a fusion's jaxpr backwards rewriting these transforms; applying them
to the output `BlockSpec`s gives the inputs' `BlockSpec`s.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Sequence

from pallet.core.specs import (BlockSpec, Blocked, BoundedSlice, Buffered, Element, Squeezed,
                               no_block_spec)


def _no_indices(*block_indices: Any) -> None:
  return None


@dataclasses.dataclass
class BlockIndexTransform:
  """A block shape and how its block index follows from the outputs' block indices.

  `block_index_transform(*out_block_indices)` gets one index tuple per output of the
  fusion (None for an output without a block spec) and returns this value's index tuple.
  """
  block_shape: Sequence[Any] | None
  block_index_transform: Callable[..., Any] = _no_indices
  memory_space: Any | None = dataclasses.field(kw_only=True, default=None)
  pipeline_mode: Buffered | None = dataclasses.field(kw_only=True, default=None)

  def replace(self, **changes: Any) -> "BlockIndexTransform":
    return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------ block dimensions
def is_squeezed(dim: Any) -> bool:
  return dim is None or isinstance(dim, Squeezed)


def dim_size(dim: Any) -> int:
  """Elements one block spans along a dimension."""
  if is_squeezed(dim):
    return 1
  if isinstance(dim, (Blocked, Element, BoundedSlice)):
    return dim.block_size
  return int(dim)


def is_plain(dim: Any) -> bool:
  """An ordinary blocked dimension (its index is a block index, not an element offset)."""
  return isinstance(dim, (int, Blocked)) and not isinstance(dim, bool)


def ref_shape(block_shape: Sequence[Any]) -> tuple[int, ...]:
  """The shape the kernel sees: squeezed dimensions dropped."""
  return tuple(dim_size(d) for d in block_shape if not is_squeezed(d))


def ref_axis(block_shape: Sequence[Any], axis: int) -> int:
  """Position of array axis `axis` in the kernel's view of the block."""
  return axis - sum(is_squeezed(d) for d in block_shape[:axis])


def canonical(block_shape: Sequence[Any] | None) -> tuple | None:
  if block_shape is None:
    return None
  out = []
  for d in block_shape:
    if is_squeezed(d):
      out.append(("squeezed",))
    elif is_plain(d):
      out.append(("blocked", dim_size(d)))
    else:
      out.append((type(d).__name__, dataclasses.astuple(d)))
  return tuple(out)


def element_offset(dim: Any, index: Any) -> Any:
  """First element of the block at `index` along a dimension shaped `dim`."""
  if isinstance(dim, (Element, BoundedSlice)) or is_squeezed(dim):
    return index
  return index * dim_size(dim)


def full_block_shape(spec: Any, shape: Sequence[int]) -> tuple:
  """A spec's block shape with `None` (whole array) spelled out."""
  if spec.block_shape is None:
    return tuple(shape)
  return tuple(spec.block_shape)


# ------------------------------------------------------------------ scalar prefetch
class _ScalarPrefetch(threading.local):
  values: tuple | None = None


_scalar_prefetch = _ScalarPrefetch()


@contextlib.contextmanager
def scalar_prefetch_context(values: tuple | None):
  """Makes a kernel's scalar-prefetch operands visible to index transforms."""
  previous = _scalar_prefetch.values
  _scalar_prefetch.values = values
  try:
    yield
  finally:
    _scalar_prefetch.values = previous


def current_scalar_prefetch() -> tuple | None:
  return _scalar_prefetch.values


def make_scalar_prefetch_handler(*path: Any) -> Callable[..., Any]:
  """A getter that picks one fusion's scalar-prefetch group out of a kernel's
  scalar-prefetch operands by indexing along `path` (no path: all of them)."""
  def get(*scalar_prefetch: Any) -> Any:
    out: Any = scalar_prefetch
    for key in path:
      out = out[key]
    return out
  return get


def load_scalar(x: Any) -> Any:
  """A prefetched scalar as a value: refs/arrays of shape (1,) (the TPU layout) or ()."""
  shape = getattr(x, "shape", ())
  return x[0] if len(shape) > 0 else x[...] if hasattr(x, "__getitem__") else x


# ------------------------------------------------------------------ applying transforms
def select_output(i: int) -> Callable[..., Any]:
  def transform(*block_indices: Any) -> Any:
    return block_indices[i]
  return transform


def initial_transforms(out_specs: Sequence[Any]) -> tuple:
  """The identity transform for each output spec (None where it has no block spec)."""
  out = []
  for i, spec in enumerate(out_specs):
    if spec is no_block_spec or spec is None:
      out.append(None)
    else:
      out.append(BlockIndexTransform(spec.block_shape, select_output(i),
                                     memory_space=spec.memory_space,
                                     pipeline_mode=spec.pipeline_mode))
  return tuple(out)


def out_block_indices(out_specs: Sequence[Any], grid_args: Sequence[Any]) -> tuple:
  """Each output spec's block index at grid step `grid_args` (scalar prefetch from context)."""
  prefetch = current_scalar_prefetch() or ()
  return tuple(None if spec is no_block_spec or spec is None
               else (tuple(spec.index_map(*grid_args, *prefetch))
                     if spec.index_map is not None else (0,) * len(spec.block_shape))
               for spec in out_specs)


def apply_transform(out_specs: Sequence[Any], transform: BlockIndexTransform | None,
                    grid_len: int | None) -> Any:
  """The BlockSpec a transform describes, with an index map over the kernel's grid
  (and, when `grid_len` is given, the scalar-prefetch operands after it)."""
  if transform is None:
    return no_block_spec

  def index_map(*args: Any) -> Any:
    if grid_len is None:
      grid_args, prefetch = args, current_scalar_prefetch()
    else:
      grid_args, prefetch = args[:grid_len], tuple(args[grid_len:])
    with scalar_prefetch_context(prefetch):
      return tuple(transform.block_index_transform(*out_block_indices(out_specs, grid_args)))

  return BlockSpec(None if transform.block_shape is None else tuple(transform.block_shape),
                   None if transform.block_shape is None else index_map,
                   memory_space=transform.memory_space,
                   pipeline_mode=transform.pipeline_mode)

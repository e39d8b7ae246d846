"""Resolving BlockSpecs against concrete operands into a `GridMapping`.

A `GridMapping` is the backend-neutral answer to "which block of which array does
grid step (i, j, ...) see": the grid, and for every operand its block dimensions
and its index map traced to a jaxpr. All user-input validation of specs happens
here, so every error can name the kernel, the argument and what was expected.
"""
from __future__ import annotations

import dataclasses
import inspect
import numbers
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallet import specs as specs_lib
from pallet._internals import AbstractRef


class PalletError(ValueError):
  """A kernel was launched with inputs or specs that do not fit together."""


@dataclasses.dataclass(frozen=True)
class BlockDimension:
  """One dimension of a block: 'blocked' (index map gives a block index),
  'squeezed' (size 1, hidden from the kernel) or 'element' (index map gives an
  element offset)."""
  kind: str
  size: int
  padding: tuple[int, int] = (0, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMapping:
  """How one operand (input, output) is cut into blocks over the grid."""
  origin: str                       # e.g. "input 1 ('y_ref')", for messages
  array_shape: tuple[int, ...]
  dtype: Any
  dims: tuple[BlockDimension, ...]
  index_map: Any                    # closed jaxpr: (*grid_ids, *prefetch refs) -> ndim int32
  memory_space: specs_lib.MemorySpace | None
  whole: bool                       # no BlockSpec given: the kernel sees the whole array

  @property
  def block_shape(self) -> tuple[int, ...]:
    return tuple(d.size for d in self.dims)

  @property
  def kernel_shape(self) -> tuple[int, ...]:
    """The block's shape as the kernel sees it (squeezed dimensions dropped)."""
    return tuple(d.size for d in self.dims if d.kind != "squeezed")

  @property
  def kernel_aval(self) -> jax.core.ShapedArray:
    return jax.core.ShapedArray(self.kernel_shape, self.dtype)

  def replace(self, **changes) -> "BlockMapping":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, eq=False)
class GridMapping:
  """The grid and every operand's block mapping: what a backend needs to schedule."""
  grid: tuple[int, ...]
  inputs: tuple[BlockMapping, ...]
  outputs: tuple[BlockMapping, ...]
  scratch_avals: tuple[jax.core.ShapedArray, ...]
  prefetch_avals: tuple[jax.core.ShapedArray, ...]
  dimension_semantics: tuple[str, ...] | None

  @property
  def num_steps(self) -> int:
    return int(np.prod(self.grid, dtype=np.int64)) if self.grid else 1

  def replace(self, **changes) -> "GridMapping":
    return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------
def normalize_grid(grid: Any, kernel_name: str) -> tuple[int, ...]:
  if grid is None:
    return ()
  if isinstance(grid, (numbers.Integral, np.integer)):
    grid = (grid,)
  try:
    grid = tuple(grid)
  except TypeError:
    raise PalletError(f"pallas_call of kernel '{kernel_name}': grid must be an int or a "
                      f"tuple of ints, got {grid!r}") from None
  for g in grid:
    if not isinstance(g, (numbers.Integral, np.integer)) or isinstance(g, bool):
      raise PalletError(f"pallas_call of kernel '{kernel_name}': grid must be static "
                        f"integers, got {grid!r}")
    if g < 0:
      raise PalletError(f"pallas_call of kernel '{kernel_name}': grid sizes must be >= 0, "
                        f"got {grid!r}")
  return tuple(int(g) for g in grid)


def _block_dimension(d: Any, where: str) -> BlockDimension:
  if d is None or isinstance(d, specs_lib.Squeezed):
    return BlockDimension("squeezed", 1)
  if isinstance(d, specs_lib.Element):
    return BlockDimension("element", _static_int(d.block_size, where),
                          tuple(int(p) for p in d.padding))
  if isinstance(d, specs_lib.Blocked):
    return BlockDimension("blocked", _static_int(d.block_size, where))
  return BlockDimension("blocked", _static_int(d, where))


def _static_int(x: Any, where: str) -> int:
  if isinstance(x, bool) or not isinstance(x, (numbers.Integral, np.integer)):
    raise PalletError(f"{where}: block_shape entries must be static ints, None, "
                      f"pl.Squeezed(), pl.Element(n) or pl.Blocked(n); got {x!r} "
                      f"of type {type(x).__name__}")
  if x <= 0:
    raise PalletError(f"{where}: block sizes must be positive, got {x}")
  return int(x)


def positional_arity(fn: Callable) -> int | None:
  """Number of positional parameters fn takes, or None when it takes *args."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return None
  n = 0
  for p in sig.parameters.values():
    if p.kind == p.VAR_POSITIONAL:
      return None
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty:
      n += 1
  return n


def kernel_parameter_names(kernel: Callable) -> list[str] | None:
  """Names of the kernel's required positional parameters (for messages)."""
  try:
    sig = inspect.signature(kernel)
  except (TypeError, ValueError):
    return None
  return [p.name for p in sig.parameters.values()
          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]


def trace_index_map(index_map: Callable | None, grid: tuple[int, ...],
                    prefetch_avals: Sequence[jax.core.ShapedArray],
                    ndim: int, where: str) -> Any:
  """Traces an index map to a jaxpr returning `ndim` int32 scalars."""
  n_args = len(grid) + len(prefetch_avals)
  if index_map is None:
    index_map = lambda *_: (0,) * ndim
  arity = positional_arity(index_map)
  if arity is not None and arity != n_args:
    extra = f" plus {len(prefetch_avals)} scalar-prefetch refs" if prefetch_avals else ""
    raise PalletError(f"{where}: index_map takes {arity} positional arguments but the grid "
                      f"{grid} has {len(grid)} axes{extra}; it must take {n_args}")

  def flat_index_map(*args):
    out = index_map(*args)
    if not isinstance(out, (tuple, list)):
      out = (out,)
    if len(out) != ndim:
      raise PalletError(f"{where}: index_map returned {len(out)} indices {tuple(out)!r} "
                        f"but the array has rank {ndim}")
    result = []
    for i, o in enumerate(out):
      o = jnp.asarray(o)
      if o.shape != () or not jnp.issubdtype(o.dtype, jnp.integer):
        raise PalletError(f"{where}: index_map result {i} must be an integer scalar, got "
                          f"{o.dtype}{list(o.shape)}")
      result.append(o.astype(jnp.int32))
    return tuple(result)

  arg_avals = ([jax.core.ShapedArray((), jnp.int32)] * len(grid)
               + [AbstractRef(a) for a in prefetch_avals])
  return jax.make_jaxpr(flat_index_map)(*arg_avals)


def block_mapping(spec: Any, aval: jax.core.ShapedArray, origin: str,
                  grid: tuple[int, ...], prefetch_avals: Sequence[jax.core.ShapedArray],
                  where: str) -> BlockMapping:
  """Resolves one operand's spec against its shape."""
  shape = tuple(aval.shape)
  if spec is None or spec is specs_lib.no_block_spec:
    spec = specs_lib.BlockSpec(None, None)
  if not isinstance(spec, specs_lib.BlockSpec):
    raise PalletError(f"{where}: expected a pl.BlockSpec, pl.no_block_spec or None, got "
                      f"{type(spec).__name__}: {spec!r}")
  memory_space = spec.memory_space
  if memory_space is not None and not isinstance(memory_space, specs_lib.MemorySpace):
    raise PalletError(f"{where}: unknown memory space {memory_space!r}; expected one of "
                      f"{[m.name for m in specs_lib.MemorySpace]} (e.g. pl.ANY, "
                      f"pallet.tpu.VMEM, pallet.tpu.SMEM)")
  whole = spec.block_shape is None
  if whole:
    dims = tuple(BlockDimension("blocked", s) for s in shape)
  else:
    block_shape = spec.block_shape
    if not isinstance(block_shape, (tuple, list)):
      raise PalletError(f"{where}: block_shape must be a tuple, got {block_shape!r}")
    if len(block_shape) != len(shape):
      raise PalletError(f"{where}: block_shape {tuple(block_shape)} has rank "
                        f"{len(block_shape)} but the array has shape {shape} "
                        f"(rank {len(shape)})")
    dims = tuple(_block_dimension(d, where) for d in block_shape)
  jaxpr = trace_index_map(spec.index_map, grid, prefetch_avals, len(shape), where)
  return BlockMapping(origin=origin, array_shape=shape, dtype=aval.dtype, dims=dims,
                      index_map=jaxpr, memory_space=memory_space, whole=whole)


def _is_spec_leaf(x: Any) -> bool:
  return x is None or x is specs_lib.no_block_spec or isinstance(x, specs_lib.BlockSpec)


def _lists_to_tuples(x: Any, is_leaf: Callable[[Any], bool]) -> Any:
  if is_leaf(x):
    return x
  if isinstance(x, (list, tuple)):
    return tuple(_lists_to_tuples(y, is_leaf) for y in x)
  if isinstance(x, dict):
    return {k: _lists_to_tuples(v, is_leaf) for k, v in x.items()}
  return x


def match_specs(specs: Any, operands: Any, what: str, kernel_name: str) -> list:
  """Pairs a pytree of specs with the flattened operands (a pytree) it describes.

  Lists and tuples are interchangeable (Pallas code uses both); a single spec
  describes a single operand; `no_block_spec` applies to every operand.
  """
  n_leaves = len(jax.tree_util.tree_leaves(operands))
  if specs is specs_lib.no_block_spec or specs is None:
    return [specs_lib.no_block_spec] * n_leaves
  if isinstance(specs, specs_lib.BlockSpec) and n_leaves == 1:
    return [specs]
  spec_leaves, spec_tree = jax.tree_util.tree_flatten(
      _lists_to_tuples(specs, _is_spec_leaf), is_leaf=_is_spec_leaf)
  operand_tree = jax.tree_util.tree_structure(
      _lists_to_tuples(operands, lambda x: not isinstance(x, (list, tuple, dict))))
  if spec_tree != operand_tree:
    raise PalletError(f"pallas_call of kernel '{kernel_name}': {what} has structure "
                      f"{spec_tree} but the {'outputs (out_shape)' if what.startswith('out') else 'inputs'} "
                      f"have structure {operand_tree}")
  return list(spec_leaves)

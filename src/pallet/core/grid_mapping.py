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
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallet.core import primitives
from pallet.core import specs as specs_lib
from pallet import _internals as internals
from pallet._internals import AbstractRef, Slice, is_tracer
from pallet.errors import PalletError, PalletSignatureError


def shown(value: Any) -> str:
  """`value` for an error message: traced values as their type (a tracer's repr names
  JAX's tracing machinery, not what the user wrote), the rest as `repr`."""
  if is_tracer(value):
    aval = jax.typeof(value)
    return f"<traced {aval.dtype}{list(aval.shape)}>"
  if isinstance(value, Slice):
    return f"pl.ds({shown(value.start)}, {shown(value.size)})"
  if isinstance(value, tuple):
    return "(" + ", ".join(map(shown, value)) + ("," if len(value) == 1 else "") + ")"
  if isinstance(value, list):
    return "[" + ", ".join(map(shown, value)) + "]"
  return repr(value)


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
  index_map_source: str = ""        # "file:line" of the user's index map, for messages
  # pl.BoundedSlice dimensions whose pl.ds size is traced: their dims and a closed
  # jaxpr (*grid_ids, *prefetch refs) -> those sizes, for the `size <= n` check
  slice_size_dims: tuple[int, ...] = ()
  slice_size_map: Any = None

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
  grid: tuple[int | None, ...]   # None: a traced size (see dynamic_axes)
  inputs: tuple[BlockMapping, ...]
  outputs: tuple[BlockMapping, ...]
  scratch_avals: tuple[jax.core.ShapedArray, ...]
  prefetch_avals: tuple[jax.core.ShapedArray, ...]
  dimension_semantics: tuple[str, ...] | None

  @property
  def num_steps(self) -> int:
    return int(np.prod(self.grid, dtype=np.int64)) if self.grid else 1

  @property
  def dynamic_axes(self) -> tuple[int, ...]:
    """Axes whose size is a traced value (None in `grid`): the sizes are the first
    operands of `pallas_call_p` and follow the grid indices in the kernel jaxpr."""
    return tuple(g for g, n in enumerate(self.grid) if n is None)

  def replace(self, **changes) -> "GridMapping":
    return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------
def normalize_grid(grid: Any, kernel_name: str) -> tuple[tuple[int | None, ...], tuple[Any, ...]]:
  """The static grid, None where a size is a traced value, and those traced sizes."""
  if grid is None:
    return (), ()
  if isinstance(grid, (numbers.Integral, np.integer)) or is_tracer(grid):
    grid = (grid,)
  try:
    grid = tuple(grid)
  except TypeError:
    raise PalletError(f"pallas_call of kernel '{kernel_name}': grid must be an int or a "
                      f"tuple of ints, got {shown(grid)}") from None
  static, dynamic = [], []
  for g in grid:
    if is_tracer(g) and g.shape == () and jnp.issubdtype(g.dtype, jnp.integer):
      static.append(None)
      dynamic.append(g)
      continue
    if isinstance(g, jax.Array) and g.shape == () and jnp.issubdtype(g.dtype, jnp.integer):
      g = int(g)
    if not isinstance(g, (numbers.Integral, np.integer)) or isinstance(g, bool):
      raise PalletError(f"pallas_call of kernel '{kernel_name}': grid entries must be "
                        f"integers or traced integer scalars, got {shown(grid)}")
    if g < 0:
      raise PalletError(f"pallas_call of kernel '{kernel_name}': grid sizes must be >= 0, "
                        f"got {shown(grid)}")
    static.append(int(g))
  return tuple(static), tuple(dynamic)


def _block_dimension(d: Any, where: str) -> BlockDimension:
  if d is None or isinstance(d, specs_lib.Squeezed):
    return BlockDimension("squeezed", 1)
  if isinstance(d, specs_lib.Element):
    padding = tuple(d.padding) if isinstance(d.padding, (tuple, list)) else None
    if (padding is None or len(padding) != 2 or any(
        isinstance(p, bool) or not isinstance(p, (numbers.Integral, np.integer)) or p < 0
        for p in padding)):
      raise PalletError(f"{where}: pl.Element padding must be a pair (low, high) of "
                        f"non-negative ints, got {d.padding!r}")
    return BlockDimension("element", _static_int(d.block_size, where),
                          tuple(int(p) for p in padding))
  if isinstance(d, specs_lib.Blocked):
    return BlockDimension("blocked", _static_int(d.block_size, where))
  if isinstance(d, specs_lib.BoundedSlice):
    # The index map's pl.ds(start, size) gives the element offset `start` (see
    # trace_index_map); elements past `size` are unspecified, as Element overhang is.
    return BlockDimension("element", _static_int(d.block_size, where))
  return BlockDimension("blocked", _static_int(d, where))


def _static_int(x: Any, where: str) -> int:
  if isinstance(x, bool) or not isinstance(x, (numbers.Integral, np.integer)):
    raise PalletError(f"{where}: block_shape entries must be static ints, None, "
                      f"pl.Squeezed(), pl.Element(n), pl.Blocked(n) or "
                      f"pl.BoundedSlice(n); got {x!r} "
                      f"of type {type(x).__name__}")
  if x <= 0:
    raise PalletError(f"{where}: block sizes must be positive, got {x}")
  return int(x)


def split_grid_names(grid: Any, kernel_name: str) -> tuple[Any, tuple[Any, ...] | None]:
  """`grid=(("i", 2), ("j", 4))` (a named grid, as in Pallas) -> ((2, 4), ("i", "j")).

  Any other grid comes back unchanged, with names None."""
  if not isinstance(grid, (tuple, list)) or not grid:
    return grid, None
  named = [isinstance(g, tuple) and len(g) == 2 and isinstance(g[0], str) for g in grid]
  if not any(named):
    return grid, None
  if not all(named):
    raise PalletError(f"pallas_call of kernel '{kernel_name}': a named grid names every "
                      f"axis, as in grid=((\"i\", 2), (\"j\", 4)); got {grid!r}")
  names = tuple(g[0] for g in grid)
  if len(set(names)) != len(names):
    raise PalletError(f"pallas_call of kernel '{kernel_name}': grid axis names must be "
                      f"distinct, got {names}")
  return tuple(g[1] for g in grid), names


def positional_arity_range(fn: Callable) -> tuple[int, int | None] | None:
  """(required, total) positional parameters of fn (total None with *args), or None
  when fn has no inspectable signature. Parameters with defaults are optional refs."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return None
  required, total = 0, 0
  for p in sig.parameters.values():
    if p.kind == p.VAR_POSITIONAL:
      return required, None
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
      total += 1
      required += p.default is p.empty
  return required, total


def accepts_call(fn: Callable, n_positional: int, keywords: Sequence[str] = ()) -> bool:
  """Whether fn can be called with n_positional arguments and these keywords (True
  when its signature is hidden)."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return True
  try:
    sig.bind(*range(n_positional), **dict.fromkeys(keywords))
  except TypeError:
    return False
  return True


def kernel_parameter_names(kernel: Callable) -> list[str] | None:
  """Names of the kernel's positional parameters (for messages)."""
  try:
    sig = inspect.signature(kernel)
  except (TypeError, ValueError):
    return None
  return [p.name for p in sig.parameters.values()
          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def trace_index_map(index_map: Callable | None, grid: tuple[int | None, ...],
                    prefetch_avals: Sequence[jax.core.ShapedArray],
                    ndim: int, where: str, prefetch_tree: Any = None,
                    slice_bounds: Mapping[int, int] | None = None,
                    kernel_name: str | None = None,
                    traced_size_dims: list[int] | None = None) -> Any:
  """Traces an index map to a jaxpr returning `ndim` int32 scalars.

  The jaxpr takes the flat prefetch refs; `prefetch_tree` re-nests them as the
  scalar-prefetch operands were passed (e.g. a tuple of arrays as one operand).
  For `slice_bounds` (pl.BoundedSlice dims and their `n`) the index map returns
  `pl.ds(start, size)`; the jaxpr returns `start`. A static size outside [0, n] is an
  error here; given a list `traced_size_dims`, the jaxpr returns instead the sizes
  that are traced (computed from grid indices or prefetch refs) and the list gets
  their dims, for the check when the call runs (`bounded_slices.py`)."""
  slice_bounds = dict(slice_bounds or {})
  if prefetch_tree is None:
    prefetch_tree = jax.tree_util.tree_structure((0,) * len(prefetch_avals))
  n_prefetch = len(prefetch_tree.children())   # scalar-prefetch operands, as passed
  n_args = len(grid) + n_prefetch
  if index_map is None:
    index_map = lambda *_: (0,) * ndim
  arity_range = positional_arity_range(index_map)
  if arity_range is not None:
    required, total = arity_range
    if not (required <= n_args and (total is None or n_args <= total)):
      arity = str(required) if required == total else f"{required} to {total}"
      extra = f" plus {n_prefetch} scalar-prefetch refs" if n_prefetch else ""
      raise PalletSignatureError(f"{where}: index_map takes {arity} positional arguments but "
                                 f"the grid {grid} has {len(grid)} axes{extra}; it must take "
                                 f"{n_args}")

  source = function_source(index_map)
  defined = f" (index_map defined at {source})" if source else ""

  def flat_index_map(*args):
    ids, refs = args[:len(grid)], args[len(grid):]
    # pl.program_id / pl.num_programs answer inside index maps too, as in Pallas
    with primitives.grid_context(ids, grid, kernel_name):
      out = index_map(*ids, *jax.tree_util.tree_unflatten(prefetch_tree, refs))
    if not isinstance(out, (tuple, list)):
      out = (out,)
    if len(out) != ndim:
      raise PalletError(f"{where}: index_map returned {len(out)} indices {shown(tuple(out))} "
                        f"but the array has rank {ndim}{defined}")
    result, slice_sizes = [], []
    for i, o in enumerate(out):
      if (i in slice_bounds) != isinstance(o, Slice):
        raise PalletError(f"{where}: index_map result {i} is {shown(o)}. Must return a "
                          f"pl.ds from the index_map for a BoundedSlice dimension (and only "
                          f"for such a dimension){defined}")
      if isinstance(o, Slice):
        if is_tracer(o.size):
          slice_sizes.append((i, jnp.asarray(o.size).astype(jnp.int32)))
        else:
          _check_static_slice_size(o.size, slice_bounds[i], i, where)
        o = o.start
      o = jnp.asarray(o)
      if o.shape != () or not jnp.issubdtype(o.dtype, jnp.integer):
        raise PalletError(f"{where}: index_map result {i} must be an integer scalar, got "
                          f"{o.dtype}{list(o.shape)}{defined}")
      result.append(o.astype(jnp.int32))
    if traced_size_dims is None:
      return tuple(result)
    traced_size_dims[:] = [i for i, _ in slice_sizes]
    return tuple(size for _, size in slice_sizes)

  arg_avals = ([jax.core.ShapedArray((), jnp.int32)] * len(grid)
               + [AbstractRef(a) for a in prefetch_avals])
  jaxpr = internals.trace_jaxpr(flat_index_map, arg_avals, "index_map")
  if any(isinstance(jax.typeof(c), AbstractRef) for c in jaxpr.consts):
    # pallet evaluates index maps while planning the grid, so a mutable ref would be
    # read once and its later values silently ignored
    raise PalletError(f"{where}: the index_map reads a ref it closes over; pass the "
                      f"values as a scalar-prefetch operand instead")
  return jaxpr


def _check_static_slice_size(size: Any, bound: int, i: int, where: str) -> None:
  """A `pl.ds` size known while tracing must fit its `pl.BoundedSlice(n)` block."""
  size = int(np.asarray(size))
  if not 0 <= size <= bound:
    raise PalletError(f"{where}: index_map result {i} is pl.ds(..., size={size}) but its "
                      f"pl.BoundedSlice({bound}) block holds at most {bound} elements; the "
                      f"size must be in [0, {bound}]")


def block_mapping(spec: Any, aval: jax.core.ShapedArray, origin: str,
                  grid: tuple[int | None, ...], prefetch_avals: Sequence[jax.core.ShapedArray],
                  where: str, prefetch_tree: Any = None, output: bool = False,
                  kernel_name: str | None = None) -> BlockMapping:
  """Resolves one operand's spec against its shape."""
  shape = tuple(aval.shape)
  if spec is None or spec is specs_lib.no_block_spec:
    spec = specs_lib.BlockSpec(None, None)
  if not isinstance(spec, specs_lib.BlockSpec):
    raise PalletError(f"{where}: expected a pl.BlockSpec, pl.no_block_spec or None, got "
                      f"{type(spec).__name__}: {spec!r}")
  memory_space = spec.memory_space
  if memory_space is specs_lib.MemorySpace.DEFAULT:   # what no memory space means
    memory_space = None
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
  slice_bounds = {d: dims[d].size for d, b in enumerate(() if whole else block_shape)
                  if isinstance(b, specs_lib.BoundedSlice)}
  if slice_bounds and output:
    raise PalletError(f"{where}: pl.BoundedSlice is supported for inputs only (an output "
                      f"block would write back its unspecified tail); use pl.Element and "
                      f"a masked store instead")
  jaxpr = trace_index_map(spec.index_map, grid, prefetch_avals, len(shape), where,
                          prefetch_tree, slice_bounds, kernel_name)
  size_dims, size_map = _traced_slice_sizes(spec.index_map, grid, prefetch_avals, shape,
                                            where, prefetch_tree, slice_bounds, kernel_name)
  return BlockMapping(origin=origin, array_shape=shape, dtype=aval.dtype, dims=dims,
                      index_map=jaxpr, memory_space=memory_space, whole=whole,
                      index_map_source=function_source(spec.index_map),
                      slice_size_dims=size_dims, slice_size_map=size_map)


def _traced_slice_sizes(index_map, grid, prefetch_avals, shape, where, prefetch_tree,
                        slice_bounds, kernel_name) -> tuple[tuple[int, ...], Any]:
  """The pl.BoundedSlice dims whose size the index map computes (not a constant), and
  a jaxpr of those sizes; ((), None) when every size was checked while tracing."""
  if not slice_bounds:
    return (), None
  traced: list[int] = []
  jaxpr = trace_index_map(index_map, grid, prefetch_avals, len(shape), where, prefetch_tree,
                          slice_bounds, kernel_name, traced_size_dims=traced)
  return (tuple(traced), jaxpr) if traced else ((), None)


def user_function(fn: Callable) -> Callable:
  """The function the user wrote, under functools.partial and decorators
  (e.g. pallet.named's wrapper)."""
  while True:
    if hasattr(fn, "func"):              # functools.partial
      fn = fn.func
    elif hasattr(fn, "__wrapped__"):     # functools.wraps
      fn = fn.__wrapped__
    else:
      return fn


def function_source(fn: Any) -> str:
  """"file:line" where the user's function under `fn` is defined, for messages ("" if
  unknown). Read from its code object: `inspect.getsourcelines` parses the whole
  file, on every pallas_call."""
  code = getattr(user_function(fn), "__code__", None)
  if code is None:
    return ""
  return f"{code.co_filename}:{code.co_firstlineno}"

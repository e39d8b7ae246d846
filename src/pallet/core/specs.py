"""User-facing descriptions of how arrays are cut into blocks over a grid.

These mirror `jax.experimental.pallas` (`BlockSpec`, `GridSpec`, `Squeezed`,
`Element`, `Blocked`, memory spaces, compiler parameters) so existing kernels run
unchanged. They are plain data; `grid_mapping.py` resolves them against concrete
array shapes.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Sequence

import jax


class MemorySpace(enum.Enum):
  """Where a kernel operand lives. Backends may treat several spaces alike."""
  ANY = "any"        # leave placement to the backend (whole array, unblocked)
  DEFAULT = "default"  # the backend's default, as if no memory space were given
  GMEM = "gmem"      # GPU global memory
  SMEM = "smem"      # scalar / shared memory
  VMEM = "vmem"      # TPU vector memory
  HBM = "hbm"
  SEMAPHORE = "semaphore"  # TPU semaphores (int32 counters on the CPU), see dma.py
  HOST = "host"            # host memory (`pl.HOST`)
  CMEM = "cmem"            # TPU common memory
  VMEM_SHARED = "vmem_shared"  # TPU vector memory shared by a chip's cores
  KEY = "key"              # PRNG keys (typed key arrays), held whole like SMEM scalars

  def __call__(self, shape: Sequence[int], dtype: Any) -> "MemoryRef":
    """`pltpu.VMEM((8, 128), jnp.float32)` describes a scratch buffer."""
    return MemoryRef(shape=tuple(shape), dtype=dtype, memory_space=self)

  def from_type(self, aval: Any) -> "MemoryRef":
    """A buffer of type `aval` (a `jax.core.ShapedArray`) in this memory space."""
    return MemoryRef(aval, self)

  def like(self, x: Any) -> "MemoryRef":
    """A buffer shaped like `x` (an array, ShapeDtypeStruct or aval) in this memory space."""
    return MemoryRef(shape=tuple(x.shape), dtype=x.dtype, memory_space=self)


ANY = MemorySpace.ANY
HOST = MemorySpace.HOST
# `pl.semaphore`: in JAX the semaphore dtype; pallet semaphores are int32 refs in
# this memory space (see dma.py), so the name stands for the memory space.
semaphore = MemorySpace.SEMAPHORE


@dataclasses.dataclass(frozen=True)
class ScratchShape:
  """A scratch buffer request: kernel-private memory that persists across grid steps."""
  shape: tuple[int, ...]
  dtype: Any
  memory_space: MemorySpace | None = None


class MemoryRef(ScratchShape):
  """`pl.MemoryRef(aval, memory_space)`: like `jax.ShapeDtypeStruct`, with a memory space.

  What memory spaces return when called; usable in `scratch_shapes` and `run_scoped`.
  Also constructible as `MemoryRef(shape=..., dtype=..., memory_space=...)`.
  """

  def __init__(self, inner_aval: Any = None, memory_space: Any = None, *,
               shape: Sequence[int] | None = None, dtype: Any = None):
    if inner_aval is not None:
      shape, dtype = inner_aval.shape, inner_aval.dtype
    if shape is None or dtype is None:
      raise TypeError("pl.MemoryRef needs an aval (e.g. jax.core.ShapedArray(shape, dtype)) "
                      "or shape= and dtype=")
    if memory_space is MemorySpace.SEMAPHORE:
      dtype = jax.numpy.int32   # any semaphore dtype: pallet semaphores are int32 counters
    super().__init__(tuple(shape), dtype, memory_space)

  @property
  def inner_aval(self) -> Any:
    return jax.core.ShapedArray(self.shape, self.dtype)

  def get_array_aval(self) -> Any:
    return self.inner_aval

  def get_ref_aval(self) -> Any:
    return jax.ref.AbstractRef(self.inner_aval)


@dataclasses.dataclass(frozen=True)
class Squeezed:
  """A block dimension of size 1 that the kernel does not see (same as `None`)."""


squeezed = Squeezed()


@dataclasses.dataclass(frozen=True)
class Element:
  """A block dimension whose index_map entry is an element offset, not a block index.

  `padding=(low, high)` allows offsets that start before 0 or end past the array
  (the out-of-range part reads as unspecified values, like an overhanging block).
  """
  block_size: int
  padding: tuple[int, int] = (0, 0)


@dataclasses.dataclass(frozen=True)
class Blocked:
  """An ordinary block dimension (same as a plain int)."""
  block_size: int


@dataclasses.dataclass(frozen=True)
class Indirect:
  """A block dimension indexed by an array of indices (a gather for inputs, a scatter
  for outputs). Not supported by pallet's backends: a BlockSpec using it is an error."""
  block_size: int

  def __repr__(self) -> str:
    return f"Indirect({self.block_size})"


@dataclasses.dataclass(frozen=True)
class BoundedSlice:
  """A block dimension of `block_size` whose index_map entry is `pl.ds(start, size)`
  with `size <= block_size` (both may be traced): the block starts at element `start`;
  elements from `size` on are unspecified. Inputs only in pallet."""
  block_size: int

  def __repr__(self) -> str:
    return f"BoundedSlice({self.block_size})"


BlockDim = int | None | Squeezed | Element | Blocked | Indirect | BoundedSlice


class _NoBlockSpec:
  """Marker: the operand is passed whole (the default when a spec is omitted)."""

  def __repr__(self) -> str:
    return "no_block_spec"


no_block_spec = _NoBlockSpec()


@dataclasses.dataclass(frozen=True)
class BlockSpec:
  """How one operand is cut into blocks: the block's shape and which block each grid step sees.

  `index_map(*grid_indices, *scalar_prefetch_refs)` returns one entry per array
  dimension: a block index (an element offset for `Element` dimensions).
  `block_shape=None` means the whole array; `index_map=None` means block 0.
  """
  block_shape: Sequence[BlockDim] | None = None
  index_map: Callable[..., Any] | None = None
  # keyword-only, as in JAX: BlockSpec(shape, index_map, pl.Buffered(2)) is a pipeline mode
  memory_space: MemorySpace | None = dataclasses.field(kw_only=True, default=None)
  pipeline_mode: Any = None

  def __post_init__(self):
    # Old Pallas accepted `BlockSpec(index_map, block_shape)`; keep accepting it.
    if callable(self.block_shape) and not callable(self.index_map):
      shape, index_map = self.index_map, self.block_shape
      object.__setattr__(self, "block_shape", shape)
      object.__setattr__(self, "index_map", index_map)

  def replace(self, **changes: Any) -> "BlockSpec":
    """A copy with `changes` applied (Pallas `BlockSpec.replace`)."""
    return dataclasses.replace(self, **changes)


class RevisitMode(enum.Enum):
  """When a TPU pipeline may revisit an output block (`Buffered(revisit=...)`):
  IMMEDIATE only on the next step, ANY at any step. Accepted; pallet does not
  pipeline blocks, so it changes nothing."""
  IMMEDIATE = "immediate"
  ANY = "any"


@dataclasses.dataclass(frozen=True)
class Buffered:
  """Pipeline hint (number of buffers); accepted for compatibility, unused on the CPU."""
  buffer_count: int | tuple[int, int]
  use_lookahead: bool = False
  revisit: RevisitMode | None = None
  prefetched_count: int = 0


def scratch_tree(scratch_shapes: Any) -> tuple | dict:
  """Scratch shapes as given: a sequence (the kernel gets them positionally, after
  the outputs) or a dict (by keyword, as in Pallas)."""
  return dict(scratch_shapes) if isinstance(scratch_shapes, dict) else tuple(scratch_shapes)


def scratch_arguments(scratch_shapes: Any) -> tuple[tuple, dict]:
  """(positional, keyword) scratch shapes, as the kernel receives them."""
  tree = scratch_tree(scratch_shapes)
  return ((), tree) if isinstance(tree, dict) else (tree, {})


@dataclasses.dataclass(init=False, kw_only=True)
class GridSpec:
  """A grid with its in/out specs and scratch, as one object (Pallas `GridSpec`).

  As in JAX, a named grid `(("i", 2), ("j", 4))` is kept as `grid=(2, 4)` and
  `grid_names=("i", "j")`, and lists of specs are stored as tuples."""
  grid: Any
  grid_names: tuple[Any, ...] | None
  in_specs: Any
  out_specs: Any
  scratch_shapes: Sequence[Any] | dict[str, Any] = ()

  # scalar-prefetch operands come first in the call: none for a plain GridSpec
  num_scalar_prefetch = 0

  def __init__(self, grid: Any = (), in_specs: Any = no_block_spec,
               out_specs: Any = no_block_spec,
               scratch_shapes: Sequence[Any] | dict[str, Any] = ()):
    self.in_specs = tuple(in_specs) if isinstance(in_specs, list) else in_specs
    self.out_specs = tuple(out_specs) if isinstance(out_specs, list) else out_specs
    self.scratch_shapes = scratch_tree(scratch_shapes)
    self.grid, self.grid_names = _split_names(grid)

  def named_grid(self) -> Any:
    """The grid as pallas_call's `grid=` takes it (names paired with sizes again)."""
    if self.grid_names is None:
      return self.grid
    return tuple(zip(self.grid_names, self.grid))


def _split_names(grid: Any) -> tuple[Any, tuple[Any, ...] | None]:
  """((name, size), ...) -> ((size, ...), (name, ...)); any other grid is kept with no
  names (pallas_call reports malformed named grids with the kernel's name)."""
  if isinstance(grid, int):
    return (grid,), None
  if (isinstance(grid, (tuple, list)) and grid
      and all(isinstance(g, tuple) and len(g) == 2 and isinstance(g[0], str) for g in grid)):
    return tuple(g[1] for g in grid), tuple(g[0] for g in grid)
  return grid, None


@dataclasses.dataclass(frozen=True)
class CompilerParams:
  """Backend-neutral compiler parameters (accepted by every backend)."""
  dimension_semantics: Sequence[str] | None = None
  num_warps: int | None = None
  num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class CostEstimate:
  """Cost hint handed to XLA's scheduler; informational on the CPU backend.

  `remote_bytes_transferred` counts bytes sent to other devices (remote DMAs)."""
  flops: int
  transcendentals: int
  bytes_accessed: int
  remote_bytes_transferred: int = 0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, int):   # as JAX: NumPy integers are refused too
        raise ValueError(f"pl.CostEstimate: every field must be a Python int; "
                         f"{field.name} is {type(value).__name__} ({value!r})")

  def to_json(self) -> bytes:
    """The estimate as the JSON bytes Pallas attaches to the kernel's custom call."""
    fields = ", ".join(f'"{f.name}": {getattr(self, f.name)}' for f in dataclasses.fields(self))
    return ("{" + fields + "}").encode("ascii")

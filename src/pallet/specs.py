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


class MemorySpace(enum.Enum):
  """Where a kernel operand lives. Backends may treat several spaces alike."""
  ANY = "any"        # leave placement to the backend (whole array, unblocked)
  GMEM = "gmem"      # GPU global memory
  SMEM = "smem"      # scalar / shared memory
  VMEM = "vmem"      # TPU vector memory
  HBM = "hbm"
  SEMAPHORE = "semaphore"  # TPU semaphores (int32 counters on the CPU), see dma.py

  def __call__(self, shape: Sequence[int], dtype: Any) -> "ScratchShape":
    """`pltpu.VMEM((8, 128), jnp.float32)` describes a scratch buffer."""
    return ScratchShape(tuple(shape), dtype, self)


ANY = MemorySpace.ANY


@dataclasses.dataclass(frozen=True)
class ScratchShape:
  """A scratch buffer request: kernel-private memory that persists across grid steps."""
  shape: tuple[int, ...]
  dtype: Any
  memory_space: MemorySpace | None = None


@dataclasses.dataclass(frozen=True)
class Squeezed:
  """A block dimension of size 1 that the kernel does not see (same as `None`)."""
  block_size: int = 1


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


BlockDim = int | None | Squeezed | Element | Blocked


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
  memory_space: MemorySpace | None = None
  pipeline_mode: Any = None

  def __post_init__(self):
    # Old Pallas accepted `BlockSpec(index_map, block_shape)`; keep accepting it.
    if callable(self.block_shape) and not callable(self.index_map):
      shape, index_map = self.index_map, self.block_shape
      object.__setattr__(self, "block_shape", shape)
      object.__setattr__(self, "index_map", index_map)


@dataclasses.dataclass(frozen=True)
class Buffered:
  """Pipeline hint (number of buffers); accepted for compatibility, unused on the CPU."""
  buffer_count: int = 2


@dataclasses.dataclass
class GridSpec:
  """A grid with its in/out specs and scratch, as one object (Pallas `GridSpec`)."""
  grid: Any = ()
  in_specs: Any = no_block_spec
  out_specs: Any = no_block_spec
  scratch_shapes: Sequence[Any] = ()
  num_scalar_prefetch: int = 0


@dataclasses.dataclass(frozen=True)
class CompilerParams:
  """Backend-neutral compiler parameters (accepted by every backend)."""
  dimension_semantics: Sequence[str] | None = None
  num_warps: int | None = None
  num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class CostEstimate:
  """Cost hint handed to XLA's scheduler; informational on the CPU backend."""
  flops: int
  transcendentals: int
  bytes_accessed: int

"""TPU launch parameters: `pltpu.CompilerParams`, grid semantics, core types, and
`PrefetchScalarGridSpec`.

Only `dimension_semantics` changes what pallet does (parallel axes may be
vectorized, arbitrary ones run in order unless pallet proves their programs
independent, as for undeclared axes; `CORE_PARALLEL` / `SUBCORE_PARALLEL`
split work across cores and so count as parallel). The other fields tune
Mosaic's code generation and are accepted with JAX 0.12's names and defaults.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Sequence

from pallet.core.specs import GridSpec, no_block_spec


class GridDimensionSemantics(enum.Enum):
  """How a grid axis may be scheduled (`pltpu.PARALLEL`, `pltpu.ARBITRARY`, ...)."""
  PARALLEL = "parallel"
  CORE_PARALLEL = "core_parallel"
  SUBCORE_PARALLEL = "subcore_parallel"
  ARBITRARY = "arbitrary"


PARALLEL = GridDimensionSemantics.PARALLEL
CORE_PARALLEL = GridDimensionSemantics.CORE_PARALLEL
SUBCORE_PARALLEL = GridDimensionSemantics.SUBCORE_PARALLEL
ARBITRARY = GridDimensionSemantics.ARBITRARY


class CoreType(enum.Enum):
  """Which TPU core a mesh runs on (TensorCore, or a SparseCore subcore)."""
  TC = "tc"
  SC_SCALAR_SUBCORE = "sc_scalar_subcore"
  SC_VECTOR_SUBCORE = "sc_vector_subcore"


class SideEffectType(enum.Enum):
  """`CompilerParams.has_side_effects` values; pallet never drops a kernel call."""
  PURE = "pure"
  DATAFLOW_SIDE_EFFECTING = "dataflow_side_effecting"
  SIDE_EFFECTING = "side_effecting"


@dataclasses.dataclass(frozen=True)
class CompilerParams:
  """Mosaic TPU compiler parameters, with JAX 0.12's fields in its order;
  `dimension_semantics` is honoured on the CPU."""
  dimension_semantics: Sequence[Any] | None = None
  allow_input_fusion: Sequence[bool] | None = None
  vmem_limit_bytes: int | None = None
  collective_id: int | None = None
  has_side_effects: Any = False
  flags: Any = None
  internal_scratch_in_bytes: int | None = None
  serialization_format: int = 1
  disable_bounds_checks: bool = False
  disable_semaphore_checks: bool = False
  skip_device_barrier: bool = False
  allow_collective_id_without_custom_barrier: bool = False
  shape_invariant_numerics: bool = True
  use_tc_tiling_on_sc: bool | None = None
  needs_layout_passes: bool = True
  fuse_transposed_lhs_in_matmul: bool = False
  opt_level: Any = None

  def __post_init__(self):
    if not isinstance(self.has_side_effects, (bool, SideEffectType)):
      raise ValueError(
          f"pltpu.CompilerParams: Invalid side effect type: {self.has_side_effects!r}; "
          "expected a bool or a pltpu.SideEffectType")
    # Sequences given as lists are stored as tuples, as JAX does.
    for field in ("dimension_semantics", "allow_input_fusion"):
      value = getattr(self, field)
      if isinstance(value, list):
        object.__setattr__(self, field, tuple(value))


@dataclasses.dataclass(init=False, kw_only=True)
class PrefetchScalarGridSpec(GridSpec):
  """A grid spec whose first `num_scalar_prefetch` operands are scalars given to the
  index maps and the kernel (as refs), enabling data-dependent block selection."""
  num_scalar_prefetch: int = 0

  def __init__(self, num_scalar_prefetch: int, grid: Any = (),
               in_specs: Any = no_block_spec, out_specs: Any = no_block_spec,
               scratch_shapes: Sequence[Any] | dict[str, Any] = ()):
    super().__init__(grid=grid, in_specs=in_specs, out_specs=out_specs,
                     scratch_shapes=scratch_shapes)
    self.num_scalar_prefetch = num_scalar_prefetch

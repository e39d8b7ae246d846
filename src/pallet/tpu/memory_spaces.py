"""TPU memory spaces beyond the plain ones in specs.MemorySpace: the matrix unit's
accumulators (`pltpu.ACC`) and the in-kernel query `pltpu.has_memory_space`.

pallet runs every memory space as ordinary memory, so these only decide shapes,
dtypes and answers that a TPU kernel branches on.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from pallet.core.specs import MemoryRef, MemorySpace


@dataclasses.dataclass(frozen=True)
class AccMemorySpace:
  """`pltpu.ACC(mxu_id=0)((m, n), jnp.float32)`: an accumulator of a TPU matrix unit.

  In pallet an accumulator is ordinary scratch memory. The TPU's own limits that
  do not depend on the chip (at least 2-D, float32 or int32) are checked.
  """
  mxu_id: int

  def __call__(self, shape: Sequence[int], dtype: Any) -> MemoryRef:
    shape = tuple(shape)
    if len(shape) < 2:
      raise ValueError(f"pltpu.ACC: an accumulator must be at least 2-D, got shape {shape}")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)):
      raise ValueError(f"pltpu.ACC: an accumulator holds float32 or int32, got {dtype}")
    if self.mxu_id < 0:
      raise ValueError(f"pltpu.ACC: mxu_id must be >= 0, got {self.mxu_id}")
    return MemoryRef(shape=shape, dtype=dtype, memory_space=self)

  def __str__(self) -> str:
    return f"ACC(mxu_id={self.mxu_id})"


# Where an operand in pl.ANY ends up: XLA places pallas_call operands in HBM on a TPU.
_PHYSICAL_SPACE_OF_ANY = MemorySpace.HBM
_QUERYABLE = (MemorySpace.HBM, MemorySpace.VMEM, MemorySpace.SMEM, MemorySpace.CMEM,
              MemorySpace.VMEM_SHARED, MemorySpace.HOST)


def has_memory_space(ref: Any, memory_space: MemorySpace) -> np.bool_:
  """Whether `ref` (a `pl.ANY` operand) physically lives in `memory_space`.

  A TPU resolves this when compiling, to choose between a kernel's branches for
  operands in HBM and operands placed in VMEM. pallet answers as a TPU does for an
  operand left in its default place: True for HBM only. Both branches of a correct
  kernel compute the same values, so the answer changes speed on a TPU, not results.
  The answer is a static boolean, so `pl.when` keeps only the branch taken.
  """
  del ref  # pallet refs carry no memory space to check against pl.ANY
  if memory_space is MemorySpace.ANY:
    raise ValueError("pltpu.has_memory_space(..., pl.ANY) is not supported; name a "
                     "concrete memory space such as pltpu.HBM or pltpu.VMEM")
  if memory_space not in _QUERYABLE:
    raise ValueError(f"pltpu.has_memory_space: expected a memory space such as "
                     f"pltpu.HBM or pltpu.VMEM, got {memory_space!r}")
  return np.bool_(memory_space is _PHYSICAL_SPACE_OF_ANY)

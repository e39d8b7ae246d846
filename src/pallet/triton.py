"""Triton-flavoured names (`jax.experimental.pallas.triton`): compiler params, masked
loads/stores and atomics, usable on every backend."""
from __future__ import annotations

import dataclasses

from pallet.primitives import (atomic_add, atomic_and, atomic_cas, atomic_max, atomic_min,
                               atomic_or, atomic_xchg, atomic_xor, load, store)
from pallet.specs import CompilerParams as _BaseCompilerParams


@dataclasses.dataclass(frozen=True)
class CompilerParams(_BaseCompilerParams):
  """Launch parameters of the Triton backend (ignored by the CPU backend)."""
  num_warps: int | None = None
  num_stages: int | None = None


TritonCompilerParams = CompilerParams

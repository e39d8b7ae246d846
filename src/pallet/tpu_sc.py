"""`jax.experimental.pallas.tpu_sc` (TPU SparseCore) as pallet sees it: importable,
not runnable.

SparseCore programs run on a TPU's SparseCore subcores, which have no CPU
meaning. Any name JAX has in this module can be imported; using it raises a
PalletError saying so and what to use instead.
"""
from __future__ import annotations

from typing import Any

from pallet.core.unsupported import Unsupported

_INSTEAD = ("pallet does not run SparseCore programs; write the kernel for the "
            "TensorCore (pallet.tpu) and run it on pallet's default backend")


def __getattr__(name: str) -> Any:
  if name.startswith("_"):
    raise AttributeError(name)
  return Unsupported(f"pallet.tpu_sc.{name}", "TPU SparseCore only", _INSTEAD)

"""`jax.experimental.pallas.mosaic_gpu` as pallet sees it: importable, not runnable.

Mosaic-GPU kernels program NVIDIA Hopper/Blackwell hardware directly (warpgroups,
TMA, barriers, tensor-memory); pallet has no Mosaic-GPU backend. Any name JAX has
in this module can be imported; using it raises a PalletError saying so and what
to use instead.
"""
from __future__ import annotations

from typing import Any

from pallet.core.unsupported import Unsupported

_INSTEAD = ("pallet does not run Mosaic-GPU programs; write the kernel with "
            "pallet.triton (plgpu's Triton API) or plain pallet and run it on the "
            "Triton backend or the default backend")


def __getattr__(name: str) -> Any:
  if name.startswith("_"):
    raise AttributeError(name)
  return Unsupported(f"pallet.mosaic_gpu.{name}", "Mosaic-GPU only", _INSTEAD)

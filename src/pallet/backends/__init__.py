"""Backends: each consumes a `KernelDescription` through one small interface.

A backend is a module with `NAME` and
`lower(ctx, *args, kernel: KernelDescription, interpret: bool) -> list`,
the MLIR lowering of one `pallas_call`. Backends never import each other.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import jax

_MODULES = {"xla": "pallet.backends.xla", "triton": "pallet.backends.triton"}
_ALIASES = {"cpu": "xla", "interpret": "xla", "xla": "xla", "triton": "triton",
            "gpu": "triton"}


def available() -> list[str]:
  return sorted(_MODULES)


def gpu_present() -> bool:
  try:
    return any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices())
  except RuntimeError:
    return False


def resolve(name: str | None, interpret: bool) -> str:
  """The backend to use for a call: explicit name, else triton on a GPU, else xla."""
  if name is None:
    if interpret:
      return "xla"
    return "triton" if gpu_present() else "xla"
  key = str(name).lower()
  if key not in _ALIASES:
    raise ValueError(f"unknown pallet backend {name!r}; available: {available()} "
                     f"(aliases: {sorted(_ALIASES)})")
  return _ALIASES[key]


def get(name: str) -> ModuleType:
  return importlib.import_module(_MODULES[name])

"""The peer implementation: JAX's own Pallas (`jax.experimental.pallas`).

This is the one module of `src/` that loads JAX's Pallas. The guide keeps
`jax.experimental.pallas` out of pallet and allows it to benchmarks, as the peer
they time pallet against; the benchmark suite ships inside pallet (`pallet.bench`,
so an installed pallet can run it), so the peer is loaded here, only inside
functions, and only when a benchmark asks for it (`import pallet` never imports
`pallet.bench`). tests/test_layout.py holds both halves of that rule.

Benchmarks call `pl.atomic_add`, which upstream Pallas exposes only from its
Triton namespace; `peer_pallas()` returns a module-like view with it added (and
the TPU and Triton namespaces as `tpu` and `triton`) so the shared kernel source
runs unchanged on the peer.
"""
from __future__ import annotations

import importlib
import types


def peer_pallas() -> types.SimpleNamespace:
  from jax.experimental import pallas
  from jax.experimental.pallas import tpu as pallas_tpu
  from jax.experimental.pallas import triton as pallas_triton

  public = {name: getattr(pallas, name) for name in dir(pallas)
            if not name.startswith("_")}
  public.update(atomic_add=pallas_triton.atomic_add, tpu=pallas_tpu, triton=pallas_triton)
  # kernels that import a sibling namespace by name (`pl.__name__ + ".tpu"`) find JAX's
  return types.SimpleNamespace(__name__=pallas.__name__, **public)


def peer_op(name: str) -> types.ModuleType:
  """JAX's own kernel module `jax/experimental/pallas/ops/<name>`, imported normally."""
  return importlib.import_module(f"jax.experimental.pallas.ops.{name.replace('/', '.')}")

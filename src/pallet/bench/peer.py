"""The peer implementation: `jax.experimental.pallas`, seen as one Pallas module.

Benchmarks call `pl.atomic_add`, which upstream Pallas exposes only from its
Triton namespace; `peer_pallas()` returns a module-like view with it added (and
the TPU namespace as `tpu`, for scratch buffers) so the shared kernel source runs
unchanged on the peer.
"""
from __future__ import annotations

import types


def peer_pallas() -> types.SimpleNamespace:
  from jax.experimental import pallas
  from jax.experimental.pallas import tpu as pallas_tpu
  from jax.experimental.pallas import triton as pallas_triton

  public = {name: getattr(pallas, name) for name in dir(pallas)
            if not name.startswith("_")}
  public.update(atomic_add=pallas_triton.atomic_add, tpu=pallas_tpu)
  # kernels that import a sibling namespace by name (`pl.__name__ + ".tpu"`) find JAX's
  return types.SimpleNamespace(__name__=pallas.__name__, **public)

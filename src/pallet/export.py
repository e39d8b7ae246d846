"""Looking at what a function with kernels lowers to: `pl.lower_as_mlir`.

pallet kernels lower to ordinary XLA (or, on the Triton backend, a custom call),
so the text is the StableHLO of `jax.jit(f)` with every kernel inlined.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import jax


def lower_as_mlir(f: Callable[..., Any], *args: Any, dynamic_shapes: bool = False,
                  device: Any = None, static_argnames: Sequence[str] = (),
                  platforms: Sequence[str] | None = None, **kwargs: Any) -> str:
  """The StableHLO module text of `jax.jit(f)` applied to `args` and `kwargs`.

  `platforms` (e.g. `["cpu"]`) picks the platforms to lower for; by default the
  default backend's (JAX lowers for "tpu" by default). `dynamic_shapes` is
  accepted; pallet kernels need static shapes either way.
  """
  with pallas_export_experimental(dynamic_shapes):
    jit_kwargs = {} if device is None else {"device": device}
    jitted = jax.jit(f, static_argnames=static_argnames, **jit_kwargs)
    traced = jitted.trace(*args, **kwargs)
    lowered = traced.lower(lowering_platforms=tuple(platforms) if platforms else None)
    return lowered.as_text()


@contextlib.contextmanager
def pallas_export_experimental(dynamic_shapes: bool) -> Iterator[None]:
  """Accepted for compatibility. In JAX it lets kernels have symbolic block shapes
  when exporting; pallet kernels (grids and blocks) always have static shapes."""
  del dynamic_shapes
  yield

"""jax.numpy's layout helpers written as the one lax operation they bind.

`jnp.moveaxis` is a jitted function: on a first call (cold caches) every new shape
it sees is traced as its own program before it is inlined, about a JAX trace's
fixed cost each time. The program pallet emits moves axes per operand and loop
step, so these trace costs add up to part of a kernel's first call. The helpers
here bind the same `transpose` directly: the same equations, no extra trace.
"""
from __future__ import annotations

from typing import Any, Sequence

from jax import lax


def moveaxis(x: Any, source: Sequence[int], destination: Sequence[int]) -> Any:
  """`jnp.moveaxis(x, source, destination)` (non-negative axes), as one transpose."""
  source, destination = list(source), list(destination)
  if len(source) != len(destination):
    raise ValueError(f"moveaxis: {len(source)} source axes but {len(destination)} "
                     f"destinations")
  perm = [d for d in range(len(x.shape)) if d not in source]
  for dst, src in sorted(zip(destination, source)):
    perm.insert(dst, src)
  return lax.transpose(x, perm)

"""The three ways each benchmark runs: jax.numpy, pallet, and the interpret peer."""
from __future__ import annotations

from typing import Literal

from benchmarks.case import Benchmark, Program

Variant = Literal["jnp", "pallet", "interpret"]
VARIANTS: tuple[Variant, ...] = ("jnp", "pallet", "interpret")
# Variants slow enough to need the peer timing policy (see benchmarks.runner).
PEER_VARIANTS: frozenset[Variant] = frozenset({"interpret"})


def program_for(bench: Benchmark, variant: Variant) -> Program:
  """The un-jitted program `variant` runs for `bench`.

  pallet and the peer are imported here, not at module import, so a broken or
  missing implementation fails only its own variant.
  """
  if variant == "jnp":
    return bench.reference
  if variant == "pallet":
    import pallet
    return bench.build_pallas(pallet)
  if variant == "interpret":
    from benchmarks.peer import peer_pallas
    return bench.build_pallas(peer_pallas(), interpret=True)
  raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")

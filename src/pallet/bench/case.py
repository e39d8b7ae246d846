"""What one benchmark is: a Pallas-style program, its jax.numpy twin, inputs, tolerance.

A benchmark never holds a Pallas module itself. `build_pallas(pl, **call_kwargs)`
receives one (``pallet`` or the ``jax.experimental.pallas`` peer) so the very same
kernel source is traced by every implementation; ``call_kwargs`` carries per-variant
options of ``pallas_call`` such as ``interpret=True``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import jax

# Size classes: "full" (the suite's sizes) and "test" (the sizes of JAX's own tests for
# its Pallas ops: what people test and develop with) are measured and reported side by
# side; "small" and "tiny" are the full suite shrunk, for smoke runs (CI, unit tests).
Size = Literal["full", "test", "small", "tiny"]
SIZES: tuple[Size, ...] = ("full", "test", "small", "tiny")
MEASURED_CLASSES: tuple[Size, ...] = ("full", "test")

Program = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """One kernel at one problem size, runnable by every variant."""

  name: str
  family: str
  grid: tuple[int, ...]
  shapes: str  # human-readable problem size, e.g. "4096x1024 f32"
  make_inputs: Callable[[jax.Array], tuple[jax.Array, ...]]
  reference: Program  # plain jax.numpy program (the runner jits it)
  build_pallas: Callable[..., Program]  # (pl, **pallas_call_kwargs) -> program
  rtol: float
  atol: float
  # Why the peer is known to compute a different result (still timed, marked).
  peer_known_issue: str = ""

  @property
  def grid_steps(self) -> int:
    return math.prod(self.grid)

"""Python's cyclic garbage collector paused while pallet traces and lowers a kernel.

Tracing allocates many short-lived objects (equations, tracers, avals); each time
their count passes the collector's threshold it walks the young generation, and
now and then every object the process holds (all of JAX's). Over the benchmark
suite that was about 10% of pallet's Python time for a first call. Pausing the
collector for the duration of one kernel's tracing or lowering, and letting it run
once after, frees the same cycles.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
  """Disables the collector inside the block (nesting is fine); restores it after."""
  if not gc.isenabled():
    yield
    return
  gc.disable()
  try:
    yield
  finally:
    gc.enable()

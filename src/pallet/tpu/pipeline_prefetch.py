"""Pipeline inputs whose first blocks were fetched before the pipeline started.

`pl.Buffered(buffer_count, prefetched_count=k)` on an input spec says that the first `k`
blocks the pipeline fetches (one per change of the block index, in step order) are
already in a window buffer the caller filled, often in an earlier `pallas_call`. The
caller binds that buffer with `allocation.with_window_ref(ref)` on the allocation
`emit_pipeline_with_allocations` made. The window holds `buffer_count` slots: a leading
slot axis (`window[slot]`), slots laid end to end in a 1-D window, or, when the block is
the whole window, the block itself. The pipeline reads fetch `f < k` from slot `f`
instead of the input ref, as a TPU does; later fetches copy from the input ref.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pallet.core import primitives
from pallet.errors import PalletError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefetchedInputAllocation:
  """The allocation of a prefetched input: its block buffer, and the window the caller
  prefetched into (None until bound with `with_window_ref`)."""
  buffer: Any
  window: Any = None
  prefetched_count: int = dataclasses.field(default=0, metadata=dict(static=True))
  buffer_count: int = dataclasses.field(default=2, metadata=dict(static=True))

  def with_window_ref(self, window_ref: Any) -> "PrefetchedInputAllocation":
    """This allocation with `window_ref` as the buffer its first blocks were fetched into."""
    return dataclasses.replace(self, window=window_ref)


def prefetched_count(spec: Any) -> int:
  """k of a spec's `pl.Buffered(..., prefetched_count=k)`; 0 without one."""
  return int(getattr(getattr(spec, "pipeline_mode", None), "prefetched_count", 0) or 0)


def buffer_count(spec: Any) -> int:
  count = getattr(getattr(spec, "pipeline_mode", None), "buffer_count", 2)
  return int(count) if isinstance(count, int) else 2


@dataclasses.dataclass(frozen=True)
class Prefetched:
  """An input's prefetched window, checked against its block buffer."""
  window: Any
  count: int
  slots: str   # "whole", "leading" or "flat"
  block: int   # elements per slot of a flat window

  def slot(self, fetch: Any) -> Any:
    """The block in slot `fetch` (clamped into the prefetched slots)."""
    f = jnp.minimum(jnp.asarray(fetch, jnp.int32), self.count - 1)
    if self.slots == "whole":
      return self.window[...]
    if self.slots == "leading":
      return primitives.load(self.window, (f,) + (slice(None),) * (self.window.ndim - 1))
    return primitives.load(self.window, (primitives.ds(f * self.block, self.block),))


def bind(allocation: Any, spec: Any, buffer_shape: tuple[int, ...], where: str) -> Prefetched | None:
  """The prefetched window of an input (None where its spec prefetches nothing); a spec
  that prefetches without a bound window, or a window that does not hold its slots, is
  a clear error."""
  k = prefetched_count(spec)
  if k <= 0:
    return None
  window = allocation.window if isinstance(allocation, PrefetchedInputAllocation) else None
  if window is None:
    raise ValueError(
        f"{where}: Expected external window buffer to be bound for prefetched input "
        f"(prefetched_count={k}), but window_ref is None. Make the allocations with "
        f"emit_pipeline_with_allocations and call .with_window_ref(...) on this input's "
        f"allocation")
  shape, n = tuple(jax.typeof(window).shape), buffer_count(spec)
  block = 1
  for d in buffer_shape:
    block *= d
  if shape == tuple(buffer_shape):
    return Prefetched(window, k, "whole", block)
  if k >= n:
    raise PalletError(f"{where}: prefetched_count must be less than buffer_count for "
                      f"non-trivial windowing, got prefetched_count={k} and buffer_count={n}")
  if len(shape) > 1 and shape[1:] == tuple(buffer_shape) and shape[0] >= k:
    return Prefetched(window, k, "leading", block)
  if len(shape) == 1 and len(buffer_shape) == 1 and shape[0] == n * block:
    return Prefetched(window, k, "flat", block)
  raise PalletError(f"{where}: the prefetched window has shape {shape}; for blocks of shape "
                    f"{tuple(buffer_shape)} and buffer_count={n} expected {tuple(buffer_shape)}, "
                    f"({n}, {', '.join(map(str, buffer_shape))}) or, for 1-D blocks, "
                    f"({n * block},)")

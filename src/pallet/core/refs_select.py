"""`pl.select_ref(idx, *refs)`: one of several refs of the same type, picked by a
runtime scalar.

The selection is a view: reading it reads the chosen ref, writing it writes the
chosen ref and nothing else. Reads are computed from every candidate and
selected with `jnp.where`; writes run under `pl.when(idx == k)`, so each backend
needs only ordinary reads, writes and conditionals. An index outside
`[0, len(refs))` is clamped (as `lax.switch` does); a static index returns the
chosen ref itself.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallet.core import primitives


class SelectedRef:
  """A ref chosen at run time among `refs` by the int32 scalar `index`."""

  def __init__(self, index: jax.Array, refs: tuple[Any, ...]):
    self.index = index
    self.refs = refs

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.refs[0].shape)

  @property
  def dtype(self) -> Any:
    return self.refs[0].dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def at(self) -> "_SelectedIndexer":
    """`sel.at[idx]`: the same selection over `ref.at[idx]` of every candidate."""
    return _SelectedIndexer(self)

  def reshape(self, *shape: Any) -> "SelectedRef":
    """The same selection over `ref.reshape(*shape)` of every candidate."""
    return SelectedRef(self.index, tuple(r.reshape(*shape) for r in self.refs))

  def bitcast(self, dtype: Any) -> "SelectedRef":
    """The same selection over `ref.bitcast(dtype)` of every candidate."""
    return SelectedRef(self.index, tuple(r.bitcast(dtype) for r in self.refs))

  def read(self, fn: Callable[[Any], jax.Array]) -> jax.Array:
    """`fn(chosen ref)`, for a reading `fn` (evaluated on every candidate)."""
    values = [fn(r) for r in self.refs]
    out = values[0]
    for k, v in enumerate(values[1:], start=1):
      out = jnp.where(self.index == k, v, out)
    return out

  def write(self, fn: Callable[[Any], None]) -> None:
    """Runs the writing `fn` on the chosen ref only."""
    for k, r in enumerate(self.refs):
      primitives.when(self.index == k)(lambda r=r: fn(r))

  def __getitem__(self, key: Any) -> jax.Array:
    return self.read(lambda r: r[key])

  def __setitem__(self, key: Any, value: Any) -> None:
    def store(r):
      r[key] = value
    self.write(store)

  def __repr__(self) -> str:
    return f"SelectedRef(index={self.index}, {len(self.refs)} refs of {self.shape} {self.dtype})"


class _SelectedIndexer:
  def __init__(self, selected: SelectedRef):
    self._selected = selected

  def __getitem__(self, key: Any) -> SelectedRef:
    s = self._selected
    return SelectedRef(s.index, tuple(r.at[key] for r in s.refs))


def select_ref(idx: Any, *refs: Any) -> Any:
  """The ref `refs[idx]`, with `idx` a (traced) integer scalar, as a ref view."""
  if len(refs) < 2:
    raise ValueError(f"pl.select_ref needs at least two refs, got {len(refs)}")
  kinds = {(tuple(r.shape), jnp.dtype(r.dtype)) for r in refs}
  if len(kinds) != 1:
    raise TypeError(f"pl.select_ref: the refs must share shape and dtype, got "
                    f"{sorted(f'{d}{list(s)}' for s, d in kinds)}")
  if isinstance(idx, (int, np.integer)):
    return refs[min(max(int(idx), 0), len(refs) - 1)]
  idx = jnp.asarray(idx)
  if idx.shape != () or not jnp.issubdtype(idx.dtype, jnp.integer):
    raise TypeError(f"pl.select_ref: the index must be an integer scalar, got "
                    f"{idx.dtype}{list(idx.shape)}")
  return SelectedRef(jnp.clip(idx.astype(jnp.int32), 0, len(refs) - 1), tuple(refs))

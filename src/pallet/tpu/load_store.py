"""`pltpu.load` / `pltpu.store`: whole-ref reads and writes with an optional mask.

The TPU signatures take no index (index with `ref.at[...]` first). They are
pallet's masked load and store with the index left out; they also accept a
`pl.select_ref` selection.
"""
from __future__ import annotations

from typing import Any

import jax

from pallet.core import primitives
from pallet.core.refs_select import SelectedRef


def load(ref: Any, *, mask: jax.Array | None = None) -> jax.Array:
  """`ref[...]`; where `mask` is False the value is unspecified (pallet gives 0)."""
  if isinstance(ref, SelectedRef):
    return ref.read(lambda r: load(r, mask=mask))
  return primitives.load(ref, None, mask=mask)


def store(ref: Any, val: jax.Array, *, mask: jax.Array | None = None) -> None:
  """`ref[...] = val` where `mask` is True; elements where it is False keep their value."""
  if isinstance(ref, SelectedRef):
    ref.write(lambda r: store(r, val, mask=mask))
    return
  primitives.store(ref, None, val, mask=mask)

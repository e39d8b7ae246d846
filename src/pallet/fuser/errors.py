"""The error a fusion pallet cannot express raises, and the notes `fuse(debug=True)` prints."""
from __future__ import annotations

import threading
from typing import Any

from pallet import _internals


class UnfusibleError(NotImplementedError):
  """A block spec cannot be carried through an operation of a fusion.

  `fuse` catches it and materializes the value instead (computed outside the kernel).
  """

  def __init__(self, primitive: str, reason: str, eqn: Any = None):
    where = ""
    if eqn is not None and (src := _internals.equation_source(eqn)) is not None:
      where = f" (at {src[0]}:{src[1]})"
    super().__init__(f"fuser: cannot carry a block spec through `{primitive}`{where}: {reason}")
    self.primitive = primitive
    self.reason = reason


class UnfusibleValueError(UnfusibleError, ValueError):
  """An UnfusibleError where Pallas raises ValueError (conflicting blocks)."""


class _Debug(threading.local):
  on: bool = False


_debug = _Debug()


def set_debug(on: bool) -> bool:
  previous, _debug.on = _debug.on, on
  return previous


def note(message: str) -> None:
  """Prints a note about a fusion decision when running under `fuse(debug=True)`."""
  if _debug.on:
    print(f"[pallet.fuser] {message}")

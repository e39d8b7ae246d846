"""The error a fusion pallet cannot express raises (defined in pallet/errors.py with
every other error type), and the notes `fuse(debug=True)` prints."""
from __future__ import annotations

import threading

from pallet.errors import UnfusibleError, UnfusibleValueError


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

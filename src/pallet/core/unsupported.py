"""Names of TPU-hardware-only operations, present so that kernels import cleanly.

Some Pallas TPU operations drive a unit of the chip directly (the matrix unit's
FIFOs, fp6 packing, the SparseCore). They have no meaning on a CPU device, so pallet
provides each name as an object that raises a `PalletError` saying so, naming the
kernel being traced and the user's source line, when it is used.
"""
from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from pallet.core import primitives
from pallet.errors import PalletError
from pallet.core.tracebacks import is_pallet_file



def _is_library_file(filename: str) -> bool:
  return (is_pallet_file(filename) or f"{os.sep}jax{os.sep}_src{os.sep}" in filename
          or filename.startswith(os.path.dirname(os.__file__)))


def call_site() -> tuple[str | None, str]:
  """(name of the kernel being traced or None, "file:line" of the user's call)."""
  frame = sys._getframe(1)
  while frame is not None and _is_library_file(frame.f_code.co_filename):
    frame = frame.f_back
  where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else "<unknown>"
  return primitives.current_kernel_name(), where


def describe_call_site() -> str:
  """"in kernel 'k' at file:line" or "at file:line, outside a kernel" for messages."""
  kernel, where = call_site()
  return f"in kernel '{kernel}' at {where}" if kernel else f"at {where}, outside a kernel"


class Unsupported:
  """Stands for an operation pallet cannot run; using it raises a clear error."""

  def __init__(self, qualified_name: str, reason: str, instead: str = ""):
    self._qualified_name = qualified_name
    self._reason = reason
    self._instead = instead
    self.__name__ = qualified_name.rsplit(".", 1)[-1]
    self.__doc__ = f"Not supported by pallet: {reason}."

  def _fail(self) -> NoReturn:
    instead = f"; {self._instead}" if self._instead else ""
    raise PalletError(f"{self._qualified_name} is not supported on this backend "
                      f"({self._reason}): used {describe_call_site()}{instead}")

  def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
    self._fail()

  def __getattr__(self, attr: str) -> Any:
    if attr.startswith("_"):   # introspection (copy, inspect, pytest) must still work
      raise AttributeError(attr)
    self._fail()

  def __getitem__(self, item: Any) -> NoReturn:
    self._fail()

  def __mro_entries__(self, bases: tuple) -> NoReturn:
    """`class MyRef(pltpu.BufferedRef)` (as some projects' modules do at import time)
    fails with this error, not with Python's about a non-class base."""
    self._fail()

  def __repr__(self) -> str:
    return f"<unsupported {self._qualified_name}>"


def tpu_hardware_only(name: str) -> Unsupported:
  return Unsupported(f"pltpu.{name}", "TPU hardware only")


# The TPU names in `jax.experimental.pallas.tpu` that only a TPU can execute.
TPU_HARDWARE_ONLY = (
    "matmul_push_rhs", "matmul_acc_lhs", "matmul_pop", "matmul_lhs_fifo",
    "matmul_pop_fifo", "pack_fp6", "unpack_fp6",
)

for _name in TPU_HARDWARE_ONLY:
  globals()[_name] = tpu_hardware_only(_name)
del _name

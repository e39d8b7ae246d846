"""Every error and warning type pallet defines, in one module.

Users reach them where Pallas has them: `pl.PalletError`, `pl.KernelCheckError`,
`pl.GridOrderWarning`, `pl.IndexBoundsWarning`, `pltpu.LoweringException`, `pallet.fuser.errors.UnfusibleError`;
each prints under that name.
"""
from __future__ import annotations

from typing import Any

from pallet import _internals


class PalletError(ValueError):
  """A kernel was launched with inputs or specs that do not fit together."""


PalletError.__module__ = "pallet"   # where users reach it: tracebacks print pallet.PalletError


class PalletSignatureError(PalletError, TypeError):
  """A kernel or index map takes another number of arguments than pallas_call passes
  it: a TypeError too, as calling it with them is in Pallas."""


class KernelCheckError(RuntimeError):
  """A run-time check inside a kernel failed (see `pl.debug_check` and checking mode).

  `kind` is one of `pallet.core.checks.KINDS` (None for pallet's own sanity checks), `kernel` the
  kernel's name, `grid_index` the grid step that failed (a tuple, None where not
  known), `ref` the kernel parameter involved, `line` the user's "file:line"."""

  def __init__(self, message: str, *, kind: str | None = None, kernel: str | None = None,
               grid_index: tuple[int, ...] | None = None, ref: str | None = None,
               line: str | None = None):
    super().__init__(message)
    self.kind, self.kernel, self.grid_index = kind, kernel, grid_index
    self.ref, self.line = ref, line


KernelCheckError.__module__ = "pallet"   # printed as users reach it: pallet.KernelCheckError


class GridOrderWarning(UserWarning):
  """A grid axis declared "parallel" carries state from one program to another."""


GridOrderWarning.__module__ = "pallet"   # printed as users reach it: pallet.GridOrderWarning


class IndexBoundsWarning(UserWarning):
  """An index known while tracing lies outside its ref, in a branch that may never run."""


IndexBoundsWarning.__module__ = "pallet"   # printed as users reach it


class LoweringException(Exception):
  """A kernel uses something the backend compiling it cannot express."""


LoweringException.__module__ = "pallet.tpu"   # printed as users reach it


class TritonLoweringError(NotImplementedError, LoweringException):
  """A kernel uses something the Triton backend cannot express (catchable as
  `pltpu.LoweringException`, as code written for JAX's Pallas expects)."""


TritonLoweringError.__module__ = "pallet.backends.triton"   # where users import it


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


UnfusibleError.__module__ = UnfusibleValueError.__module__ = "pallet.fuser.errors"

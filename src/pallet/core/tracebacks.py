"""Where the user's code is: errors and warnings point there, not into pallet.

A mistake in a kernel or its specs is found deep inside pallet (and JAX), seven to
nine frames below the user's call. JAX hides its own frames from the tracebacks of
exceptions that leave its API (`JAX_TRACEBACK_FILTERING`, on by default); pallet's
directory is registered with the same machinery, and its entry points
(`pallas_call`, and the function it returns) are such API boundaries, so a
traceback ends at the user's line. Warnings are attributed to the innermost frame of
the user's code, whatever depth pallet found them at.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Callable, TypeVar

import jax

from pallet import _internals as internals

PALLET_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # src/pallet
# pallet.bench, the benchmark suite, is user code to pallet: errors point at its kernels.
BENCH_DIR = os.path.join(PALLET_DIR, "bench")
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__))
_STDLIB_DIR = os.path.dirname(os.path.abspath(contextlib.__file__))
# JAX's kernel library is user code for pallet (benchmarks/jax_ops runs it).
_JAX_KERNELS_DIR = os.path.join(_JAX_DIR, "experimental", "pallas", "ops")

for _entry in sorted(os.listdir(PALLET_DIR)):
  if _entry != "bench":
    internals.hide_from_tracebacks(os.path.join(PALLET_DIR, _entry))
# pallet's context managers leave a frame of contextlib's between the user's and pallet's
internals.hide_from_tracebacks(contextlib.__file__)

F = TypeVar("F", bound=Callable)


def api_boundary(fn: F) -> F:
  """`fn`, whose exceptions leave with pallet's and JAX's frames filtered out."""
  return internals.api_boundary(fn)


def is_pallet_file(path: str) -> bool:
  """Whether `path` is pallet's own code (pallet.bench excepted: benchmarks are user code)."""
  path = os.path.abspath(path)
  return path.startswith(PALLET_DIR) and not path.startswith(BENCH_DIR + os.sep)


def is_user_file(path: str) -> bool:
  """Whether `path` is the user's code: outside pallet, JAX (but for JAX's kernel
  library) and the standard library."""
  if path.startswith("<"):          # generated code (dataclass methods, exec)
    return False
  path = os.path.abspath(path)
  if is_pallet_file(path) or path.startswith(_STDLIB_DIR):
    return False
  return not path.startswith(_JAX_DIR) or path.startswith(_JAX_KERNELS_DIR)


def warn(message: str, category: type[Warning]) -> None:
  """`warnings.warn(message, category)` attributed to the innermost frame of the
  user's code on the stack (as `stacklevel` would, at a depth pallet cannot know)."""
  frame = sys._getframe(1)
  while frame is not None and not is_user_file(frame.f_code.co_filename):
    frame = frame.f_back
  if frame is None:
    warnings.warn(message, category, stacklevel=2)
    return
  module_globals = frame.f_globals
  registry = module_globals.setdefault("__warningregistry__", {})
  warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                         module=module_globals.get("__name__", "<unknown>"), registry=registry)

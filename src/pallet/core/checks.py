"""Run-time checks inside kernels: `pl.debug_check`, `pl.enable_debug_checks`,
`pl.enable_poison_buffers`, and the `check_p` primitive they stand on.

`check_p` takes a boolean scalar or array `ok` and a static `message` that
already names the kernel and the user's source line; the kernel fails at run
time, with that message, when any element of `ok` is False. pallet's own
sanity checks (an unsatisfiable semaphore wait, ...) bind it too: build the
message with `failure_message`.

Checking mode (pallet/checking) does not bind it inside kernels: its checks record
failures in an output of the kernel that the host reads after the call
(checking/report.py). It binds it outside kernels with a static `CheckInfo` (kind,
ref, source line) and a payload of the grid indices and one detail value, so that the
`KernelCheckError` it raises names the grid step that failed.

Backend rules:
  * XLA (here): a host callback, run only when the check fails, that raises (the
    error reaches the caller wrapped by JAX's runtime as an XlaRuntimeError/
    JaxRuntimeError carrying the message; eager checked calls re-raise the
    `KernelCheckError` itself, see `pop_failure`).
  * Triton (backends/triton/codegen.py, `_pallet_check`): the kernel sets a flag
    per check (the first failing program, for checks with a `CheckInfo`); the
    launcher raises with the message after the launch.
With checks disabled, `debug_check` emits nothing at all.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import threading
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallet import _internals as internals
from pallet.core.grid_context import current_kernel_name
from pallet.core.tracebacks import is_pallet_file
from pallet.errors import KernelCheckError


class _Switch:
  """An on/off setting used like JAX's config states: `pl.enable_debug_checks(True)`
  turns it on; `with pl.enable_debug_checks(True):` turns it on for the block and
  restores the previous value afterwards. Kernels read it when they are traced; it
  is part of JAX's jit key, so jitted callers are traced again when it changes."""

  def __init__(self, name: str, env_var: str, help: str):
    self._name = name
    self._state = internals.bool_trace_setting(env_var.lower(), help)

  @property
  def value(self) -> bool:
    return bool(self._state.value)

  def __call__(self, enabled: bool = True) -> contextlib.AbstractContextManager:
    previous = self.value
    internals.set_setting(self._state, bool(enabled))
    return self._restore_on_exit(previous)

  @contextlib.contextmanager
  def _restore_on_exit(self, previous: bool) -> Iterator[None]:
    try:
      yield
    finally:
      internals.set_setting(self._state, previous)

  def __bool__(self) -> bool:
    return self.value

  def __repr__(self) -> str:
    return f"pl.{self._name}(currently {self.value})"


enable_debug_checks = _Switch("enable_debug_checks", "PALLET_DEBUG_CHECKS",
                              "pl.debug_check raises at run time (pallet)")
enable_poison_buffers = _Switch("enable_poison_buffers", "PALLET_POISON_BUFFERS",
                                "uninitialised kernel memory is filled with NaN/int-min (pallet)")


allow_unwritten_outputs = _Switch(
    "allow_unwritten_outputs", "PALLET_ALLOW_UNWRITTEN_OUTPUTS",
    "checking mode does not report output elements no program wrote (pallet)")
# pallas_calls traced while it is on may leave parts of their outputs unwritten on
# purpose (their caller masks them): for calls inside code you cannot change (your own
# calls can pass InterpretParams(detect_unwritten_outputs=False)).


def debug_checks_enabled() -> bool:
  return enable_debug_checks.value


def poison_buffers_enabled() -> bool:
  """pallet's switch, or JAX's own `jax_pallas_poison_buffers` flag (which Pallas
  code and tests set with `jax.config.update` or `jtu.with_config`)."""
  return enable_poison_buffers.value or internals.jax_flag("jax_pallas_poison_buffers")


# ------------------------------------------------------------------ messages
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__))
_STDLIB_DIR = os.path.dirname(os.path.abspath(contextlib.__file__))
# JAX's kernel library is user code for pallet (benchmarks/jax_ops runs it).
_JAX_KERNELS_DIR = os.path.join(_JAX_DIR, "experimental", "pallas", "ops")


def user_source() -> str:
  """"file:line" of the innermost caller outside pallet, JAX and the standard library."""
  frame = sys._getframe(1)
  while frame is not None:
    path = os.path.abspath(frame.f_code.co_filename)
    internal = (is_pallet_file(path) or path.startswith(_STDLIB_DIR)
                or (path.startswith(_JAX_DIR) and not path.startswith(_JAX_KERNELS_DIR)))
    if not internal and not path.startswith("<frozen"):
      return f"{path}:{frame.f_lineno}"
    frame = frame.f_back
  return "<unknown>"


def failure_message(what: str, message: str) -> str:
  """A check's message naming the kernel being traced and the user's source line."""
  name = current_kernel_name()
  where = f"kernel '{name}'" if name else "code outside a kernel"
  return f"{what} failed in {where} at {user_source()}: {message}"


KINDS = ("out_of_bounds", "uninitialized", "race", "nan", "overflow", "unwritten",
         "debug_check", "index_map", "hang", "deadlock", "aliasing")


@dataclasses.dataclass(frozen=True)
class CheckInfo:
  """What a checking-mode check reports besides its message; static."""
  kind: str
  kernel: str
  ref: str | None
  line: str
  grid: tuple[int | None, ...]   # the kernel's grid, to turn a flat index into indices
  detail: str = ""               # names the payload's detail value ("" = none)

  def error(self, message: str, grid_index: tuple[int, ...] | None,
            detail: int | None = None) -> KernelCheckError:
    if not self.kind:    # one of pallet's own sanity checks: its message says it all
      return KernelCheckError(message, kernel=self.kernel, grid_index=grid_index,
                              line=self.line)
    text = (f"{self.kind} in kernel '{self.kernel}' at grid index {grid_index}"
            + (f", ref '{self.ref}'" if self.ref else "") + f", {self.line}: {message}")
    if self.detail and detail is not None and detail != -2**31:   # -2**31: not known
      text += f" ({self.detail} {detail})"
    return KernelCheckError(text, kind=self.kind, kernel=self.kernel,
                            grid_index=grid_index, ref=self.ref, line=self.line)

  def unravel(self, flat: int) -> tuple[int, ...]:
    """Grid indices of the flat (row-major) step `flat` (static grids only)."""
    out = []
    for n in reversed(self.grid):
      out.append(int(flat % n) if n else 0)
      flat = flat // n if n else flat
    return tuple(reversed(out))


class CheckMessage(str):
  """A check's message carrying its `CheckInfo` (or None) for the Triton launchers."""
  info: CheckInfo | None

  def __new__(cls, message: str, info: CheckInfo | None):
    self = super().__new__(cls, message)
    self.info = info
    return self


# Failures raised inside host callbacks, so that eager checked calls can re-raise the
# KernelCheckError itself instead of JAX's runtime error that wraps it.
_failures: list[KernelCheckError] = []
_failures_lock = threading.Lock()


def record_failure(error: KernelCheckError) -> KernelCheckError:
  with _failures_lock:
    _failures.append(error)
    del _failures[:-16]
  return error


def pop_failure(runtime_error: BaseException) -> KernelCheckError | None:
  """The KernelCheckError whose message `runtime_error` (JAX's wrapper) carries."""
  text = str(runtime_error)
  with _failures_lock:
    for i in range(len(_failures) - 1, -1, -1):
      if str(_failures[i]) in text:
        return _failures.pop(i)
  return None


# ------------------------------------------------------------------ check_p
check_p = Primitive("pallet_check")
check_p.multiple_results = True


def check(ok: Any, message: str, info: CheckInfo | None = None,
          payload: tuple[Any, ...] = ()) -> None:
  """Fails the kernel at run time with `message` where `ok` is False. With `info`,
  `payload` holds the grid indices then one detail value (int32 scalars)."""
  payload = tuple(jnp.asarray(p, jnp.int32) for p in payload)
  check_p.bind(jnp.asarray(ok, jnp.bool_), *payload, message=message, info=info,
               batch_ndim=0)


check_p.def_effectful_abstract_eval(
    lambda ok, *payload, message, info, batch_ndim: ([], {internals.debug_effect}))


def _raise_unless(ok: Any, *payload: Any, message: str, info: CheckInfo | None) -> None:
  ok = np.asarray(ok)
  if ok.all():
    return
  if info is None:
    raise record_failure(KernelCheckError(message))
  first = int(np.argmin(ok.reshape(-1)))   # the first failing batch member
  values = [int(np.asarray(p).reshape(-1)[first]) if np.ndim(p) else int(p) for p in payload]
  *ids, detail = values
  raise record_failure(info.error(message, tuple(ids), detail))


def _check_impl(ok, *payload, message, info, batch_ndim):
  # Reduced to one flag per batch member; the host is called only on a failure.
  ok = jnp.all(ok.reshape(ok.shape[:batch_ndim] + (-1,)), axis=-1)
  payload = [jnp.broadcast_to(p, ok.shape) for p in payload]
  lax.cond(jnp.all(ok), lambda *_: None,
           lambda ok, *payload: jax.debug.callback(
               functools.partial(_raise_unless, message=message, info=info), ok, *payload),
           ok, *payload)
  return []


check_p.def_impl(_check_impl)
mlir.register_lowering(check_p, mlir.lower_fun(_check_impl, multiple_results=True))


def _check_batch(args, dims, *, message, info, batch_ndim):
  # Batch dimensions go in front of `ok` and of the payload (which has only those),
  # so the failing batch member's payload can be picked out.
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  moved = [jnp.moveaxis(a, d, 0) if d is not None else
           jnp.broadcast_to(a, (size,) + a.shape) for a, d in zip(args, dims)]
  check_p.bind(*moved, message=message, info=info, batch_ndim=batch_ndim + 1)
  return [], []


batching.primitive_batchers[check_p] = _check_batch


def _check_jvp(primals, tangents, *, message, info, batch_ndim):
  check_p.bind(*primals, message=message, info=info, batch_ndim=batch_ndim)
  return [], []


ad.primitive_jvps[check_p] = _check_jvp


# ------------------------------------------------------------------ user-facing
def debug_check(condition: Any, message: str) -> None:
  """Fails the kernel at run time with `message` (plus the kernel name and source
  line) where `condition` is False, when `pl.enable_debug_checks` was on while the
  kernel was traced; emits nothing otherwise."""
  if not enable_debug_checks.value:
    return
  check(condition, failure_message("pl.debug_check", str(message)))


def uninitialized(shape: tuple[int, ...], dtype: Any, *, poison: bool | None = None) -> jax.Array:
  """Contents for memory a kernel must write before reading: zeros, or with
  poisoning on (default: `pl.enable_poison_buffers`) NaN for floats, the minimum
  for integers and True for booleans, so a read before a write shows. Typed PRNG
  keys are never poisoned: every key data is a valid key."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return jnp.zeros(shape, dtype)
  return jnp.full(shape, fill_value(dtype, poison=poison), jnp.dtype(dtype))


def fill_value(dtype: Any, *, poison: bool | None = None) -> Any:
  """The value of memory that holds no data (see `uninitialized`), as a scalar."""
  dtype = jnp.dtype(dtype)
  if not (poison_buffers_enabled() if poison is None else poison):
    return dtype.type(0)
  if jnp.issubdtype(dtype, jnp.inexact):
    return dtype.type(float("nan"))
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.iinfo(dtype).min
  return True

"""Run-time checks inside kernels: `pl.debug_check`, `pl.enable_debug_checks`,
`pl.enable_poison_buffers`, and the `check_p` primitive they stand on.

`check_p` takes a boolean scalar or array `ok` and a static `message` that
already names the kernel and the user's source line; the kernel fails at run
time, with that message, when any element of `ok` is False. pallet's own
sanity checks (an unsatisfiable semaphore wait, ...) bind it too: build the
message with `failure_message`.

Backend rules:
  * XLA (here): a host callback that raises (the error reaches the caller wrapped
    by JAX's runtime as an XlaRuntimeError/JaxRuntimeError carrying the message).
  * Triton (backends/triton/codegen.py, `_pallet_check`): the kernel sets a flag
    per check; the launcher raises with the message after the launch.
With checks disabled, `debug_check` emits nothing at all.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallet import _internals as internals
from pallet import primitives


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


def debug_checks_enabled() -> bool:
  return enable_debug_checks.value


def poison_buffers_enabled() -> bool:
  return enable_poison_buffers.value


# ------------------------------------------------------------------ messages
_PALLET_DIR = os.path.dirname(os.path.abspath(__file__))
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__))
_STDLIB_DIR = os.path.dirname(os.path.abspath(contextlib.__file__))
# JAX's kernel library is user code for pallet (benchmarks/jax_ops runs it).
_JAX_KERNELS_DIR = os.path.join(_JAX_DIR, "experimental", "pallas", "ops")


def user_source() -> str:
  """"file:line" of the innermost caller outside pallet, JAX and the standard library."""
  frame = sys._getframe(1)
  while frame is not None:
    path = os.path.abspath(frame.f_code.co_filename)
    internal = (path.startswith(_PALLET_DIR) or path.startswith(_STDLIB_DIR)
                or (path.startswith(_JAX_DIR) and not path.startswith(_JAX_KERNELS_DIR)))
    if not internal and not path.startswith("<frozen"):
      return f"{path}:{frame.f_lineno}"
    frame = frame.f_back
  return "<unknown>"


def failure_message(what: str, message: str) -> str:
  """A check's message naming the kernel being traced and the user's source line."""
  name = primitives.current_kernel_name()
  where = f"kernel '{name}'" if name else "code outside a kernel"
  return f"{what} failed in {where} at {user_source()}: {message}"


class KernelCheckError(RuntimeError):
  """A run-time check inside a kernel failed (see `pl.debug_check`)."""


# ------------------------------------------------------------------ check_p
check_p = Primitive("pallet_check")
check_p.multiple_results = True


def check(ok: Any, message: str) -> None:
  """Fails the kernel at run time with `message` where `ok` is False."""
  check_p.bind(jnp.asarray(ok, jnp.bool_), message=message)


check_p.def_effectful_abstract_eval(lambda ok, *, message: ([], {internals.debug_effect}))


def _raise_unless(ok: Any, *, message: str) -> None:
  if not bool(ok):
    raise KernelCheckError(message)


def _check_impl(ok, *, message):
  jax.debug.callback(lambda v: _raise_unless(v, message=message), jnp.all(ok))
  return []


check_p.def_impl(_check_impl)
mlir.register_lowering(check_p, mlir.lower_fun(_check_impl, multiple_results=True))


def _check_batch(args, dims, *, message):
  # Every element of every batch member must hold: the batched `ok` is checked whole.
  check_p.bind(args[0], message=message)
  return [], []


batching.primitive_batchers[check_p] = _check_batch


def _check_jvp(primals, tangents, *, message):
  check_p.bind(*primals, message=message)
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
  for integers and True for booleans, so a read before a write shows."""
  dtype = jnp.dtype(dtype)
  if not (enable_poison_buffers.value if poison is None else poison):
    return jnp.zeros(shape, dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.full(shape, jnp.nan, dtype)
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.full(shape, jnp.iinfo(dtype).min, dtype)
  return jnp.ones(shape, dtype)

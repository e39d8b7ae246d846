"""Backends: each consumes a `KernelDescription` through one small interface.

A backend is a module with `NAME` and
`lower(ctx, *args, kernel: KernelDescription, interpret: bool) -> list`,
the MLIR lowering of one `pallas_call`. Backends never import each other.

Which backend runs a call (first rule that applies):

1. `pallas_call(..., backend=...)`;
2. the global override: the innermost `pallet.default_backend(name)` block, else the
   environment variable `PALLET_BACKEND` ("xla" or "triton");
3. `interpret=True`: the XLA backend (the CPU meaning of Pallas' interpret mode);
4. where a GPU is present, `triton` for kernels launched with `pallet.triton`'s
   compiler params, the neutral `pl.CompilerParams` or none (as JAX >= 0.9.1 picks
   its GPU lowering from the params), and `xla` for kernels written for another
   target (TPU params: DMAs and semaphores run on the XLA backend only);
   without a GPU, `xla`.

With the override set to "triton" and no GPU, calls run the generated Triton code
under Triton's interpreter. The override is part of JAX's trace context, so a
function jitted outside a `default_backend` block is traced again inside it.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any, Iterator

import jax

from pallet import _internals as internals

_MODULES = {"xla": "pallet.backends.xla", "triton": "pallet.backends.triton"}
_ALIASES = {"cpu": "xla", "interpret": "xla", "xla": "xla", "triton": "triton",
            "gpu": "triton"}
ENV_VAR = "PALLET_BACKEND"
TRITON_INSTALL = 'pip install "pallet[triton]"'

# (backend name, interpret or None), or the raw string of $PALLET_BACKEND, or None.
_override = internals.trace_context_state(
    ENV_VAR.lower(), "pallet's global backend override (see pallet.default_backend)")


def names() -> list[str]:
  """Every backend pallet has, whether or not it can run here."""
  return sorted(_MODULES)


def triton_installed() -> bool:
  # (a directory named `triton` on sys.path is found as a namespace package: no origin)
  spec = importlib.util.find_spec("triton")
  return spec is not None and spec.origin is not None


def unavailable_reason(name: str) -> str | None:
  """Why backend `name` cannot run kernels in this process, or None when it can."""
  if canonical(name) != "triton":
    return None
  if not triton_installed():
    return f"the triton package is not installed: {TRITON_INSTALL}"
  if not gpu_present() and not triton_interpreter_on():
    return ("no GPU here, and Triton's interpreter is off (start Python with "
            "TRITON_INTERPRET=1 to run kernels with interpret=True)")
  return None


def available() -> list[str]:
  """The backends that can run kernels in this process."""
  return [n for n in names() if unavailable_reason(n) is None]


def gpu_present() -> bool:
  try:
    return any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices())
  except RuntimeError:
    return False


def triton_interpreter_on() -> bool:
  """Whether this process asked for Triton's interpreter (TRITON_INTERPRET, which Triton
  reads once, when it is first imported)."""
  return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def generated_code_on_gpu() -> bool:
  """Whether Triton kernels made here run as compiled code on a GPU, not interpreted."""
  return gpu_present() and not triton_interpreter_on()


def canonical(name: str) -> str:
  """The backend a name or alias stands for ("gpu" -> "triton")."""
  key = str(name).strip().lower()
  if key not in _ALIASES:
    raise ValueError(f"unknown pallet backend {name!r}; available: {names()} "
                     f"(aliases: {sorted(_ALIASES)})")
  return _ALIASES[key]


def override() -> tuple[str, bool | None] | None:
  """The global override in force: (backend, interpret or None), or None."""
  value = _override.value
  if value is None or value == "":
    return None
  if isinstance(value, str):       # from the environment
    try:
      return canonical(value), None
    except ValueError as e:
      raise ValueError(f"environment variable {ENV_VAR}={value!r}: {e}") from None
  return value


@contextlib.contextmanager
def default_backend(name: str | None, interpret: bool | None = None) -> Iterator[None]:
  """Runs every `pallas_call` made inside the block on backend `name` ("xla",
  "triton"), unless the call names its own `backend=`.

  `interpret` (Triton only): None runs compiled kernels where a GPU is present and
  Triton's interpreter elsewhere; True always interprets. `name=None` lifts an
  outer override (or $PALLET_BACKEND) inside the block.
  """
  value = None if name is None else (canonical(name), interpret)
  if interpret is not None and not isinstance(interpret, bool):
    raise TypeError(f"pallet.default_backend: interpret must be None, True or False, "
                    f"got {interpret!r}")
  with _override(value):
    yield


def _gpu_params(params: Any) -> bool:
  """Whether a kernel's compiler params are ones a GPU kernel is launched with."""
  from pallet.triton.gpu_target import CompilerParams as TritonParams
  from pallet.core.specs import CompilerParams as NeutralParams
  return (params is None or isinstance(params, (TritonParams, dict))
          or type(params) is NeutralParams)


def resolve(name: str | None, interpret: bool,
            compiler_params: Any = None) -> tuple[str, bool]:
  """(backend, interpret) for a call; see the module docstring for the rules."""
  if name is not None:
    backend = canonical(name)
    return backend, _checked_on_gpu(backend, interpret)
  forced = override()
  if forced is not None:
    backend, forced_interpret = forced
    if backend == "triton":
      if forced_interpret is None:
        forced_interpret = bool(interpret) or not gpu_present()
      return backend, _checked_on_gpu(backend, forced_interpret)
    return backend, interpret
  if interpret:
    return "xla", interpret
  if gpu_present() and _gpu_params(compiler_params):
    return "triton", False
  return "xla", False


def _checked_on_gpu(backend: str, interpret: Any) -> Any:
  """`interpret=InterpretParams(...)` on the Triton backend asks for the checking mode
  (pallet/checking), whose checks are compiled into the generated kernel: where a GPU is
  present and this process did not switch Triton's interpreter on, the checked kernel runs
  on the GPU, so both report the same bug. A plain `interpret=True` always interprets."""
  if backend != "triton" or isinstance(interpret, bool) or not interpret:
    return interpret
  return False if generated_code_on_gpu() else interpret


def get(name: str, kernel: Any = None) -> ModuleType:
  """The module of backend `name`, to compile or run `kernel` (a KernelDescription)."""
  if name == "triton" and not triton_installed():
    from pallet.errors import PalletError
    what = f"kernel '{kernel.name}' ({kernel.source})" if kernel is not None else "a kernel"
    raise PalletError(f"{what} runs on the Triton backend (backend='triton'), which needs "
                      f"the triton package, not installed here: {TRITON_INSTALL} (or run "
                      f"it on the XLA backend: backend='xla')")
  return importlib.import_module(_MODULES[name])

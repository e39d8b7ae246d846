"""The Pallas implementations a generated kernel is built against.

A kernel body is written once against `api.pl` / `api.pltpu` / `api.plgpu`; `api.pallas_call`
adds the options that pick the implementation (pallet's backend, JAX's interpreter).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from types import ModuleType
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Api:
  """One implementation of the Pallas API."""
  name: str
  pl: ModuleType
  pltpu: ModuleType
  plgpu: ModuleType
  call_options: dict[str, Any]

  @property
  def is_pallet(self) -> bool:
    return self.name.startswith("pallet")

  def pallas_call(self, kernel: Callable[..., None], out_shape: Any, **kwargs: Any) -> Callable:
    return self.pl.pallas_call(kernel, out_shape, **self.call_options, **kwargs)


BACKENDS = ("xla", "triton")


@functools.lru_cache(maxsize=None)
def pallet_api(backend: str, poisoned: bool = False) -> Api:
  """pallet on `backend`; Triton runs under its interpreter unless a GPU is present.
  `poisoned` runs the XLA backend with `interpret=True` (fresh memory poisoned)."""
  if backend not in BACKENDS:
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
  import pallet
  import pallet.tpu
  import pallet.triton
  options: dict[str, Any] = {"backend": backend}
  if backend == "triton":
    from pallet.backends import generated_code_on_gpu
    options["interpret"] = not generated_code_on_gpu()
  elif poisoned:
    options["interpret"] = True
  name = f"pallet-{backend}" + ("-interpret" if poisoned and backend == "xla" else "")
  return Api(name, pallet, pallet.tpu, pallet.triton, options)


@functools.lru_cache(maxsize=None)
def jax_api(tpu_interpreter: bool) -> Api:
  """JAX's Pallas interpreter: `interpret=True` (the discharge interpreter), or with
  `pltpu.InterpretParams()` (the TPU interpreter, for DMAs, semaphores and
  `emit_pipeline`)."""
  from jax.experimental import pallas
  from jax.experimental.pallas import tpu as pallas_tpu
  from jax.experimental.pallas import triton as pallas_triton
  if tpu_interpreter:
    _describe_cpu_as_a_tpu()
    return Api("jax-tpu-interpreter", pallas, pallas_tpu, pallas_triton,
               {"interpret": pallas_tpu.InterpretParams()})
  return Api("jax-interpreter", pallas, pallas_tpu, pallas_triton, {"interpret": True})


def _describe_cpu_as_a_tpu() -> None:
  """JAX's emit_pipeline asks for the chip's description even when interpreted; on a
  CPU it has none, so register a one-core TPU v5e for the CPU device kind."""
  try:
    from jax._src import tpu_info
  except ImportError:  # JAX 0.10
    from jax._src.pallas.mosaic import tpu_info
  import jax
  kind = jax.devices()[0].device_kind
  tpu_info.registry.setdefault(
      kind, lambda: tpu_info._get_tpu_info_impl(tpu_info.ChipVersion.TPU_V5E, 1))


def triton_interpreter_ready() -> bool:
  """Triton's interpreter reads TRITON_INTERPRET when triton is first imported."""
  return os.environ.get("TRITON_INTERPRET", "") == "1"

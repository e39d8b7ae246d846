"""Triton-flavoured names (`jax.experimental.pallas.triton`): compiler params, masked
loads/stores and atomics, usable on every backend; and `source`, the Triton code
the Triton backend generates for a kernel call."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from pallet.primitives import (atomic_add, atomic_and, atomic_cas, atomic_max, atomic_min,
                               atomic_or, atomic_xchg, atomic_xor, load, store)
from pallet.specs import CompilerParams as _BaseCompilerParams


@dataclasses.dataclass(frozen=True)
class CompilerParams(_BaseCompilerParams):
  """Launch parameters of the Triton backend (ignored by the CPU backend).

  `compute_capability` (e.g. 80, 90) or `gpu_arch` (e.g. "gfx942") pick the target
  to compile for when no GPU is visible (ahead-of-time lowering); by default the
  target is device 0's.
  """
  num_warps: int | None = None
  num_stages: int | None = None
  compute_capability: int | None = None
  gpu_arch: str | None = None


TritonCompilerParams = CompilerParams


def source(kernel_call: Callable[..., Any], *args: Any) -> str:
  """The Triton source generated for `kernel_call(*args)`, a `pallas_call(...)` result.

  Works on any machine (nothing is compiled or run). With several pallas_calls
  inside `kernel_call`, their sources are concatenated in call order.
  """
  from pallet.backends.triton import generated
  from pallet.pallas_call import pallas_call_p
  from jax.extend.core import jaxprs_in_params

  def subjaxprs(eqn):
    return [j.jaxpr if hasattr(j, "jaxpr") else j for j in jaxprs_in_params(eqn.params)]

  jaxpr = jax.make_jaxpr(kernel_call)(*args)
  kernels = []

  def collect(j):
    for eqn in j.eqns:
      if eqn.primitive is pallas_call_p:
        kernels.append(eqn.params["kernel"])
      else:
        for sub in subjaxprs(eqn):
          collect(sub)

  collect(jaxpr.jaxpr)
  if not kernels:
    raise ValueError("pallet.triton.source: the function launches no pallas_call")
  return "\n\n".join(generated(k).source for k in kernels)

"""The CPU/XLA backend: kernels compiled by XLA as ordinary array programs.

Pipeline: `plan.make_plan` analyses the grid (what to vectorize, what to loop),
`executor.build` turns the kernel description into a pure JAX function, and
`lower` hands that function to XLA as the lowering of `pallas_call`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from jax.interpreters import mlir

from pallet.backends.xla.executor import build
from pallet.backends.xla.plan import ExecutionPlan, make_plan
from pallet.tracing import KernelDescription

NAME = "xla"


@functools.lru_cache(maxsize=512)
def _planned(kernel: KernelDescription) -> tuple[ExecutionPlan, Callable]:
  plan = make_plan(kernel)
  if kernel.debug:
    print(f"--- pallet xla plan for '{kernel.name}' ---\n{plan.describe()}")
  return plan, build(kernel, plan)


def kernel_as_function(kernel: KernelDescription) -> Callable[..., list[Any]]:
  """The kernel's result as a pure function of `(*prefetch, *inputs)`."""
  return _planned(kernel)[1]


def plan_of(kernel: KernelDescription) -> ExecutionPlan:
  return _planned(kernel)[0]


def lower(ctx: Any, *args: Any, kernel: KernelDescription, interpret: bool) -> list:
  del interpret  # the XLA backend is what interpret mode means on the CPU
  return mlir.lower_fun(kernel_as_function(kernel), multiple_results=True)(ctx, *args)

"""The CPU/XLA backend: kernels compiled by XLA as ordinary array programs.

Pipeline: `plan.make_plan` analyses the grid (what to vectorize, what to loop),
`executor.build` turns the kernel description into a pure JAX function, and
`lower` hands that function to XLA as the lowering of `pallas_call`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax.interpreters import mlir

from pallet.backends.xla.executor import build
from pallet.backends.xla.plan import ExecutionPlan, make_plan, vectorization_failure
from pallet.tracing import KernelDescription

NAME = "xla"


@functools.lru_cache(maxsize=512)
def _planned(kernel: KernelDescription) -> tuple[ExecutionPlan, Callable]:
  plan = make_plan(kernel)
  fn = build(kernel, plan)
  if plan.vectorized or plan.merged:
    # A cheap trial (shapes only): some primitives fail to batch, or batch to wrong
    # shapes; such kernels run with every axis looped instead of an opaque error.
    try:
      jax.eval_shape(fn, *_operand_avals(kernel))
    except Exception as e:  # noqa: BLE001 - any failure under vmap means: do not vmap
      plan = make_plan(kernel, unbatchable=vectorization_failure(e))
      fn = build(kernel, plan)
  if kernel.debug:
    print(f"--- pallet xla plan for '{kernel.name}' ---\n{plan.describe()}")
  return plan, fn


def _operand_avals(kernel: KernelDescription) -> list[jax.ShapeDtypeStruct]:
  gm = kernel.grid_mapping
  sizes = [jax.ShapeDtypeStruct((), "int32")] * len(gm.dynamic_axes)
  return sizes + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in gm.prefetch_avals] + [
      jax.ShapeDtypeStruct(b.array_shape, b.dtype) for b in gm.inputs]


def kernel_as_function(kernel: KernelDescription) -> Callable[..., list[Any]]:
  """The kernel's result as a pure function of `(*prefetch, *inputs)`."""
  return _planned(kernel)[1]


def plan_of(kernel: KernelDescription) -> ExecutionPlan:
  return _planned(kernel)[0]


def lower(ctx: Any, *args: Any, kernel: KernelDescription, interpret: bool) -> list:
  del interpret  # the XLA backend is what interpret mode means on the CPU
  return mlir.lower_fun(kernel_as_function(kernel), multiple_results=True)(ctx, *args)

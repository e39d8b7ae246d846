"""The CPU/XLA backend: kernels compiled by XLA as ordinary array programs.

Pipeline: `plan.make_plan` analyses the grid (what to vectorize, what to loop),
`executor.build` turns the kernel description into a pure JAX function, and
`lower` hands that function to XLA as the lowering of `pallas_call`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.interpreters import mlir

from pallet import _internals as internals
from pallet.backends.xla.executor import build
from pallet.backends.xla.plan import ExecutionPlan, make_plan, vectorization_failure
from pallet.backends.xla import canonical_dots, scatter_accumulators
from pallet.backends.xla.scratch_accumulators import ScratchRewrite, rewrite
from pallet.backends.xla.widening import widen_plan
from pallet.core import primitives, trace_cache
from pallet.core.tracing import KernelDescription

NAME = "xla"


@trace_cache.kernel_cache
def _planned(kernel: KernelDescription) -> tuple[ExecutionPlan, Callable]:
  scratch = rewrite(kernel) if kernel.grid_mapping.scratch_avals else None
  if isinstance(scratch, ScratchRewrite):
    plan, fn = _planned(scratch.kernel)
    plan = dataclasses.replace(plan, reasons=[scratch.note] + plan.reasons)
    return plan, lambda *args: scratch.finish(list(fn(*args)))
  scattered = scatter_accumulators.rewrite(kernel) if _updates_atomically(kernel) else None
  if isinstance(scattered, scatter_accumulators.ScatterRewrite):
    plan, fn = _planned(scattered.kernel)
    plan = dataclasses.replace(plan, reasons=[scattered.note] + plan.reasons)
    return plan, lambda *args: scattered.finish(list(args), list(fn(*args)))
  plan = widen_plan(kernel, make_plan(kernel))
  if isinstance(scattered, str):
    plan.reasons.append(f"atomics not run as one scatter: {scattered}")
  if scratch is not None:
    plan.reasons.append(f"scratch buffers not run as accumulators: {scratch}")
  fn = build(kernel, plan)
  if kernel.debug:
    _print_plan(kernel, plan)
  if not (plan.vectorized or plan.merged):
    return plan, fn

  def run(*args):
    # A batching rule that exists but fails for these operands shows only when the
    # body is traced under vmap: then run every axis looped (the failed attempt
    # leaves only unused values behind in the trace).
    fallback = _fallbacks.get(kernel)
    if fallback is not None:
      return fallback[1](*args)
    try:
      return fn(*args)
    except Exception as e:  # noqa: BLE001 - the looped plan re-raises real errors
      looped = make_plan(kernel, unbatchable=vectorization_failure(e))
      looped_fn = build(kernel, looped)
      try:
        results = looped_fn(*args)
      except Exception:  # noqa: BLE001
        raise e from None
      _fallbacks.put(kernel, (looped, looped_fn))
      if kernel.debug:
        _print_plan(kernel, looped)
      return results
  return plan, run


def _updates_atomically(kernel: KernelDescription) -> bool:
  """Whether the kernel binds add/max/min atomics (see scatter_accumulators)."""
  return primitives.binds_scatter_atomics(kernel.jaxpr.jaxpr)


# Kernels whose vectorized body failed to trace: their looped plan and function.
_fallbacks = trace_cache.LRU()


def _print_plan(kernel: KernelDescription, plan: ExecutionPlan) -> None:
  print(f"--- pallet xla plan for '{kernel.name}' ---\n{plan.describe()}")


def kernel_as_function(kernel: KernelDescription) -> Callable[..., list[Any]]:
  """The kernel's result as a pure function of `(*prefetch, *inputs)`."""
  return _planned(kernel)[1]


def differentiable_function(kernel: KernelDescription,
                            avals: tuple[Any, ...]) -> Callable[..., list[Any]]:
  """`kernel_as_function`, with its matrix products as plain 2-D products where
  vmap made them otherwise (see canonical_dots): JAX derives the gradient from it.
  Narrow products are widened as `lower` widens them where the default device is a
  CPU (the program is differentiated before any lowering)."""
  plan, fn = _planned(kernel)
  if not plan.vectorized or not _binds_dot(kernel):
    return fn
  return _with_2d_products(kernel, avals, widen=jax.default_backend() == "cpu")


def _lowered_function(kernel: KernelDescription, avals: tuple[Any, ...],
                      on_cpu: bool) -> Callable[..., list[Any]]:
  """What `lower` hands to XLA: `kernel_as_function`; on the CPU, where the kernel
  multiplies narrow floating operands into a wider result and its grid is vectorized
  or merged, with those products' operands widened first (see canonical_dots: XLA:CPU
  mis-compiles vmap's form of a `bf16 x bf16 -> f32` product, and widens a plain one
  itself). Same numbers; one more trace of the emitted program, for such kernels only."""
  plan, fn = _planned(kernel)
  if not on_cpu or not (plan.vectorized or plan.merged) or not _binds_narrow_dot(kernel):
    return fn
  return _with_2d_products(kernel, avals, widen=True)


def _with_2d_products(kernel: KernelDescription, avals: tuple[Any, ...],
                      widen: bool = False) -> Callable[..., list[Any]]:
  """`kernel_as_function` traced once, its products rewritten by canonical_dots."""
  closed = _emitted_program(kernel, avals)
  if not canonical_dots.needs_rewrite(closed.jaxpr, widen):
    return lambda *args: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
  # rewritten while the caller traces it: no trace of the rewritten program of its own
  return lambda *args: canonical_dots.evaluate(closed, args, widen)


@trace_cache.kernel_cache
def _emitted_program(kernel: KernelDescription, avals: tuple[Any, ...]) -> Any:
  return internals.trace_jaxpr(kernel_as_function(kernel), avals, "pallas_call program")


def _binds_dot(kernel: KernelDescription) -> bool:
  from pallet.backends.xla.plan import _uses_primitive
  return _uses_primitive(kernel.jaxpr.jaxpr, ("dot_general",))


def _binds_narrow_dot(kernel: KernelDescription) -> bool:
  """Whether the kernel has a product of narrow floating operands into a wider result."""
  from pallet.backends.xla.plan import has_equation
  return has_equation(kernel.jaxpr.jaxpr, canonical_dots.narrow_product)


def plan_of(kernel: KernelDescription) -> ExecutionPlan:
  plan = _planned(kernel)[0]
  fallback = _fallbacks.get(kernel)
  return fallback[0] if fallback is not None else plan


def lower(ctx: Any, *args: Any, kernel: KernelDescription, interpret: bool) -> list:
  del interpret  # the XLA backend is what interpret mode means on the CPU
  fn = _lowered_function(kernel, tuple(ctx.avals_in),
                         "cpu" in getattr(ctx.module_context, "platforms", ()))
  on_host = [getattr(a, "memory_space", None) == jax.memory.Space.Host for a in ctx.avals_in]
  if any(on_host):
    fn = _moved_to_device(fn, on_host)
  return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _moved_to_device(fn: Callable, on_host: list[bool]) -> Callable:
  """`fn` reading operands that live in host memory (`memory_kind="pinned_host"`, a
  kernel's `pl.HOST` operand) from device memory: one memory on the CPU, but XLA's
  ops refuse operands of two memory spaces."""
  def moved(*args):
    return fn(*(jax.device_put(a, jax.memory.Space.Device) if host else a
                for a, host in zip(args, on_host)))
  return moved

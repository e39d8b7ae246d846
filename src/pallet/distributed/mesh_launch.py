"""Launching a kernel that talks to other devices, from one device's program.

Inside `shard_map` each device calls the kernel on its own operands. The kernel
of the whole mesh (`lockstep.mesh_kernel`) needs every device's operands, so each
device all-gathers them along the mesh axes the kernel's remote operations move
along, runs the whole mesh (the same computation on every device of a group) and
keeps its own entry of each output. Everything here is ordinary JAX, so `jit`,
`grad` (the gather transposes into a reduce-scatter) and `vmap` compose with it.
It runs on the XLA backend, whatever backend the call asked for: the lockstep
operations are XLA programs (on GPUs too). Checking mode runs its per-access checks
on every device (`checks_that_apply`).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import jax
from jax import lax

from pallet import _internals as internals
from pallet.core import checks, trace_cache
from pallet.distributed import lockstep, plain_call, remote
from pallet.checking import CheckOptions
from pallet.core.tracing import KernelDescription


@trace_cache.kernel_cache
def talks_to_devices(kernel: KernelDescription) -> bool:
  """Whether the kernel uses remote copies, remote signals or the barrier semaphore."""
  return remote.uses_remote(kernel.jaxpr.jaxpr)


def launch(*operands: Any, kernel: KernelDescription, bind: Callable[..., list]) -> list:
  """This device's outputs of `kernel`; `operands` are this device's (grid sizes, scalar
  prefetch, inputs, closed-over values), `bind(*operands, kernel=...)` runs a kernel."""
  mesh = lockstep.mesh_of(kernel, internals.axis_env())
  whole = lockstep.mesh_kernel(kernel, mesh)
  if kernel.debug:
    print(f"--- pallet runs kernel '{kernel.name}' as its whole mesh ({mesh.describe()}) "
          f"in lockstep ---")
    print(whole.jaxpr)
  outs = bind(*[_gather(x, mesh) for x in operands], kernel=whole)
  if not mesh.axes:
    return [o[0] for o in outs]
  me = lax.axis_index(mesh.axes[0] if len(mesh.axes) == 1 else mesh.axes)
  # one equation (its operands may vary over different axes: no casts in the jaxpr)
  return plain_call.call(_entries, *outs, me)


def checks_that_apply(options: CheckOptions | None, name: str) -> CheckOptions | None:
  """Checking mode's options for a kernel that talks to other devices: bounds, NaN,
  overflow and `pl.debug_check` checks run on every device; the checks that track what
  each buffer holds (uninitialized reads, races, unwritten outputs) do not see what other
  devices copy in, so they are off, with a warning."""
  if options is None:
    return None
  dropped = [kind for kind, on in (("uninitialized", options.uninitialized),
                                   ("race", options.races),
                                   ("unwritten", options.unwritten)) if on]
  if dropped:
    warnings.warn(f"pallas_call of kernel '{name}' at {checks.user_source()}: checking mode "
                  f"does not run its {', '.join(dropped)} checks on kernels that talk to "
                  f"other devices (they do not see what other devices copy in)", stacklevel=2)
  kept = dataclasses.replace(options, uninitialized=False, races=False, unwritten=False)
  return kept if kept.any else None


def _entries(*args: Any) -> list:
  """Entry `args[-1]` of each of the other arguments."""
  *stacks, me = args
  return [lax.dynamic_index_in_dim(s, me, 0, keepdims=False) for s in stacks]


def _gather(x: Any, mesh: lockstep.Mesh) -> jax.Array:
  """Every device's `x` along the mesh's axes, stacked in device order."""
  x = jax.numpy.asarray(x)
  if not mesh.axes:
    return x[None]
  if internals.check_vma_enabled():
    x = internals.pvary(x, frozenset(mesh.axes))
  return lax.all_gather(x, mesh.axes[0] if len(mesh.axes) == 1 else mesh.axes, axis=0,
                        tiled=False)

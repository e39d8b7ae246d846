"""Launching a kernel that talks to other devices, from one device's program.

Inside `shard_map` each device calls the kernel on its own operands. The kernel
of the whole mesh (`lockstep.mesh_kernel`) needs every device's operands, so each
device all-gathers them along the mesh axes the kernel's remote operations move
along, runs the whole mesh (the same computation on every device of a group) and
keeps its own entry of each output. Everything here is ordinary JAX, so `jit`,
`grad` (the gather transposes into a reduce-scatter) and `vmap` compose with it.
It runs on the XLA backend, whatever backend the call asked for: the lockstep
operations are XLA programs (on GPUs too).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax import lax

from pallet import _internals as internals
from pallet import lockstep, plain_call, remote, trace_cache
from pallet.tracing import KernelDescription


@trace_cache.kernel_cache
def talks_to_devices(kernel: KernelDescription) -> bool:
  """Whether the kernel uses remote copies, remote signals or the barrier semaphore."""
  return remote.uses_remote(kernel.jaxpr.jaxpr)


def launch(kernel: KernelDescription, operands: Sequence[Any],
           bind: Callable[[KernelDescription, list], list]) -> list:
  """This device's outputs of `kernel`; `operands` are this device's (scalar
  prefetch, inputs, closed-over values), `bind(kernel, operands)` runs a kernel."""
  mesh = lockstep.mesh_of(kernel, internals.axis_env())
  whole = lockstep.mesh_kernel(kernel, mesh)
  if kernel.debug:
    print(f"--- pallet runs kernel '{kernel.name}' as its whole mesh ({mesh.describe()}) "
          f"in lockstep ---")
    print(whole.jaxpr)
  outs = bind(whole, [_gather(x, mesh) for x in operands])
  if not mesh.axes:
    return [o[0] for o in outs]
  me = lax.axis_index(mesh.axes[0] if len(mesh.axes) == 1 else mesh.axes)
  # one equation (its operands may vary over different axes: no casts in the jaxpr)
  return plain_call.call(_entries, *outs, me)


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

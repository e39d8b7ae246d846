"""Remote DMAs, remote semaphore signals and the barrier semaphore, as one device
of a mesh states them.

`pltpu.make_async_remote_copy(src, dst, send_sem, recv_sem, device_id)` copies
`src` on this device into `dst` on the device `device_id` names; the copy adds
its element count to `recv_sem` on that device and to `send_sem` here.
`pl.semaphore_signal(sem, n, device_id=...)` adds `n` to `sem` on that device.
`pltpu.get_barrier_semaphore()` is one semaphore per device, shared by every
grid step of the kernel, for barriers between devices.

These primitives only record what each device asks for: the kernel they appear
in runs as the whole mesh at once (`pallet/distributed/lockstep.py`), which gives them their
meaning. Waits stay the local `dma_wait` / `semaphore_wait` of `pallet/core/dma.py`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal, Primitive, jaxprs_in_params, subjaxprs

from pallet import _internals as internals
from pallet.core import checks, device_ids, dma, primitives
from pallet.errors import PalletError
from pallet.core.refs_select import SelectedRef

# Slots of remote_copy's operand tree (..., coords).
_SRC, _SRC_T, _DST, _DST_T, _RECV, _RECV_T, _SEND, _SEND_T, _COORDS = range(9)

remote_copy_p = Primitive("remote_copy_start")
remote_copy_p.multiple_results = True
remote_signal_p = Primitive("remote_semaphore_signal")
remote_signal_p.multiple_results = True
barrier_semaphore_p = Primitive("barrier_semaphore")
barrier_semaphore_p.ref_primitive = True     # a ref made inside the kernel, like new_ref
barrier_semaphore_p.ref_allocating = True

REMOTE_PRIMITIVES = (remote_copy_p, remote_signal_p, barrier_semaphore_p)


def uses_remote(jaxpr: Any) -> bool:
  """Whether `jaxpr` (or a jaxpr nested in it) talks to other devices."""
  return (any(e.primitive in REMOTE_PRIMITIVES for e in jaxpr.eqns)
          or any(uses_remote(sub) for sub in subjaxprs(jaxpr)))


def target_axes(jaxpr: Any, own: dict | None = None) -> frozenset:
  """The mesh axes along which some remote operation of `jaxpr` reaches another device.
  A coordinate that is this device's own, `lax.axis_index` of that very axis (as in
  `device_id=(lax.axis_index("y"), neighbour)`), does not move; `own` maps such
  variables of `jaxpr` to their axis."""
  own = dict(own or {})
  axes = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "axis_index" and not isinstance(eqn.params["axis_name"], tuple):
      own[eqn.outvars[0]] = eqn.params["axis_name"]
    if eqn.primitive in (remote_copy_p, remote_signal_p):
      axes.update(a for a, c in zip(eqn.params["axes"], _coordinates(eqn))
                  if isinstance(c, Literal) or own.get(c) != a)
    for sub, sub_own in _nested(eqn, own):
      axes |= target_axes(sub, sub_own)
  return frozenset(axes)


def _coordinates(eqn: Any) -> tuple:
  if eqn.primitive is remote_copy_p:
    return jax.tree_util.tree_unflatten(eqn.params["tree"], eqn.invars)[_COORDS]
  return jax.tree_util.tree_unflatten(eqn.params["tree"], eqn.invars[:-1])[2]


def _nested(eqn: Any, own: dict) -> list[tuple[Any, dict]]:
  """Each jaxpr nested in `eqn`, with what `own` says about its inputs (the branches of
  a cond and calls receive the equation's operands; loops are not followed)."""
  subs = list(jaxprs_in_params(eqn.params))
  name = eqn.primitive.name
  operands = (eqn.invars[1:] if name == "cond" else
              eqn.invars if len(subs) == 1 and name not in ("scan", "while") else None)
  if operands is None:
    return [(sub, {}) for sub in subs]
  return [(sub, {v: own[o] for v, o in zip(sub.invars, operands)
                 if not isinstance(o, Literal) and o in own}) for sub in subs]


def _outside_the_mesh(*args, **params):
  raise PalletError("pallet: a remote copy, remote signal or barrier semaphore was run "
                    "outside the lockstep execution of its mesh (internal error)")


# ------------------------------------------------------------------ remote copies
def _remote_copy_abstract_eval(*avals, tree, axes, add, shared_sem, site):
  parts = jax.tree_util.tree_unflatten(tree, list(range(len(avals))))
  effects = {internals.ReadEffect(parts[_SRC]), internals.WriteEffect(parts[_DST]),
             internals.WriteEffect(parts[_RECV])}
  if parts[_SEND] is not None:
    effects.add(internals.WriteEffect(parts[_SEND]))
  return [], effects


remote_copy_p.def_effectful_abstract_eval(_remote_copy_abstract_eval)
internals.register_discharge_rule(remote_copy_p)(_outside_the_mesh)


@dataclasses.dataclass
class RemoteCopyDescriptor(dma.AsyncCopyDescriptor):
  """A DMA from `src_ref` here to `dst_ref` on another device: `dst_sem` (the receive
  semaphore) counts the arrival there, `src_sem` (the send semaphore) the send here."""
  device_id: Any = None
  device_id_type: Any = None

  def start(self, priority: int = 0, *, add: bool = False) -> None:
    """Copies now (a TPU copies in the background) and signals both semaphores."""
    if self._started_with_selected_ref(priority, add):
      return
    del priority
    api = "make_async_remote_copy(...).start()"
    site = dma.kernel_site()
    src, src_t = primitives.ref_and_transforms(self.src_ref)
    dst, dst_t = primitives.ref_and_transforms(self.dst_ref)
    recv, recv_t = dma.semaphore_view(self.dst_sem, api)
    send, send_t = dma.semaphore_view(self.src_sem, api)
    dma.check_copy_ends(src, src_t, dst, dst_t, "make_async_remote_copy")
    target = device_ids.normalize(self.device_id, self.device_id_type,
                                  "make_async_remote_copy", site)
    shared_sem = send is recv
    flat, tree = jax.tree_util.tree_flatten(
        (src, src_t, dst, dst_t, recv, recv_t, None if shared_sem else send, send_t,
         target.coords))
    remote_copy_p.bind(*flat, tree=tree, axes=target.axes, add=add, shared_sem=shared_sem,
                       site=site)


def make_async_remote_copy(src_ref: Any, dst_ref: Any, send_sem: Any, recv_sem: Any,
                           device_id: Any, device_id_type: Any = None) -> RemoteCopyDescriptor:
  """Describes a copy of `src_ref` here into `dst_ref` on device `device_id`; start it
  with `.start()`, then `.wait_send()` (or `.wait()`) here and `.wait_recv()` on the
  receiving device (in an SPMD kernel every device does both)."""
  for what, r in (("src_ref", src_ref), ("dst_ref", dst_ref), ("send_sem", send_sem),
                  ("recv_sem", recv_sem)):
    if not isinstance(r, SelectedRef):
      dma.check_ref(r, "make_async_remote_copy", what)
  return RemoteCopyDescriptor(src_ref, dst_ref, recv_sem, send_sem, device_id=device_id,
                              device_id_type=device_id_type)


def async_remote_copy(src_ref: Any, dst_ref: Any, send_sem: Any, recv_sem: Any,
                      device_id: Any, device_id_type: Any = None) -> RemoteCopyDescriptor:
  """Starts a remote copy and returns its descriptor (to wait on)."""
  copy = make_async_remote_copy(src_ref, dst_ref, send_sem, recv_sem, device_id,
                                device_id_type)
  copy.start()
  return copy


# ------------------------------------------------------------------ remote signals
remote_signal_p.def_effectful_abstract_eval(
    lambda *avals, tree, axes, site: ([], {internals.WriteEffect(0)}))
internals.register_discharge_rule(remote_signal_p)(_outside_the_mesh)


def signal(sem: Any, inc: Any, device_id: Any, device_id_type: Any) -> None:
  """`pl.semaphore_signal(sem, inc, device_id=...)`: adds `inc` to `sem` on that device."""
  if isinstance(sem, SelectedRef):
    sem.write(lambda chosen: signal(chosen, inc, device_id, device_id_type))
    return
  site = dma.kernel_site()
  base, transforms = dma.semaphore_view(sem, "semaphore_signal")
  target = device_ids.normalize(device_id, device_id_type, "semaphore_signal", site)
  flat, tree = jax.tree_util.tree_flatten((base, transforms, target.coords))
  remote_signal_p.bind(*flat, jnp.asarray(inc, jnp.int32), tree=tree, axes=target.axes,
                       site=site)


# ------------------------------------------------------------------ barrier semaphore
barrier_semaphore_p.def_effectful_abstract_eval(
    lambda: (internals.AbstractRef(jax.core.ShapedArray((), jnp.int32)),
             {internals.internal_ref_effect}))
internals.register_discharge_rule(barrier_semaphore_p)(_outside_the_mesh)


def get_barrier_semaphore() -> Any:
  """This device's barrier semaphore: one per kernel call, starting at 0, kept across
  grid steps; other devices signal it with `pl.semaphore_signal(sem, device_id=...)`."""
  if primitives.current_kernel_name() is None:
    raise PalletError(f"pltpu.get_barrier_semaphore() at {checks.user_source()}: called "
                      f"outside a kernel; call it in the kernel body")
  return barrier_semaphore_p.bind()

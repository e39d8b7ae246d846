"""What a remote copy, a remote signal and a wait do to the refs of every device.

A kernel run as its whole mesh (`pallet/distributed/lockstep.py`) holds each ref of every
device stacked along a leading axis of length n (the devices, in the order of
`Mesh.devices`). At one operation of the program all n devices act together,
each where `mask` (an (n,) bool: the devices whose control flow reaches it) is set:

* `lockstep_copy`: every sender's source view is read first, then, sender by
  sender in device order, written into its destination view on its target device
  (added with `add=True`), and the copied element count added to the receive
  semaphore there and to the send semaphore here. Reading all before writing any
  is one order the hardware may run concurrent DMAs in. Views of a size known only at
  run time (`pl.ds(start, n)`, `n` per device) move exactly `n` rows, as local DMAs
  do (pallet/core/dynamic_views.py);
* `lockstep_signal`: each sender adds its increment to the semaphore view on its
  target device;
* `lockstep_wait`: each device needs its semaphore view to hold at least its
  amount, then takes it off (unless `decrement=False`); a device that finds less is
  a run-time error carrying `message`.

Views (`.at[...]`) are given per device: every transform leaf and amount has the
device axis in front. Each primitive has its abstract evaluation and its discharge
rule (the meaning every backend compiles) side by side.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive

from pallet import _internals as internals
from pallet.core import checks, dynamic_views, ref_views

lockstep_copy_p = Primitive("lockstep_copy")
lockstep_copy_p.multiple_results = True
lockstep_signal_p = Primitive("lockstep_signal")
lockstep_signal_p.multiple_results = True
lockstep_wait_p = Primitive("lockstep_wait")
lockstep_wait_p.multiple_results = True


def _at(tree: Any, d: Any) -> Any:
  """Device `d`'s entries of a pytree of per-device leaves."""
  return jax.tree_util.tree_map(lambda leaf: leaf[d], tree)


def _updated(stack: jax.Array, device: Any, transforms: Any, fn: Any, on: Any) -> jax.Array:
  """`stack` with device `device`'s view `transforms` replaced by `fn(view)` where `on`."""
  current = lax.dynamic_index_in_dim(stack, device, 0, keepdims=False)
  new = ref_views.update(current, transforms, fn)
  return lax.dynamic_update_index_in_dim(stack, jnp.where(on, new, current), device, 0)


# ------------------------------------------------------------------ copies
def copy(refs: list[Any], roles: tuple[int | None, ...], transforms: tuple[Any, ...],
         target: jax.Array, mask: jax.Array, add: bool) -> None:
  """Binds a lockstep copy: `refs` the distinct refs involved, `roles` the position in
  `refs` of (source, destination, receive semaphore, send semaphore or None),
  `transforms` their per-device views."""
  flat, tree = jax.tree_util.tree_flatten(transforms)
  lockstep_copy_p.bind(*refs, *flat, target, mask, n_refs=len(refs), roles=roles, tree=tree,
                       add=add)


def _copy_abstract_eval(*avals, n_refs, roles, tree, add):
  src, dst, recv, send = roles
  effects = {internals.ReadEffect(src), internals.WriteEffect(dst),
             internals.WriteEffect(recv)}
  if send is not None:
    effects.add(internals.WriteEffect(send))
  return [], effects


lockstep_copy_p.def_effectful_abstract_eval(_copy_abstract_eval)


@internals.register_discharge_rule(lockstep_copy_p)
def _copy_discharge(in_avals, out_avals, *args, n_refs, roles, tree, add):
  refs, (*leaves, target, mask) = list(args[:n_refs]), args[n_refs:]
  src_t, dst_t, recv_t, send_t = jax.tree_util.tree_unflatten(tree, leaves)
  src, dst, recv, send = roles
  if dynamic_views.has_dynamic_size(src_t) or dynamic_views.has_dynamic_size(dst_t):
    arrive = _dynamic_arrival(refs[src], src_t, refs[dst], dst_t, add)
  else:
    data = jax.vmap(ref_views.read)(refs[src], src_t)      # every sender's view, read first
    size = math.prod(data.shape[1:])

    def arrive(d, stack, to, on):
      land = ((lambda old: (old + data[d]).astype(old.dtype)) if add else
              (lambda old: data[d].astype(old.dtype)))
      return _updated(stack, to, _at(dst_t, d), land, on), size

  def one_sender(d, stacks):
    stacks, on, to = list(stacks), mask[d], target[d]
    stacks[dst], size = arrive(d, stacks[dst], to, on)
    stacks[recv] = _updated(stacks[recv], to, _at(recv_t, d), lambda c: c + size, on)
    if send is not None:
      stacks[send] = _updated(stacks[send], d, _at(send_t, d), lambda c: c + size, on)
    return tuple(stacks)

  stacks = lax.fori_loop(0, refs[src].shape[0], one_sender, tuple(refs))
  return tuple(stacks) + (None,) * (len(args) - n_refs), []


def _dynamic_arrival(src_stack: jax.Array, src_t: Any, dst_stack: jax.Array, dst_t: Any,
                     add: bool) -> Any:
  """A copy whose views have a size known at run time (`pl.ds(start, n)`, per device):
  `arrive(d, stack, to, on)` lands sender d's data on its target and says how many
  elements it moved, as the local DMA's masked copy over static bounds
  (pallet/core/dynamic_views.py)."""
  src_bounds = dynamic_views.window(src_stack.shape[1:], _at(src_t, 0)).view_bounds
  dst_bounds = dynamic_views.window(dst_stack.shape[1:], _at(dst_t, 0)).view_bounds
  bounds = [min(a, b) for a, b in zip(src_bounds, dst_bounds)]

  def read(x, transforms):
    w = dynamic_views.window(x.shape, transforms)
    return dynamic_views.read(x, w, bounds), [jnp.asarray(s, jnp.int32) for s in w.view_sizes]
  data, src_sizes = jax.vmap(read)(src_stack, src_t)     # every sender's view, read first

  def arrive(d, stack, to, on):
    current = lax.dynamic_index_in_dim(stack, to, 0, keepdims=False)
    w = dynamic_views.window(current.shape, _at(dst_t, d))
    counts = [dynamic_views.smallest(s[d], n, b)
              for s, n, b in zip(src_sizes, w.view_sizes, bounds)]
    new = dynamic_views.write(current, w, bounds, counts, data[d], add=add)
    return (lax.dynamic_update_index_in_dim(stack, jnp.where(on, new, current), to, 0),
            dynamic_views.product(counts))
  return arrive


# ------------------------------------------------------------------ signals
def signal(sem: Any, transforms: Any, inc: jax.Array, target: jax.Array,
           mask: jax.Array) -> None:
  flat, tree = jax.tree_util.tree_flatten(transforms)
  lockstep_signal_p.bind(sem, *flat, inc, target, mask, tree=tree)


lockstep_signal_p.def_effectful_abstract_eval(
    lambda *avals, tree: ([], {internals.WriteEffect(0)}))


@internals.register_discharge_rule(lockstep_signal_p)
def _signal_discharge(in_avals, out_avals, sem, *args, tree):
  *leaves, inc, target, mask = args
  transforms = jax.tree_util.tree_unflatten(tree, leaves)

  def one_sender(d, sem):
    return _updated(sem, target[d], _at(transforms, d), lambda c: c + inc[d], mask[d])

  return (lax.fori_loop(0, sem.shape[0], one_sender, sem),) + (None,) * len(args), []


# ------------------------------------------------------------------ waits
def wait(sem: Any, transforms: Any, amount: jax.Array, mask: jax.Array, *, decrement: bool,
         message: str) -> None:
  flat, tree = jax.tree_util.tree_flatten(transforms)
  lockstep_wait_p.bind(sem, *flat, amount, mask, tree=tree, decrement=decrement,
                       message=message)


lockstep_wait_p.def_effectful_abstract_eval(
    lambda *avals, tree, decrement, message: ([], {internals.WriteEffect(0)}))


@internals.register_discharge_rule(lockstep_wait_p)
def _wait_discharge(in_avals, out_avals, sem, *args, tree, decrement, message):
  *leaves, amount, mask = args
  transforms = jax.tree_util.tree_unflatten(tree, leaves)
  held = jax.vmap(ref_views.read)(sem, transforms)
  checks.check(jnp.logical_or(held >= amount, jnp.logical_not(mask)), message)
  if not decrement:
    return (None,) * (1 + len(args)), []
  taken = jax.vmap(lambda s, t, a: ref_views.update(s, t, lambda c: c - a))(
      sem, transforms, amount)
  on = mask.reshape(mask.shape + (1,) * (sem.ndim - 1))
  return (jnp.where(on, taken, sem),) + (None,) * len(args), []

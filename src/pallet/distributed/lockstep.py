"""A kernel that talks to other devices, rewritten to run as its whole mesh at once.

Remote copies and signals reach into other devices' refs, so no device can run
its kernel alone. `mesh_kernel(kernel, mesh)` returns the kernel of the whole
mesh: every ref (operand blocks, scratch, semaphores, the barrier semaphore) gets
a leading axis of length n, one entry per device, and the body runs the original
body for all devices in lockstep: operation by operation in program order, each
device on its own entry.

* Values that may differ between devices (read from refs, `lax.axis_index` of a
  mesh axis, anything computed from them) carry the device axis in front
  ("batched"); values every device shares (grid indices, constants) do not.
  Pure operations run under `jax.vmap` over the device axis.
* Operations on refs are run per device (their discharged form, vmapped) on the
  stacked values; writes land only where `mask` is set.
* Control flow that differs between devices runs masked: a `cond` on a batched
  index runs every branch, each with the mask of the devices that take it, and
  selects the values; a `while` with a batched condition runs until no device
  continues, each device stopping where its own loop would. A `cond` on a shared
  index stays a `cond`; loops with static trip counts stay `scan`s. Branches that
  wait are ordered by `lockstep_schedule`: devices in different branches each run
  as far as they can before waiting.
* Remote copies, remote signals and waits become the `lockstep_ops` primitives.

Why lockstep is sound: it is one interleaving of the devices' programs, each in
its own program order, with DMAs completing as they start. A wait that holds when
its turn comes is one the hardware could pass there too, so a race-free kernel
computes what it computes on a TPU. A wait that does not hold is an error, where
the kernel either deadlocks or relies on an order this schedule does not take
(one device running ahead of another past a loop, say).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxprs_in_params

from pallet import _internals as internals
from pallet.core import checks, discharge, dma, dynamic_views, ref_views, trace_cache
from pallet.distributed import lockstep_ops, lockstep_schedule, remote
from pallet.core.grid_mapping import BlockDimension
from pallet.errors import PalletError
from pallet.core.tracing import KernelDescription



@dataclasses.dataclass(frozen=True)
class Mesh:
  """The devices a kernel's remote operations reach: the mesh axes they move along
  (in mesh order) and their sizes. Device k of the stack has coordinates
  `np.unravel_index(k, sizes)` (row-major, as `lax.all_gather` over `axes` stacks)."""
  axes: tuple[Any, ...]
  sizes: tuple[int, ...]

  @property
  def n(self) -> int:
    return math.prod(self.sizes)

  def coordinate(self, axis: Any) -> np.ndarray:
    """Each device's coordinate along `axis`, an (n,) int32 array."""
    grid = np.indices(self.sizes).reshape(len(self.sizes), self.n)
    return grid[self.axes.index(axis)].astype(np.int32)

  def describe(self) -> str:
    return ", ".join(f"{a}={s}" for a, s in zip(self.axes, self.sizes)) or "one device"


def mesh_of(kernel: KernelDescription, axis_env: Sequence[tuple[Any, int]]) -> Mesh:
  """The mesh a kernel's remote operations span, within the axes in scope."""
  moving = remote.target_axes(kernel.jaxpr.jaxpr)
  env = dict(axis_env)
  missing = sorted(str(a) for a in moving if a not in env)
  if missing:
    raise PalletError(f"kernel '{kernel.name}' ({kernel.source}) sends to devices along "
                      f"mesh axes {missing}, which are not in scope where it is called")
  axes = tuple(a for a, _ in axis_env if a in moving)
  return Mesh(axes, tuple(env[a] for a in axes))


# ------------------------------------------------------------------ values
@dataclasses.dataclass
class _Ref:
  """A ref of every device: leading axis n."""
  ref: Any


@dataclasses.dataclass
class _Val:
  """A value; `batched` ones have the device axis in front."""
  x: Any
  batched: bool


def _array(v: _Val, n: int) -> jax.Array:
  """`v` with the device axis in front (broadcast if every device shares it), never
  weakly typed (loop carries and branch results must keep one type)."""
  x = jnp.asarray(v.x)
  x = lax.convert_element_type(x, x.dtype)
  return x if v.batched else jnp.broadcast_to(x, (n,) + x.shape)


def _sub_jaxpr(eqn: Any) -> tuple[Jaxpr, Sequence[Any]]:
  for value in eqn.params.values():
    if isinstance(value, ClosedJaxpr):
      return value.jaxpr, value.consts
    if isinstance(value, Jaxpr):
      return value, ()
  raise AssertionError(eqn)


def _site(kernel: KernelDescription, eqn: Any) -> str:
  src = internals.equation_source(eqn)
  return f"kernel '{kernel.name}' at " + (f"{src[0]}:{src[1]}" if src else kernel.source)


# ------------------------------------------------------------------ the interpreter
class _Lockstep:
  """Traces the kernel body for every device of `mesh` at once (see module doc)."""

  def __init__(self, kernel: KernelDescription, mesh: Mesh, barrier: Any):
    self.kernel, self.mesh, self.barrier = kernel, mesh, barrier
    self.n = mesh.n

  # -- helpers
  def _mask_and(self, mask: Any, cond: Any) -> jax.Array:
    return cond if mask is None else jnp.logical_and(mask, cond)

  def _full_mask(self, mask: Any) -> jax.Array:
    return jnp.ones((self.n,), jnp.bool_) if mask is None else mask

  def _needs_lockstep(self, jaxpr: Jaxpr) -> bool:
    """Whether a nested jaxpr must be interpreted (not merely vmapped): it touches
    refs, talks to devices, asks which device it is, or checks something."""
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if (eqn.effects or name in dma.DMA_PRIMITIVE_NAMES or name == "axis_index"
          or any(isinstance(v.aval, internals.AbstractRef) for v in eqn.invars)):
        return True
      if any(self._needs_lockstep(s) for s in jaxprs_in_params(eqn.params)):
        return True
    return False

  # -- the main loop: one block, in the order lockstep_schedule decides
  def run(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], mask: Any) -> list:
    return lockstep_schedule.Block(self, mask).run(jaxpr, consts, args)

  # -- what lockstep_schedule needs of values
  def value(self, x: Any) -> _Val:
    return _Val(x, False)

  def stacked(self, v: _Val) -> jax.Array:
    return _array(v, self.n)

  def select(self, index: _Val, values: list) -> _Val:
    """Each device's value from the branch its `index` picks."""
    arrays = [_array(v, self.n) for v in values]
    which = _array(index, self.n).reshape((self.n,) + (1,) * (arrays[0].ndim - 1))
    return _Val(lax.select_n(jnp.broadcast_to(which, arrays[0].shape), *arrays), True)

  def merge(self, mask: jax.Array, new: Any, old: Any) -> Any:
    """`new` for the devices of `mask`, `old` for the others (a ref: its entries)."""
    if isinstance(old, _Ref):
      if new.ref is old.ref:       # a ref passed on (into a branch): the same memory
        return old
      whole = old.ref[...]
      on = mask.reshape((self.n,) + (1,) * (whole.ndim - 1))
      old.ref[...] = jnp.where(on, new.ref[...], whole)
      return old
    a, b = _array(new, self.n), _array(old, self.n)
    return _Val(jnp.where(mask.reshape((self.n,) + (1,) * (a.ndim - 1)), a, b), True)

  def eqn(self, eqn: Any, ins: list, mask: Any) -> list:
    prim, name = eqn.primitive, eqn.primitive.name
    if prim is remote.barrier_semaphore_p:
      return [_Ref(self.barrier)]
    if prim is remote.remote_copy_p:
      return self.remote_copy(eqn, ins, mask)
    if prim is remote.remote_signal_p:
      return self.remote_signal(eqn, ins, mask)
    if name in lockstep_schedule.WAITS:
      return self.wait(eqn, ins, mask)
    if prim is checks.check_p:
      return self.check(eqn, ins, mask)
    if name == "axis_index":
      return [self.axis_index(eqn)]
    self._refuse_collectives(eqn)
    if prim.ref_allocating:
      return [self.allocate(eqn, ins)]
    has_refs = any(isinstance(v, _Ref) for v in ins)
    subs = list(jaxprs_in_params(eqn.params))
    if subs and (has_refs or any(self._needs_lockstep(s) for s in subs)):
      if name == "cond":
        return self.cond(eqn, ins, mask)
      if name == "while":
        return self.while_loop(eqn, ins, mask)
      if name == "scan":
        return self.scan(eqn, ins, mask)
      if name in lockstep_schedule.CALLS:
        jaxpr, consts = _sub_jaxpr(eqn)
        return self.run(jaxpr, consts, ins, mask)
      raise PalletError(f"{_site(self.kernel, eqn)}: '{name}' around refs or remote "
                        f"operations is not supported in a kernel that talks to other "
                        f"devices (pallet runs such kernels as the whole mesh in lockstep)")
    if has_refs:
      return self.ref_op(eqn, ins, mask)
    return self.pure(eqn, ins)

  # -- pure operations
  def pure(self, eqn: Any, ins: list) -> list:
    prim, params = eqn.primitive, eqn.params
    xs = [v.x for v in ins]
    if not any(v.batched for v in ins):
      outs = prim.bind(*xs, **params)
      outs = outs if prim.multiple_results else [outs]
      return [_Val(o, False) for o in outs]
    # Every operand gets the device axis: JAX's batching rules do not all handle an
    # unbatched operand beside batched ones (clamp of a shared scalar between per-device
    # bounds fails its shape check), and a uniform batch is what every rule supports.
    n = next(v.x.shape[0] for v in ins if v.batched)
    xs = [x if v.batched else jnp.broadcast_to(x, (n,) + jnp.shape(x)) for x, v in zip(xs, ins)]
    outs = jax.vmap(lambda *a: prim.bind(*a, **params))(*xs)
    outs = outs if prim.multiple_results else [outs]
    return [_Val(o, True) for o in outs]

  # -- operations on refs: their discharged form, per device
  def ref_op(self, eqn: Any, ins: list, mask: Any) -> list:
    prim, params = eqn.primitive, eqn.params
    avals = [v.aval for v in eqn.invars]
    one = jax.make_jaxpr(lambda *a: prim.bind(*a, **params))(*avals)
    pure = discharge.discharge_state(one)
    ref_pos = [i for i, v in enumerate(ins) if isinstance(v, _Ref)]
    wholes = {i: ins[i].ref[...] for i in ref_pos}
    values = [wholes[i] if i in wholes else ins[i].x for i in range(len(ins))]
    axes = [0 if (i in wholes or ins[i].batched) else None for i in range(len(ins))]
    results = jax.vmap(lambda *a: jax.core.eval_jaxpr(pure.jaxpr, pure.consts, *a),
                       in_axes=axes)(*values)
    n_out = len(eqn.outvars)
    for k, i in enumerate(ref_pos):   # the discharged form returns every ref's new value
      if pure.jaxpr.outvars[n_out + k] is pure.jaxpr.invars[i]:
        continue    # passed through: not written
      new = results[n_out + k]
      if mask is not None:
        on = mask.reshape((self.n,) + (1,) * (new.ndim - 1))
        new = jnp.where(on, new, wholes[i])
      ins[i].ref[...] = new
    return [_Val(o, True) for o in results[:n_out]]

  def allocate(self, eqn: Any, ins: list) -> _Ref:
    aval = eqn.outvars[0].aval.inner_aval
    if ins:
      init = _array(ins[0], self.n)
    else:
      init = checks.uninitialized((self.n,) + tuple(aval.shape), aval.dtype)
    return _Ref(jax.new_ref(init))

  # -- which device am I
  def axis_index(self, eqn: Any) -> _Val:
    names = eqn.params["axis_name"]
    names = names if isinstance(names, tuple) else (names,)
    if not any(a in self.mesh.axes for a in names):
      return self.pure(eqn, [])[0]
    index, batched = jnp.int32(0), False
    for a in names:
      size = lax.axis_size(a)
      if a in self.mesh.axes:
        coord, batched = jnp.asarray(self.mesh.coordinate(a)), True
      else:
        coord = lax.axis_index(a)
      index = index * np.int32(size) + coord
    return _Val(index, batched)

  def _refuse_collectives(self, eqn: Any) -> None:
    named = eqn.params.get("axis_name", eqn.params.get("axes", ()))
    named = named if isinstance(named, (tuple, list)) else (named,)
    if any(a in self.mesh.axes for a in named if isinstance(a, str)):
      raise PalletError(f"{_site(self.kernel, eqn)}: '{eqn.primitive.name}' over mesh axes "
                        f"{list(named)} inside a kernel that talks to other devices is not "
                        f"supported; use remote copies and semaphores, or call the "
                        f"collective outside the kernel")

  # -- remote operations
  def target(self, eqn: Any, axes: tuple, coords: Sequence[_Val], mask: Any) -> jax.Array:
    """Each device's target, its position in the stack; out-of-range ids are an error."""
    given = dict(zip(axes, coords))
    index = jnp.zeros((self.n,), jnp.int32)
    for a, size in zip(self.mesh.axes, self.mesh.sizes):
      c = _array(given[a], self.n) if a in given else jnp.asarray(self.mesh.coordinate(a))
      if a in given:
        ok = jnp.logical_and(c >= 0, c < size)
        checks.check(jnp.logical_or(ok, jnp.logical_not(self._full_mask(mask))),
                     f"device_id in {eqn.params['site']}: the coordinate along mesh axis "
                     f"{a!r} is outside the axis (size {size})")
      index = index * np.int32(size) + c
    return index

  def remote_copy(self, eqn: Any, ins: list, mask: Any) -> list:
    parts = jax.tree_util.tree_unflatten(eqn.params["tree"], ins)
    src, src_t, dst, dst_t, recv, recv_t, send, send_t, coords = parts
    if eqn.params["shared_sem"]:
      send = recv
    target = self.target(eqn, eqn.params["axes"], coords, mask)
    bases = [src.ref, dst.ref, recv.ref, send.ref]
    refs: list[Any] = []
    roles = []
    for b in bases:
      k = next((k for k, r in enumerate(refs) if r is b), None)
      if k is None:
        refs.append(b)
        k = len(refs) - 1
      roles.append(k)
    transforms = tuple(self._views(t) for t in (src_t, dst_t, recv_t, send_t))
    lockstep_ops.copy(refs, tuple(roles), transforms, target, self._full_mask(mask),
                      eqn.params["add"])
    return []

  def remote_signal(self, eqn: Any, ins: list, mask: Any) -> list:
    *flat, inc = ins
    sem, sem_t, coords = jax.tree_util.tree_unflatten(eqn.params["tree"], flat)
    target = self.target(eqn, eqn.params["axes"], coords, mask)
    lockstep_ops.signal(sem.ref, self._views(sem_t), _array(inc, self.n), target,
                        self._full_mask(mask))
    return []

  def _views(self, transforms: Any) -> Any:
    """A view's transforms with every leaf per device."""
    return jax.tree_util.tree_map(lambda v: _array(v, self.n), transforms,
                                  is_leaf=lambda x: isinstance(x, _Val))

  def wait(self, eqn: Any, ins: list, mask: Any) -> list:
    if eqn.primitive.name == "dma_wait":
      ref, ref_t, sem, sem_t = jax.tree_util.tree_unflatten(eqn.params["tree"], ins)
      views = self._views(ref_t)
      if dynamic_views.has_dynamic_size(ref_t):
        # `ref.at[pl.ds(start, n)]` with a run-time n, possibly different per device:
        # each device waits for the elements its own view holds
        shape = jax.typeof(ref.ref).shape[1:]
        amount = _Val(jax.vmap(lambda t: jnp.asarray(
            dynamic_views.window(shape, t).count(), jnp.int32))(views), True)
      else:
        view = jax.eval_shape(jax.vmap(ref_views.read), ref.ref[...], views)
        amount = _Val(np.int32(math.prod(view.shape[1:])), False)
      what, decrement = "DMA wait", True
    else:
      *flat, amount = ins
      sem, sem_t = jax.tree_util.tree_unflatten(eqn.params["tree"], flat)
      what, decrement = "semaphore_wait", eqn.params["decrement"]
    message = (
        f"{what} in {_site(self.kernel, eqn)}: when this wait's turn came, the semaphore "
        f"held less than the wait needs on some device (pallet runs the {self.n} devices "
        f"of mesh axes ({self.mesh.describe()}) in lockstep: operation by operation in "
        f"program order, devices in different branches of a pl.when each as far as it can "
        f"before waiting, loops whole). Either no device signals it before this point, and "
        f"on a TPU the kernel would hang, or the kernel relies on one device running ahead "
        f"of another (past a loop, say), an order pallet's lockstep execution cannot "
        f"reproduce")
    lockstep_ops.wait(sem.ref, self._views(sem_t), _array(amount, self.n),
                      self._full_mask(mask), decrement=decrement, message=message)
    return []

  def check(self, eqn: Any, ins: list, mask: Any) -> list:
    if mask is not None:
      ok = ins[0]
      masked = jnp.logical_or(_array(ok, self.n), jnp.logical_not(
          mask.reshape((self.n,) + (1,) * (jnp.ndim(ok.x) - ok.batched))))
      ins = [_Val(masked, True)] + ins[1:]
    return self.pure(eqn, ins)

  # -- control flow
  def cond(self, eqn: Any, ins: list, mask: Any) -> list:
    index, *ops = ins
    branches = eqn.params["branches"]
    if not index.batched:
      def branch(b):
        return lambda: [_array(o, self.n) for o in self.run(b.jaxpr, b.consts, ops, mask)]
      outs = lax.switch(index.x, [branch(b) for b in branches])
      return [_Val(o, True) for o in outs]
    results = [self.run(b.jaxpr, b.consts, ops, self._mask_and(mask, index.x == i))
               for i, b in enumerate(branches)]
    return [self.select(index, values) for values in zip(*results)]

  def while_loop(self, eqn: Any, ins: list, mask: Any) -> list:
    p = eqn.params
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
    cconsts, bconsts = ins[:p["cond_nconsts"]], ins[p["cond_nconsts"]:][:p["body_nconsts"]]
    init = [_array(v, self.n) for v in ins[p["cond_nconsts"] + p["body_nconsts"]:]]

    def going(carry):
      pred = self.run(cj.jaxpr, cj.consts, cconsts + [_Val(c, True) for c in carry], None)[0]
      if not pred.batched and mask is None:
        return pred.x, None
      return None, self._mask_and(mask, _array(pred, self.n))

    def cond_fn(carry):
      shared, active = going(carry)
      return shared if active is None else jnp.any(active)

    def body_fn(carry):
      _, active = going(carry)
      outs = self.run(bj.jaxpr, bj.consts, bconsts + [_Val(c, True) for c in carry], active)
      new = [_array(o, self.n) for o in outs]
      if active is None:
        return new
      return [jnp.where(active.reshape((self.n,) + (1,) * (x.ndim - 1)), x, c)
              for x, c in zip(new, carry)]

    return [_Val(o, True) for o in lax.while_loop(cond_fn, body_fn, init)]

  def scan(self, eqn: Any, ins: list, mask: Any) -> list:
    jaxpr, consts, n_consts, n_carry = internals.scan_layout(eqn.params)
    inner_consts = ins[:n_consts]
    init = [_array(v, self.n) for v in ins[n_consts:n_consts + n_carry]]
    xs_vals = ins[n_consts + n_carry:]
    xs = [jnp.moveaxis(v.x, 0, 1) if v.batched else v.x for v in xs_vals]

    def body(carry, x):
      args = (inner_consts + [_Val(c, True) for c in carry]
              + [_Val(xi, v.batched) for xi, v in zip(x, xs_vals)])
      outs = self.run(jaxpr, consts, args, mask)
      return ([_array(o, self.n) for o in outs[:n_carry]],
              [_array(o, self.n) for o in outs[n_carry:]])

    carry, ys = lax.scan(body, init, xs, length=eqn.params["length"],
                         reverse=eqn.params["reverse"])
    return [_Val(c, True) for c in carry] + [_Val(jnp.moveaxis(y, 0, 1), True) for y in ys]


# ------------------------------------------------------------------ the mesh kernel
def _stacked_block(block: Any, n: int) -> Any:
  """`block` of the stack of n devices' arrays: one more leading dimension, whole."""
  im = block.index_map

  def index_map(*args):
    return (np.int32(0), *jax.core.eval_jaxpr(im.jaxpr, im.consts, *args))

  new_map = jax.make_jaxpr(index_map)(*im.in_avals)
  return block.replace(array_shape=(n, *block.array_shape),
                       dims=(BlockDimension("blocked", n), *block.dims), index_map=new_map,
                       slice_size_dims=tuple(d + 1 for d in block.slice_size_dims))


def _check_supported(kernel: KernelDescription) -> None:
  gm = kernel.grid_mapping
  where = f"kernel '{kernel.name}' ({kernel.source})"
  if gm.dynamic_axes:
    raise PalletError(f"{where} talks to other devices and has grid sizes computed at run "
                      f"time; pallet runs such kernels as the whole mesh in lockstep, which "
                      f"needs static grid sizes")
  n_ids = len(gm.grid)
  for b in (*gm.inputs, *gm.outputs):
    read = {v for e in b.index_map.jaxpr.eqns for v in e.invars}
    if any(v in read for v in b.index_map.jaxpr.invars[n_ids:]):
      raise PalletError(f"{where}: the index map of {b.origin} reads scalar-prefetch "
                        f"operands; in a kernel that talks to other devices every device "
                        f"would place its blocks differently, which pallet's lockstep "
                        f"execution of the whole mesh does not support (use whole-array "
                        f"operands, memory_space=pltpu.ANY, and copy blocks with DMAs)")


@trace_cache.kernel_cache
def mesh_kernel(kernel: KernelDescription, mesh: Mesh) -> KernelDescription:
  """The kernel of all `mesh.n` devices at once (see the module docstring). Its
  operands are the devices' operands stacked along a new leading axis; so are its
  outputs."""
  _check_supported(kernel)
  gm = kernel.grid_mapping
  n, n_ids = mesh.n, len(gm.grid)
  stack = lambda a: jax.core.ShapedArray((n, *a.shape), a.dtype)
  barrier = jax.core.ShapedArray((n,), jnp.int32)
  with internals.vma_checks_off():
    new_gm = gm.replace(
        prefetch_avals=tuple(stack(a) for a in gm.prefetch_avals),
        inputs=tuple(_stacked_block(b, n) for b in gm.inputs),
        outputs=tuple(_stacked_block(b, n) for b in gm.outputs),
        scratch_avals=(*(stack(a) for a in gm.scratch_avals), barrier),
        dimension_semantics=("arbitrary",) * len(gm.grid))
    ref_avals = ([internals.AbstractRef(a) for a in new_gm.prefetch_avals]
                 + [internals.AbstractRef(b.kernel_aval) for b in new_gm.inputs]
                 + [internals.AbstractRef(b.kernel_aval) for b in new_gm.outputs]
                 + [internals.AbstractRef(a) for a in new_gm.scratch_avals])
    id_avals = [jax.core.ShapedArray((), jnp.int32)] * n_ids

    def body(*args):
      ids, refs = args[:n_ids], args[n_ids:]
      step = _Lockstep(kernel, mesh, refs[-1])
      step.run(kernel.jaxpr.jaxpr, kernel.jaxpr.consts,
               [_Val(i, False) for i in ids] + [_Ref(r) for r in refs[:-1]], None)
      return []

    jaxpr = jax.make_jaxpr(body)(*id_avals, *ref_avals)
  names = kernel.ref_names + ("barrier semaphore",) if kernel.ref_names else ()
  return kernel.replace(jaxpr=jaxpr, grid_mapping=new_gm, ref_names=names, closed_over=())

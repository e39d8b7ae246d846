"""Asynchronous copies (DMAs) and semaphores, as TPU kernels use them.

A semaphore is an int32 ref (scratch in `MemorySpace.SEMAPHORE`). A DMA copies at
`.start()` and adds the number of copied elements to its semaphore; `.wait()`
checks that the semaphore holds at least the elements of the described copy and
takes them off. On a TPU the data may land any time before the wait completes,
so a correct kernel cannot tell the difference: the copy is visible after the
wait, as the hardware promises. A wait that the semaphore can never satisfy
(nothing else runs concurrently on the CPU) is a run-time error naming the
source line, where a TPU would hang.

Each primitive has its abstract evaluation and its discharge rule (the
sequential meaning every backend compiles) side by side.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive, subjaxprs

from pallet import _internals as internals
from pallet.core import checks, device_ids, dynamic_views, primitives, ref_views
from pallet.errors import PalletError
from pallet.core.refs_select import SelectedRef
from pallet.core.specs import MemorySpace, ScratchShape

# Names of the primitives below: the XLA plan runs kernels that use them in exact
# grid order, since copies and semaphores carry state from one grid step to the next.
# The remote and lockstep ones (pallet/distributed/remote.py,
# pallet/distributed/lockstep_ops.py) count too.
DMA_PRIMITIVE_NAMES = frozenset({"dma_start", "dma_wait", "semaphore_signal",
                                 "semaphore_wait", "semaphore_read", "remote_copy_start",
                                 "remote_semaphore_signal", "barrier_semaphore",
                                 "lockstep_copy", "lockstep_signal", "lockstep_wait"})


def uses_dmas(jaxpr: Any) -> bool:
  """Whether `jaxpr` (or a jaxpr nested in it) binds one of the primitives below."""
  return (any(eqn.primitive.name in DMA_PRIMITIVE_NAMES for eqn in jaxpr.eqns)
          or any(uses_dmas(sub) for sub in subjaxprs(jaxpr)))


# ------------------------------------------------------------------ semaphore types
@dataclasses.dataclass(frozen=True)
class SemaphoreScratch(ScratchShape):
  """A semaphore (or array of semaphores) requested as scratch or in run_scoped.

  `SemaphoreType.DMA` is one semaphore; `SemaphoreType.DMA((2,))` an array of two.
  """
  kind: str = "regular"

  def __call__(self, shape: int | tuple[int, ...]) -> "SemaphoreScratch":
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    return SemaphoreScratch(shape, jnp.int32, MemorySpace.SEMAPHORE, self.kind)


class SemaphoreType:
  """`pltpu.SemaphoreType`: DMA semaphores count copied elements, REGULAR ones count signals."""
  REGULAR = SemaphoreScratch((), jnp.int32, MemorySpace.SEMAPHORE, "regular")
  DMA = SemaphoreScratch((), jnp.int32, MemorySpace.SEMAPHORE, "dma")
  BARRIER = SemaphoreScratch((), jnp.int32, MemorySpace.SEMAPHORE, "barrier")


class dma_semaphore:
  """`pltpu.dma_semaphore`, the DMA semaphore dtype: `pltpu.SEMAPHORE((2,), dma_semaphore)`
  requests two DMA semaphores (int32 counters on the CPU, like every semaphore here)."""


# ------------------------------------------------------------------ helpers
def kernel_site() -> str:
  """"kernel 'name' at file:line" for the user code being traced now."""
  name = primitives.current_kernel_name()
  return f"{f'kernel {name!r}' if name else 'a kernel'} at {checks.user_source()}"


def _is_ref(x: Any) -> bool:
  if isinstance(x, (internals.TransformedRef, SelectedRef)):
    return True
  try:
    return isinstance(jax.typeof(x), internals.AbstractRef)
  except TypeError:
    return False


def check_ref(x: Any, api: str, what: str) -> None:
  if not _is_ref(x):
    raise PalletError(f"{api} in {kernel_site()}: {what} must be a ref (a kernel parameter, "
                      f"scratch buffer or a view such as ref.at[...]), got "
                      f"{type(x).__name__}")


def semaphore_view(sem: Any, api: str) -> tuple[Any, tuple[Any, ...]]:
  check_ref(sem, api, "the semaphore")
  base, transforms = primitives.ref_and_transforms(sem)
  aval = primitives.view_aval(jax.typeof(base), transforms)
  if aval.shape != () or aval.dtype != jnp.int32:
    raise PalletError(f"{api} in {kernel_site()}: the semaphore must be a single semaphore "
                      f"(e.g. sems.at[i] of a SemaphoreType.DMA((n,)) array), got a "
                      f"{aval.dtype}{list(aval.shape)} ref")
  return base, transforms


def _replace(new_values: dict[int, Any], n: int) -> tuple[Any, ...]:
  return tuple(new_values.get(i) for i in range(n))


def _sem_add(sem_value: jax.Array, transforms: Any, delta: Any) -> jax.Array:
  return ref_views.update(sem_value, transforms,
                          lambda current: current + jnp.asarray(delta, jnp.int32))


def _sem_take(sem_value: jax.Array, transforms: Any, amount: Any, message: str) -> jax.Array:
  """The semaphore less `amount`, checked to hold at least that much first."""
  def taken(current):
    checks.check(current >= amount, message)
    return current - jnp.asarray(amount, jnp.int32)
  return ref_views.update(sem_value, transforms, taken)


# ------------------------------------------------------------------ dma_start
dma_start_p = Primitive("dma_start")
dma_start_p.multiple_results = True

# Slots of the flattened operand tuple (src, src_t, dst, dst_t, sem, sem_t, src_sem, src_sem_t).
_SRC, _SRC_T, _DST, _DST_T, _SEM, _SEM_T, _SRC_SEM, _SRC_SEM_T = range(8)


def _dma_start_abstract_eval(*avals, tree, add, shared_sem):
  parts = jax.tree_util.tree_unflatten(tree, list(range(len(avals))))
  effects = {internals.ReadEffect(parts[_SRC]), internals.WriteEffect(parts[_DST])}
  if add:
    effects.add(internals.ReadEffect(parts[_DST]))
  effects.update(internals.WriteEffect(parts[s]) for s in (_SEM, _SRC_SEM)
                 if parts[s] is not None)
  return [], effects


dma_start_p.def_effectful_abstract_eval(_dma_start_abstract_eval)


@internals.register_discharge_rule(dma_start_p)
def _dma_start_discharge(in_avals, out_avals, *args, tree, add, shared_sem):
  """`shared_sem`: the source semaphore is in the same semaphore array as the destination
  one (passed once, as `sem`, with both views applied to it)."""
  src, src_t, dst, dst_t, sem, sem_t, src_sem, src_sem_t = jax.tree_util.tree_unflatten(
      tree, args)
  pos = jax.tree_util.tree_unflatten(tree, list(range(len(args))))
  if dynamic_views.has_dynamic_size(src_t) or dynamic_views.has_dynamic_size(dst_t):
    new_dst, copied = _copy_dynamic(src, src_t, dst, dst_t, add)
  else:
    data = ref_views.read(src, src_t)
    if add:
      new_dst = ref_views.update(dst, dst_t, lambda old: (old + data).astype(dst.dtype))
    else:
      new_dst = ref_views.write(dst, dst_t, data.astype(dst.dtype))
    copied = data.size
  new = {pos[_DST]: new_dst}
  if shared_sem:
    sem = _sem_add(sem, src_sem_t, copied)
  for slot, value, transforms in ((_SEM, sem, sem_t), (_SRC_SEM, src_sem, src_sem_t)):
    if value is not None:
      new[pos[slot]] = _sem_add(value, transforms, copied)
  return _replace(new, len(args)), []


def _copy_dynamic(src: Any, src_t: Any, dst: Any, dst_t: Any, add: bool) -> tuple[Any, Any]:
  """(new destination, elements copied) for a copy whose size is known at run time: a
  masked copy over the static bound of each dimension (see dynamic_views.py)."""
  src_w = dynamic_views.window(src.shape, src_t)
  dst_w = dynamic_views.window(dst.shape, dst_t)
  bounds = [min(a, b) for a, b in zip(src_w.view_bounds, dst_w.view_bounds)]
  counts = [dynamic_views.smallest(a, b, n)
            for a, b, n in zip(src_w.view_sizes, dst_w.view_sizes, bounds)]
  data = dynamic_views.read(src, src_w, bounds)
  return dynamic_views.write(dst, dst_w, bounds, counts, data, add=add), \
      dynamic_views.product(counts)


# ------------------------------------------------------------------ dma_wait
_SEM_WAIT = 2   # slot of the semaphore in dma_wait's (ref, ref_t, sem, sem_t)
dma_wait_p = Primitive("dma_wait")
dma_wait_p.multiple_results = True


def _dma_wait_abstract_eval(ref_aval, *avals, tree, message):
  parts = jax.tree_util.tree_unflatten(tree, list(range(1 + len(avals))))
  return [], {internals.WriteEffect(parts[_SEM_WAIT])}


dma_wait_p.def_effectful_abstract_eval(_dma_wait_abstract_eval)


@internals.register_discharge_rule(dma_wait_p)
def _dma_wait_discharge(in_avals, out_avals, *args, tree, message):
  ref, ref_t, sem, sem_t = jax.tree_util.tree_unflatten(tree, args)
  pos = jax.tree_util.tree_unflatten(tree, list(range(len(args))))
  if dynamic_views.has_dynamic_size(ref_t):   # waits for what the copy moved
    size = dynamic_views.window(in_avals[0].inner_aval.shape, ref_t).count()
  else:
    size = primitives.view_aval(in_avals[0], ref_t).size
  return _replace({pos[_SEM_WAIT]: _sem_take(sem, sem_t, size, message)}, len(args)), []


# ------------------------------------------------------------------ run-time sizes
def _dynamic_window(base: Any, transforms: Any, api: str, what: str) -> dynamic_views.Window:
  window = dynamic_views.window(jax.typeof(base).shape, transforms)
  if window is None:
    raise PalletError(f"{api} in {kernel_site()}: {what} is a view with a size known only at "
                      f"run time (pl.ds(start, n) with a traced n) combined with strides, "
                      f"integer-array indices, a bitcast or a reshape of part of the array; "
                      f"expected unit-stride slices, integer indices and reshapes of whole "
                      f"trailing dimensions only")
  return window


def _describe_window(dtype: Any, window: dynamic_views.Window) -> str:
  dims = [str(int(n)) if dynamic_views.is_static(n) else f"<= {b} (known at run time)"
          for n, b in zip(window.view_requested, window.view_bounds)]
  return f"{jnp.dtype(dtype).name}[{', '.join(dims)}]"


def check_copy_ends(src: Any, src_t: Any, dst: Any, dst_t: Any,
                    api: str = "make_async_copy") -> None:
  """The two ends of a copy (local, or remote with `api` "make_async_remote_copy") must
  have the same shape and dtype: an error now, or for sizes known only at run time, a
  check when the copy starts."""
  if dynamic_views.has_dynamic_size(src_t) or dynamic_views.has_dynamic_size(dst_t):
    _check_dynamic_copy(src, src_t, dst, dst_t, api)
    return
  src_aval = primitives.view_aval(jax.typeof(src), src_t)
  dst_aval = primitives.view_aval(jax.typeof(dst), dst_t)
  if src_aval.shape != dst_aval.shape or src_aval.dtype != dst_aval.dtype:
    raise PalletError(f"{api} in {kernel_site()}: source {src_aval.str_short()} and "
                      f"destination {dst_aval.str_short()} must have the same shape and dtype")


def _check_dynamic_copy(src: Any, src_t: Any, dst: Any, dst_t: Any, api: str) -> None:
  """Both ends of a copy whose size is known at run time must agree in rank and dtype,
  static sizes now, run-time sizes when the copy starts (a mismatch fails the kernel)."""
  src_w = _dynamic_window(src, src_t, f"{api}(...).start()", "the source")
  dst_w = _dynamic_window(dst, dst_t, f"{api}(...).start()", "the destination")
  src_dtype, dst_dtype = jax.typeof(src).dtype, jax.typeof(dst).dtype
  shapes = (f"source {_describe_window(src_dtype, src_w)} and destination "
            f"{_describe_window(dst_dtype, dst_w)}")
  if len(src_w.visible) != len(dst_w.visible) or src_dtype != dst_dtype:
    raise PalletError(f"{api} in {kernel_site()}: {shapes} must have the same "
                      f"shape and dtype")
  for axis, (a, b) in enumerate(zip(src_w.view_requested, dst_w.view_requested)):
    if dynamic_views.is_static(a) and dynamic_views.is_static(b):
      if a != b:
        raise PalletError(f"{api} in {kernel_site()}: {shapes} must have the "
                          f"same shape and dtype")
      continue
    if a is b:   # the same run-time value at both ends (`pl.ds(i, n)` to `pl.ds(j, n)`)
      continue
    checks.check(jnp.asarray(a, jnp.int32) == jnp.asarray(b, jnp.int32),
                 f"{api} in {kernel_site()}: {shapes} differ in size along "
                 f"dimension {axis} when the copy starts; expected the same size at both "
                 f"ends")


# ------------------------------------------------------------------ the descriptor
@dataclasses.dataclass
class AsyncCopyDescriptor:
  """A DMA from `src_ref` to `dst_ref` signalling `dst_sem` and `src_sem` (where given)."""
  src_ref: Any
  dst_ref: Any
  dst_sem: Any
  src_sem: Any = None

  def _started_with_selected_ref(self, priority: int, add: bool) -> bool:
    """pl.select_ref among refs or semaphores: starts the copy with the chosen one."""
    for end in ("src_ref", "dst_ref", "dst_sem", "src_sem"):
      chosen = getattr(self, end)
      if isinstance(chosen, SelectedRef):
        chosen.write(lambda r: dataclasses.replace(self, **{end: r}).start(priority, add=add))
        return True
    return False

  def start(self, priority: int = 0, *, add: bool = False) -> None:
    """Copies now (a TPU would copy in the background) and signals the semaphore(s)."""
    if self._started_with_selected_ref(priority, add):
      return
    del priority
    src, src_t = primitives.ref_and_transforms(self.src_ref)
    dst, dst_t = primitives.ref_and_transforms(self.dst_ref)
    sem, sem_t = self._semaphore(self.dst_sem)
    src_sem, src_sem_t = self._semaphore(self.src_sem)
    shared_sem = src_sem is not None and src_sem is sem
    if shared_sem:
      src_sem = None
    check_copy_ends(src, src_t, dst, dst_t)
    flat, tree = jax.tree_util.tree_flatten(
        (src, src_t, dst, dst_t, sem, sem_t, src_sem, src_sem_t))
    dma_start_p.bind(*flat, tree=tree, add=add, shared_sem=shared_sem)

  @staticmethod
  def _semaphore(sem: Any) -> tuple[Any, tuple[Any, ...]]:
    if sem is None:
      return None, ()
    return semaphore_view(sem, "make_async_copy(...).start()")

  def _wait_on(self, ref: Any, sem: Any, which: str) -> None:
    if sem is None:
      raise PalletError(f"make_async_copy(...).{which}() in {kernel_site()}: this copy has no "
                        f"semaphore to wait on (pass one to make_async_copy)")
    if isinstance(sem, SelectedRef):   # wait on the chosen semaphore only
      sem.write(lambda chosen: self._wait_on(ref, chosen, which))
      return
    if isinstance(ref, SelectedRef):   # every candidate has the same shape: any one sizes the wait
      ref = ref.refs[0]
    base, transforms = primitives.ref_and_transforms(ref)
    sem, sem_t = semaphore_view(sem, "make_async_copy(...).wait()")
    if dynamic_views.has_dynamic_size(transforms):
      _dynamic_window(base, transforms, f"make_async_copy(...).{which}()", "the waited-on ref")
      amount = "the elements of its copy (a number known at run time)"
    else:
      amount = f"{primitives.view_aval(jax.typeof(base), transforms).size} copied elements"
    message = (f"DMA wait in {kernel_site()}: waits for {amount}, but the copies "
               f"started on its semaphore delivered fewer; nothing else can signal it, so on "
               f"a TPU this wait would never finish")
    flat, tree = jax.tree_util.tree_flatten((base, transforms, sem, sem_t))
    dma_wait_p.bind(*flat, tree=tree, message=message)

  def wait(self) -> None:
    """Waits until the copy has arrived (and was read, when a source semaphore is given)."""
    if self.src_sem is not None:
      self.wait_send()
    self.wait_recv()

  def wait_recv(self) -> None:
    """Waits for the copy's data to arrive in `dst_ref`."""
    self._wait_on(self.dst_ref, self.dst_sem, "wait_recv")

  wait_write = wait_recv

  def wait_send(self) -> None:
    """Waits for the copy to have read `src_ref` (needs `src_sem`)."""
    self._wait_on(self.src_ref, self.src_sem, "wait_send")

  wait_read = wait_send


def make_async_copy(src_ref: Any, dst_ref: Any, sem: Any = None, *,
                    src_sem: Any = None) -> AsyncCopyDescriptor:
  """Describes a copy `src_ref -> dst_ref` whose arrival `sem` counts; start it with `.start()`."""
  for what, r in (("src_ref", src_ref), ("dst_ref", dst_ref)):
    check_ref(r, "make_async_copy", what)
  return AsyncCopyDescriptor(src_ref, dst_ref, sem, src_sem)


def async_copy(src_ref: Any, dst_ref: Any, sem: Any = None, *, src_sem: Any = None,
               priority: int = 0, add: bool = False) -> AsyncCopyDescriptor:
  """Starts a copy and returns its descriptor (to `.wait()` on)."""
  copy = make_async_copy(src_ref, dst_ref, sem, src_sem=src_sem)
  copy.start(priority=priority, add=add)
  return copy


def sync_copy(src_ref: Any, dst_ref: Any, *, add: bool = False) -> None:
  """Copies a pytree of refs into another and waits for the copies."""
  srcs, tree = jax.tree_util.tree_flatten(src_ref, is_leaf=_is_ref)
  dsts = tree.flatten_up_to(dst_ref)
  if not srcs:
    return
  sem = jax.new_ref(jnp.zeros((), jnp.int32))
  copies = [make_async_copy(s, d, sem) for s, d in zip(srcs, dsts)]
  for c in copies:
    c.start(add=add)
  for c in copies:
    c.wait()


# ------------------------------------------------------------------ semaphores
semaphore_signal_p = Primitive("semaphore_signal")
semaphore_signal_p.multiple_results = True
semaphore_wait_p = Primitive("semaphore_wait")
semaphore_wait_p.multiple_results = True
semaphore_read_p = Primitive("semaphore_read")


def _sem_operands(sem: Any, api: str) -> tuple[list[Any], Any]:
  base, transforms = semaphore_view(sem, api)
  return jax.tree_util.tree_flatten((base, transforms))


def semaphore_signal(sem_or_view: Any, inc: Any = 1, *, device_id: Any = None,
                     device_id_type: Any = None, core_index: Any = None) -> None:
  """Adds `inc` to a semaphore, on the device `device_id` names when given (see
  pallet/distributed/remote.py)."""
  if core_index is not None:
    device_ids.check_core_index(core_index, "semaphore_signal", kernel_site())
  if device_id is not None:
    from pallet.distributed import remote   # remote builds on this module
    remote.signal(sem_or_view, inc, device_id, device_id_type)
    return
  if isinstance(sem_or_view, SelectedRef):
    sem_or_view.write(lambda chosen: semaphore_signal(chosen, inc))
    return
  flat, tree = _sem_operands(sem_or_view, "semaphore_signal")
  semaphore_signal_p.bind(*flat, jnp.asarray(inc, jnp.int32), tree=tree)


def semaphore_wait(sem_or_view: Any, value: Any = 1, *, decrement: bool = True) -> None:
  """Waits until a semaphore holds at least `value`; then takes `value` off (if `decrement`)."""
  if isinstance(sem_or_view, SelectedRef):
    sem_or_view.write(lambda chosen: semaphore_wait(chosen, value, decrement=decrement))
    return
  message = (f"semaphore_wait in {kernel_site()}: waits for more than the semaphore holds, and "
             f"nothing else can signal it, so on a TPU this wait would never finish")
  flat, tree = _sem_operands(sem_or_view, "semaphore_wait")
  semaphore_wait_p.bind(*flat, jnp.asarray(value, jnp.int32), tree=tree,
                        decrement=decrement, message=message)


def semaphore_read(sem_or_view: Any) -> jax.Array:
  """The semaphore's current value (an int32 scalar)."""
  if isinstance(sem_or_view, SelectedRef):
    return sem_or_view.read(semaphore_read)
  flat, tree = _sem_operands(sem_or_view, "semaphore_read")
  return semaphore_read_p.bind(*flat, tree=tree)


semaphore_signal_p.def_effectful_abstract_eval(
    lambda *avals, tree: ([], {internals.WriteEffect(0)}))


@internals.register_discharge_rule(semaphore_signal_p)
def _semaphore_signal_discharge(in_avals, out_avals, sem, *args, tree):
  *flat_t, inc = args
  _, transforms = jax.tree_util.tree_unflatten(tree, [sem, *flat_t])
  return (_sem_add(sem, transforms, inc),) + (None,) * len(args), []


semaphore_wait_p.def_effectful_abstract_eval(
    lambda *avals, tree, decrement, message: ([], {internals.WriteEffect(0)}))


@internals.register_discharge_rule(semaphore_wait_p)
def _semaphore_wait_discharge(in_avals, out_avals, sem, *args, tree, decrement, message):
  *flat_t, value = args
  _, transforms = jax.tree_util.tree_unflatten(tree, [sem, *flat_t])
  if decrement:
    return (_sem_take(sem, transforms, value, message),) + (None,) * len(args), []
  checks.check(ref_views.read(sem, transforms) >= value, message)
  return (None,) * (1 + len(args)), []


semaphore_read_p.def_effectful_abstract_eval(
    lambda *avals, tree: (jax.core.ShapedArray((), jnp.int32), {internals.ReadEffect(0)}))


@internals.register_discharge_rule(semaphore_read_p)
def _semaphore_read_discharge(in_avals, out_avals, sem, *flat_t, tree):
  _, transforms = jax.tree_util.tree_unflatten(tree, [sem, *flat_t])
  return (None,) * (1 + len(flat_t)), ref_views.read(sem, transforms)

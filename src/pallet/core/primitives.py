"""What a kernel body can call: grid queries, masked loads/stores, atomics, hints.

Each primitive is declared once, with its abstract evaluation and its state
discharge rule (the sequential, pure meaning that the CPU backend compiles and
that every other backend must agree with) right below it. Plain reads and writes
of refs are JAX's own `get`/`swap`; pallet adds primitives only where JAX has no
equivalent (masks, atomics, compiler hints, printing).
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal, Primitive
from jax.interpreters import mlir

from pallet import _internals as internals
from pallet.core import array_ops, checks
from pallet.core.grid_context import (_GridContext, _grid_contexts, current_grid_names,
                                      current_kernel_name, grid_context)
from pallet.core.specs import MemorySpace, ScratchShape
from pallet.errors import PalletError

Slice = internals.Slice


def ds(start: Any, size: int | None = None, stride: int = 1) -> Slice | slice:
  """A dynamic slice `start : start + size*stride : stride` for indexing refs
  (`ds(None)` is `:`, as in JAX)."""
  if start is None and size is None:
    return slice(None)
  if size is None:
    start, size = 0, start
  return internals.Slice(start, size, stride)


dslice = ds


def cdiv(a: Any, b: Any) -> Any:
  """Ceiling division, for ints and JAX scalars alike."""
  if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
    return -(-int(a) // int(b))
  return lax.div(a + b - 1, b)


# the grid context (program ids, grid, kernel name) lives in grid_context.py


def _named_grid_index(axis_name: Any) -> Any:
  """The program id of the named grid axis `axis_name` of the kernel being traced, or None."""
  return current_grid_names().get(axis_name)


internals.register_axis_index_substitution(_named_grid_index)


def _current_grid(fn_name: str) -> _GridContext:
  if not _grid_contexts:
    raise RuntimeError(f"pl.{fn_name} may only be called inside a kernel run by "
                       f"pallas_call")
  return _grid_contexts[-1]


def _check_axis(axis: int, ctx: _GridContext, fn_name: str) -> int:
  if not isinstance(axis, (int, np.integer)) or not -len(ctx.grid) <= axis < len(ctx.grid):
    raise ValueError(f"pl.{fn_name}({axis!r}): the grid {ctx.grid} has "
                     f"{len(ctx.grid)} axes")
  return int(axis) % len(ctx.grid)


def program_id(axis: int) -> jax.Array:
  """This program's index along grid axis `axis` (an int32 scalar).

  Traced kernels take the grid indices as their leading jaxpr inputs, so every
  backend decides for itself where they come from (a launch index, a loop
  counter, a vectorized iota).
  """
  ctx = _current_grid("program_id")
  return ctx.program_ids[_check_axis(axis, ctx, "program_id")]


def num_programs(axis: int) -> int | jax.Array:
  """The size of grid axis `axis`: a Python int where the size is static (as in
  Pallas, so it can drive Python loops and shapes), an int32 scalar where it is
  computed at run time. Works in kernels and in index maps."""
  ctx = _current_grid("num_programs")
  size = ctx.grid[_check_axis(axis, ctx, "num_programs")]
  if size is None:
    raise PalletError(f"pl.num_programs({axis}) in an index map of kernel "
                      f"'{ctx.kernel_name}' at {checks.user_source()}: the size of grid axis "
                      f"{axis} is computed at run time, which pallet's index maps do not receive; "
                      f"pass it as a scalar-prefetch operand instead")
  if isinstance(size, (int, np.integer)):
    return int(size)
  return jnp.asarray(size, jnp.int32)


# ------------------------------------------------------------------ ref helpers
def ref_and_transforms(ref: Any) -> tuple[Any, tuple[Any, ...]]:
  """(base ref, transforms) of `ref` or of a view of it such as `ref.at[...]`."""
  if isinstance(ref, internals.TransformedRef):
    return ref.ref, tuple(ref.transforms)
  return ref, ()


def view_aval(ref_aval: Any, transforms: Sequence[Any]) -> Any:
  """The array aval of a ref typed `ref_aval` seen through `transforms`."""
  aval = getattr(ref_aval, "inner_aval", ref_aval)
  for t in transforms:
    aval = t.transform_type(aval)
  return aval


def _as_transformed(ref: Any, idx: Any) -> tuple[Any, tuple[Any, ...]]:
  """(base ref, transforms) for `ref` or `ref.at[...]`, further indexed by idx."""
  if idx is not None:
    if not isinstance(idx, tuple):
      idx = (idx,)
    ref = ref.at[idx]
  return ref_and_transforms(ref)


def _ref_view(base: Any, transforms: tuple[Any, ...]) -> Any:
  """`base` seen through `transforms`, as a ref JAX's own get/swap accept."""
  return internals.TransformedRef(base, transforms) if transforms else base


def _view_shape_dtype(ref_aval: Any, transforms: Sequence[Any]) -> tuple[tuple[int, ...], Any]:
  aval = view_aval(ref_aval, transforms)
  return tuple(aval.shape), aval.dtype


def _indexer_positions(indexer: Any) -> tuple[jax.Array, ...]:
  """Unclamped integer positions, one broadcastable array per dimension, that
  `indexer` selects (NumPy placement: advanced indices go where the first one is
  when they are adjacent, else in front)."""
  indices = indexer.indices
  is_int = [not isinstance(i, internals.Slice) for i in indices]
  int_shape = tuple(indexer.int_indexer_shape)
  int_dims = [d for d, b in enumerate(is_int) if b]
  adjacent = not int_dims or int_dims == list(range(int_dims[0], int_dims[-1] + 1))
  slice_dims = [d for d, b in enumerate(is_int) if not b]
  if adjacent and int_dims:
    before = [d for d in slice_dims if d < int_dims[0]]
    after = [d for d in slice_dims if d > int_dims[0]]
  else:
    before, after = [], slice_dims
  out_rank = len(before) + len(int_shape) + len(after)
  positions = []
  for d, idx in enumerate(indices):
    if is_int[d]:
      arr = jnp.broadcast_to(jnp.asarray(idx, jnp.int32), int_shape)
      lead = len(before)
      positions.append(arr.reshape((1,) * lead + int_shape
                                   + (1,) * (out_rank - lead - len(int_shape))))
    else:
      pos = (before.index(d) if d in before
             else len(before) + len(int_shape) + after.index(d))
      arr = (jnp.asarray(idx.start, jnp.int32)
             + jnp.asarray(idx.stride, jnp.int32) * lax.iota(jnp.int32, idx.size))
      shape = [1] * out_rank
      shape[pos] = idx.size
      positions.append(arr.reshape(shape))
  return tuple(positions)


def _element_offsets(base_shape: tuple[int, ...], transforms: Sequence[Any]) -> jax.Array:
  """Flat offsets into the base ref of every element of the transformed view.

  The last indexer may reach outside the view (callers mask those elements):
  such elements get offset -1 instead of being clamped onto valid ones.
  """
  offsets = lax.iota(jnp.int32, math.prod(base_shape)).reshape(base_shape)
  if not transforms:
    return offsets
  offsets = internals.transform_array(offsets, list(transforms[:-1]))
  last = transforms[-1]
  if not isinstance(last, internals.NDIndexer):
    return internals.transform_array(offsets, [last])
  return array_ops.take_or_fill(offsets, _indexer_positions(last), -1)


def _window(ref_shape: tuple[int, ...], transforms: Sequence[Any]) -> Any:
  """(starts, sizes, kept dims) when the view is one rectangular window of the base
  ref: a single indexer of unit-stride slices and scalar indices. Masked loads and
  stores of such views (Triton-style `x_ref.at[pl.ds(i, n), :]`) then discharge to
  a slice of the ref, not to a gather of every element at computed flat offsets,
  which XLA runs as a per-element gather, batched under vmap. No transforms at all
  (`plgpu.load(x_ref, mask=...)`) is the window of the whole ref."""
  if not transforms:
    return [0] * len(ref_shape), list(ref_shape), [True] * len(ref_shape)
  if len(transforms) != 1 or not isinstance(transforms[0], internals.NDIndexer):
    return None
  indexer = transforms[0]
  if tuple(indexer.int_indexer_shape) != () or len(indexer.indices) != len(ref_shape):
    return None
  starts, sizes, kept = [], [], []
  for idx in indexer.indices:
    if isinstance(idx, internals.Slice):
      if not (isinstance(idx.stride, int) and idx.stride == 1):
        return None
      starts.append(idx.start)
      sizes.append(idx.size)
      kept.append(True)
    else:
      if jnp.shape(idx) != () or not jnp.issubdtype(jnp.result_type(idx), jnp.integer):
        return None
      starts.append(idx)
      sizes.append(1)
      kept.append(False)
  return starts, sizes, kept


def _static(start: Any) -> bool:
  return isinstance(start, (int, np.integer))


def _whole(starts: Sequence[Any], sizes: Sequence[int], shape: tuple[int, ...]) -> bool:
  """Whether a window is its whole ref: read and written as the ref itself, with no
  slice a pass over the body would have to see through."""
  return tuple(sizes) == tuple(shape) and all(_static(st) and st == 0 for st in starts)


def _window_place(ref_value: jax.Array, starts: Sequence[Any], sizes: Sequence[int]):
  """(buffer, window start in it, positions valid in the ref or None, padding, whether
  the window lies wholly outside) for a window that may overhang the ref: the ref is
  padded with zeros by the window size where the start is not known to be inside, so
  a start in [-size, n] is never clamped onto other elements. Only a traced start can
  lie further out; there `valid` masks the clamped window. Nothing here makes an
  array constant (a while loop's discharge rejects a body with constants)."""
  pads, buf_starts, valid, outside = [], [], None, False
  for d, (st, sz, n) in enumerate(zip(starts, sizes, ref_value.shape)):
    if _static(st):
      st = int(st)
      outside = outside or st + sz <= 0 or st >= n
      inside = 0 <= st and st + sz <= n
      pads.append((0, 0, 0) if inside else (sz, sz, 0))
      buf_starts.append(np.int32(st if inside else min(max(st + sz, 0), n + sz)))
      continue
    pads.append((sz, sz, 0))
    st = jnp.asarray(st, jnp.int32)
    buf_starts.append(st + sz)
    shape = [1] * len(sizes)
    shape[d] = sz
    pos = lax.broadcast_in_dim(st, (sz,), ()) + lax.iota(jnp.int32, sz)
    pos = lax.broadcast_in_dim(pos, tuple(sizes), (d,))
    ok = (pos >= 0) & (pos < n)
    valid = ok if valid is None else valid & ok
  buf = ref_value if all(p == (0, 0, 0) for p in pads) else lax.pad(
      ref_value, lax.full((), 0, ref_value.dtype), pads)
  return buf, buf_starts, valid, pads, outside


def _as_window(x: Any, sizes: Sequence[int]) -> Any:
  """`x` (a traced value of the window's size, or a concrete scalar) shaped as the
  window, or None where that would need an array constant."""
  if internals.is_tracer(x):
    return lax.reshape(x, tuple(sizes))
  if np.ndim(x) == 0:
    return lax.broadcast_in_dim(x, tuple(sizes), ())
  return None


def _gather(ref_value: jax.Array, offsets: jax.Array) -> jax.Array:
  """Values at flat `offsets` (negative offsets read 0)."""
  flat = ref_value.reshape(-1)
  return array_ops.take_or_fill(flat, [offsets.reshape(-1)], 0).reshape(offsets.shape)


# Discharge rules below flatten operands with `jnp.ravel`, never `x.reshape`: an operand
# may arrive as a concrete NumPy literal (a scalar value or mask), and NumPy's reshape
# would turn it into a jaxpr constant, which JAX's while-loop discharge rejects.
def _flattened(x: Any) -> Any:
  """`jnp.ravel(x)`; a traced value as one reshape, without jnp.ravel's jitted trace."""
  return lax.reshape(x, (math.prod(x.shape),)) if internals.is_tracer(x) else jnp.ravel(x)


def _split(args: Sequence[Any], counts: Sequence[int]) -> list[list[Any]]:
  out, i = [], 0
  for c in counts:
    out.append(list(args[i:i + c]))
    i += c
  return out


# ------------------------------------------------------------------ masked load
load_p = Primitive("masked_load")


def _traced_slice_start(transforms: Sequence[Any]) -> bool:
  """Whether a slice among `transforms` starts at a position known only at run time."""
  return any(isinstance(i, internals.Slice) and not _static(i.start)
             for t in transforms if isinstance(t, internals.NDIndexer) for i in t.indices)


def load(ref: Any, idx: Any = None, *, mask: Any = None, other: Any = None,
         cache_modifier: str | None = None, eviction_policy: str | None = None,
         volatile: bool = False, memory_space: Any = None) -> jax.Array:
  """Reads `ref[idx]`; where `mask` is False the result is `other` (out-of-bounds safe).

  Without a mask, a window at a start known only at run time that reaches past the
  ref is not moved back inside it (as `ref[pl.ds(start, n)]` is, following JAX): its
  rows inside the ref are where a GPU's load puts them, those outside read zero."""
  del cache_modifier, eviction_policy, volatile, memory_space  # hints for GPU backends
  base, transforms = _as_transformed(ref, idx)
  if mask is None and not _traced_slice_start(transforms):
    return _ref_view(base, transforms)[...]
  shape, dtype = _view_shape_dtype(jax.typeof(base), transforms)
  mask = jnp.broadcast_to(jnp.asarray(True if mask is None else mask, jnp.bool_), shape)
  extra = [mask]
  if other is not None:
    extra.append(jnp.broadcast_to(jnp.asarray(other, dtype), shape))
  flat, tree = jax.tree_util.tree_flatten(transforms)
  return load_p.bind(base, *flat, *extra, tree=tree, has_other=other is not None)


def _load_abstract_eval(ref_aval, *args, tree, has_other):
  transforms = jax.tree_util.tree_unflatten(tree, args[:tree.num_leaves])
  shape, dtype = _view_shape_dtype(ref_aval, transforms)
  return jax.core.ShapedArray(shape, dtype), {internals.ReadEffect(0)}


load_p.def_effectful_abstract_eval(_load_abstract_eval)


@internals.register_discharge_rule(load_p)
def _load_discharge(in_avals, out_avals, ref_value, *args, tree, has_other):
  flat, (mask, *other) = _split(args, [tree.num_leaves, 1 + has_other])
  transforms = jax.tree_util.tree_unflatten(tree, flat)
  window = _window(ref_value.shape, transforms)
  if window is not None:
    starts, sizes, kept = window
    buf, buf_starts, valid, _, outside = _window_place(ref_value, starts, sizes)
    if outside:   # elements outside the ref read 0, as the gather's fill
      view = lax.full(tuple(sizes), 0, ref_value.dtype)
    elif _whole(starts, sizes, ref_value.shape):
      view = ref_value
    else:
      view = lax.dynamic_slice(buf, buf_starts, sizes)
      if valid is not None:
        view = lax.select(valid, view, lax.full_like(view, 0))
    view = lax.reshape(view, tuple(n for n, k in zip(sizes, kept) if k))
  else:
    offsets = _element_offsets(ref_value.shape, transforms)
    view = _gather(ref_value, offsets)
  fill = other[0] if other else lax.full_like(view, 0)
  return (None,) * len(in_avals), lax.select(mask, view, fill)


# ------------------------------------------------------------------ masked store
store_p = Primitive("masked_store")
store_p.multiple_results = True


def store(ref: Any, idx: Any, val: Any = None, *, mask: Any = None,
          eviction_policy: str | None = None, memory_space: Any = None) -> None:
  """Writes `val` to `ref[idx]` where `mask` is True (masked-out writes never happen).

  Without a mask, a window at a start known only at run time that reaches past the
  ref is not moved back inside it: its rows inside the ref land where a GPU's store
  puts them, those outside are dropped (checking mode reports them)."""
  del eviction_policy, memory_space
  base, transforms = _as_transformed(ref, idx)
  shape, dtype = _view_shape_dtype(jax.typeof(base), transforms)
  value = jnp.broadcast_to(jnp.asarray(val, dtype), shape)
  if mask is None and not _traced_slice_start(transforms):
    _ref_view(base, transforms)[...] = value
    return
  mask = jnp.broadcast_to(jnp.asarray(True if mask is None else mask, jnp.bool_), shape)
  flat, tree = jax.tree_util.tree_flatten(transforms)
  store_p.bind(base, *flat, value, mask, tree=tree)


def _store_abstract_eval(ref_aval, *args, tree):
  return [], {internals.WriteEffect(0)}


store_p.def_effectful_abstract_eval(_store_abstract_eval)


def _scatter_into(ref_value, offsets, mask, update_fn):
  """Applies `update_fn(flat_ref, flat_offsets)` with masked-out offsets dropped."""
  size = math.prod(ref_value.shape)
  # lax, not jnp.where: jnp.where traces its jitted implementation per new shape
  past_end = lax.full_like(offsets, size)
  offsets = lax.select(lax.lt(offsets, lax.full_like(offsets, 0)), past_end, offsets)
  if mask is not None:
    offsets = lax.select(mask, offsets, past_end)
  flat = update_fn(ref_value.reshape(-1), offsets.reshape(-1))
  return flat.reshape(ref_value.shape)


@internals.register_discharge_rule(store_p)
def _store_discharge(in_avals, out_avals, ref_value, *args, tree):
  flat, (value, mask) = _split(args, [tree.num_leaves, 2])
  transforms = jax.tree_util.tree_unflatten(tree, flat)
  window = _window(ref_value.shape, transforms)
  if window is not None:
    sizes = window[1]
    write = _as_window(mask, sizes)
    update = _as_window(value, sizes)
  if window is not None and write is not None and update is not None:
    buf, buf_starts, valid, pads, outside = _window_place(ref_value, window[0], sizes)
    if outside:   # every write lands outside the ref: dropped
      return (ref_value,) + (None,) * (len(in_avals) - 1), []
    if _whole(window[0], sizes, ref_value.shape):
      new = lax.select(write, update.astype(ref_value.dtype), ref_value)
      return (new,) + (None,) * (len(in_avals) - 1), []
    old = lax.dynamic_slice(buf, buf_starts, sizes)
    write = write if valid is None else write & valid
    new = lax.dynamic_update_slice(
        buf, lax.select(write, update.astype(buf.dtype), old), buf_starts)
    if buf is not ref_value:
      new = lax.slice(new, [lo for lo, _, _ in pads],
                      [lo + n for (lo, _, _), n in zip(pads, ref_value.shape)])
    return (new,) + (None,) * (len(in_avals) - 1), []
  offsets = _element_offsets(ref_value.shape, transforms)
  new = _scatter_into(ref_value, offsets, mask,
                      lambda flat, idx: array_ops.set_or_drop(flat, idx, _flattened(value)))
  return (new,) + (None,) * (len(in_avals) - 1), []


def swap(ref: Any, idx: Any, value: Any, *, mask: Any = None,
         eviction_policy: str | None = None) -> jax.Array:
  """Writes `value` to `ref[idx]` (where `mask` holds) and returns what was there before
  (masked-out lanes of the result are unspecified: pallet gives the old contents or 0)."""
  old = load(ref, idx, mask=mask)
  store(ref, idx, value, mask=mask, eviction_policy=eviction_policy)
  return old


# ------------------------------------------------------------------ atomics
atomic_rmw_p = Primitive("atomic_rmw")

_ATOMIC_COMBINE: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda old, v: old + v,
    "max": jnp.maximum,
    "min": jnp.minimum,
    "and": lambda old, v: old & v,
    "or": lambda old, v: old | v,
    "xor": lambda old, v: old ^ v,
    "xchg": lambda old, v: v,
}
# Ops whose scatter form combines duplicate indices within one call, as a
# sequence of atomics on a GPU would.
_ATOMIC_SCATTER = frozenset({"add", "max", "min"})


def _atomic(op: str, ref: Any, idx: Any, value: Any, mask: Any) -> jax.Array:
  base, transforms = _as_transformed(ref, idx)
  shape, dtype = _view_shape_dtype(jax.typeof(base), transforms)
  value = jnp.broadcast_to(jnp.asarray(value, dtype), shape)
  if op in ("and", "or", "xor") and not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"pl.atomic_{op} needs an integer ref, got {dtype}")
  extra = [value]
  if mask is not None:
    extra.append(jnp.broadcast_to(jnp.asarray(mask, jnp.bool_), shape))
  flat, tree = jax.tree_util.tree_flatten(transforms)
  return atomic_rmw_p.bind(base, *flat, *extra, tree=tree, op=op, has_mask=mask is not None)


def atomic_add(ref, idx, value, *, mask=None):
  """Atomically adds `value` into `ref[idx]`; returns the previous contents."""
  return _atomic("add", ref, idx, value, mask)


def atomic_max(ref, idx, value, *, mask=None):
  return _atomic("max", ref, idx, value, mask)


def atomic_min(ref, idx, value, *, mask=None):
  return _atomic("min", ref, idx, value, mask)


def atomic_and(ref, idx, value, *, mask=None):
  return _atomic("and", ref, idx, value, mask)


def atomic_or(ref, idx, value, *, mask=None):
  return _atomic("or", ref, idx, value, mask)


def atomic_xor(ref, idx, value, *, mask=None):
  return _atomic("xor", ref, idx, value, mask)


def atomic_xchg(ref, idx, value, *, mask=None):
  return _atomic("xchg", ref, idx, value, mask)


def _atomic_rmw_abstract_eval(ref_aval, *args, tree, op, has_mask):
  transforms = jax.tree_util.tree_unflatten(tree, args[:tree.num_leaves])
  shape, dtype = _view_shape_dtype(ref_aval, transforms)
  return (jax.core.ShapedArray(shape, dtype),
          {internals.ReadEffect(0), internals.WriteEffect(0)})


atomic_rmw_p.def_effectful_abstract_eval(_atomic_rmw_abstract_eval)


def _lanes_by_target(size: int, offsets: jax.Array, mask: Any):
  """Lanes (row-major) stably sorted by the element they hit.

  Returns the sort order, the sorted targets (masked-out and out-of-range lanes
  get `size`, past every real element), and which sorted lanes start and end a
  run of lanes hitting the same element.
  """
  targets = offsets.reshape(-1)
  valid = targets >= 0
  if mask is not None:
    valid = valid & jnp.ravel(mask)
  targets = jnp.where(valid, targets, size)
  order = jnp.argsort(targets, stable=True)
  sorted_targets = targets[order]
  change = sorted_targets[1:] != sorted_targets[:-1]
  first = jnp.concatenate([jnp.ones((1,), bool), change])
  last = jnp.concatenate([change, jnp.ones((1,), bool)])
  return order, sorted_targets, first, last


def _sequential_rmw(ref_value, offsets, value, mask, combine):
  """`ref[o_i] = combine(ref[o_i], v_i)` for lanes i in row-major order, as a sequence
  of GPU atomics would do it: (new ref, value each lane saw before its update).

  A segmented scan over lanes sorted by target computes, per lane, the combination
  of the earlier lanes on the same element, so repeated targets need no loop.
  """
  size = ref_value.size
  if offsets.size == 0:
    return ref_value, jnp.zeros(offsets.shape, ref_value.dtype)
  order, targets, first, last = _lanes_by_target(size, offsets, mask)
  lane_values = jnp.ravel(value)[order]

  def segmented(a, b):
    starts_a, va = a
    starts_b, vb = b
    # lax, not jnp.where: every level of the scan has its own shape, for which
    # jnp.where would trace its jitted implementation anew
    return lax.bitwise_or(starts_a, starts_b), lax.select(starts_b, vb, combine(va, vb))
  _, running = lax.associative_scan(segmented, (first, lane_values))
  flat = ref_value.reshape(-1)
  base = flat.at[targets].get(mode="fill", fill_value=0)
  before = jnp.concatenate([running[:1], running[:-1]])
  old_sorted = jnp.where(first, base, combine(base, before))
  new_flat = flat.at[jnp.where(last, targets, size)].set(combine(base, running), mode="drop")
  old = jnp.zeros_like(old_sorted).at[order].set(old_sorted)
  return new_flat.reshape(ref_value.shape), old.reshape(offsets.shape)


def _atomic_operands(ref_value, args, tree, has_mask):
  flat, (value, *mask) = _split(args, [tree.num_leaves, 1 + has_mask])
  offsets = _element_offsets(ref_value.shape, jax.tree_util.tree_unflatten(tree, flat))
  return offsets, value, (mask[0] if mask else None)


def _atomic_scatter(ref_value, offsets, value, mask, op):
  return _scatter_into(ref_value, offsets, mask,
                       lambda flat, idx: getattr(flat.at[idx], op)(jnp.ravel(value),
                                                                   mode="drop"))


def _static_int(x: Any) -> int | None:
  if internals.is_tracer(x):
    return None
  try:
    return int(x)
  except TypeError:
    return None


def _direct_index(base_shape: tuple[int, ...], transforms: Sequence[Any]) -> tuple | None:
  """A jax.numpy index selecting the same elements as `transforms` (one indexer whose
  slices are static and inside the array), or None.

  `ref.at[index].add(v, mode="drop")` with it is the atomics' final state as XLA's
  own scatter: windows along the sliced dimensions (a row of a table per index)
  instead of one scalar per element at offsets gathered from an iota. Integer
  indices follow the same rules either way: negative ones count from the end, any
  still outside the array are dropped.
  """
  if len(transforms) != 1 or not isinstance(transforms[0], internals.NDIndexer):
    return None
  index = []
  for n, idx in zip(base_shape, transforms[0].indices):
    if not isinstance(idx, internals.Slice):
      index.append(idx)
      continue
    start, size, stride = _static_int(idx.start), _static_int(idx.size), _static_int(idx.stride)
    if start is None or size is None or stride is None or stride < 1 or start < 0 \
        or size < 1 or start + (size - 1) * stride >= n:
      return None
    index.append(slice(start, start + (size - 1) * stride + 1, stride))
  return tuple(index)


def _atomic_final_state(ref_value, args, tree, has_mask, op):
  """The ref after add/max/min atomics: one scatter of `op` (repeated targets
  combine, as a sequence of atomics does)."""
  flat, (value, *mask) = _split(args, [tree.num_leaves, 1 + has_mask])
  transforms = jax.tree_util.tree_unflatten(tree, flat)
  index = None if has_mask else _direct_index(ref_value.shape, transforms)
  if index is not None:
    return getattr(ref_value.at[index], op)(value, mode="drop")
  offsets = _element_offsets(ref_value.shape, transforms)
  return _atomic_scatter(ref_value, offsets, value, mask[0] if mask else None, op)


@internals.register_discharge_rule(atomic_rmw_p)
def _atomic_rmw_discharge(in_avals, out_avals, ref_value, *args, tree, op, has_mask):
  offsets, value, mask = _atomic_operands(ref_value, args, tree, has_mask)
  new_ref, old = _sequential_rmw(ref_value, offsets, value, mask, _ATOMIC_COMBINE[op])
  if op in _ATOMIC_SCATTER:
    # Same final state, but a plain scatter is far cheaper; the sort above is then
    # only kept by XLA when the kernel uses the returned old values.
    new_ref = _atomic_final_state(ref_value, args, tree, has_mask, op)
  return (new_ref,) + (None,) * (len(in_avals) - 1), old


# An atomic_rmw whose returned old values nothing reads, for the ops whose final
# state is a scatter: `unread_atomics_as_updates` substitutes it before a discharge,
# which then traces no sort and scan for the old values (costly to trace and lower,
# though XLA drops them).
atomic_update_p = Primitive("atomic_update")
atomic_update_p.def_effectful_abstract_eval(_atomic_rmw_abstract_eval)


@internals.register_discharge_rule(atomic_update_p)
def _atomic_update_discharge(in_avals, out_avals, ref_value, *args, tree, op, has_mask):
  new_ref = _atomic_final_state(ref_value, args, tree, has_mask, op)
  unread = lax.full(out_avals[0].shape, 0, out_avals[0].dtype)
  return (new_ref,) + (None,) * (len(in_avals) - 1), unread


def unread_atomics_as_updates(closed_jaxpr: Any) -> Any:
  """`closed_jaxpr` with its top-level add/max/min atomics whose results are never
  read bound as `atomic_update` (same final state); the same jaxpr if there are none."""
  jaxpr = closed_jaxpr.jaxpr
  read = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, Literal)}
  read.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
  eqns = [e.replace(primitive=atomic_update_p)
          if (e.primitive is atomic_rmw_p and e.params["op"] in _ATOMIC_SCATTER
              and e.outvars[0] not in read) else e
          for e in jaxpr.eqns]
  if all(a is b for a, b in zip(eqns, jaxpr.eqns)):
    return closed_jaxpr
  return closed_jaxpr.replace(jaxpr=jaxpr.replace(eqns=eqns))


def binds_scatter_atomics(jaxpr: Any) -> bool:
  """Whether `jaxpr` (not the jaxprs nested in it) binds add/max/min atomics."""
  return any(e.primitive in (atomic_rmw_p, atomic_update_p) and e.params["op"] in _ATOMIC_SCATTER
             for e in jaxpr.eqns)


atomic_cas_p = Primitive("atomic_cas")


def atomic_cas(ref: Any, idx: Any, cmp: Any, value: Any) -> jax.Array:
  """Atomically stores `value` where `ref[idx] == cmp`; returns the previous contents."""
  base, transforms = _as_transformed(ref, idx)
  shape, dtype = _view_shape_dtype(jax.typeof(base), transforms)
  cmp = jnp.broadcast_to(jnp.asarray(cmp, dtype), shape)
  value = jnp.broadcast_to(jnp.asarray(value, dtype), shape)
  flat, tree = jax.tree_util.tree_flatten(transforms)
  return atomic_cas_p.bind(base, *flat, cmp, value, tree=tree)


def _atomic_cas_abstract_eval(ref_aval, *args, tree):
  transforms = jax.tree_util.tree_unflatten(tree, args[:tree.num_leaves])
  shape, dtype = _view_shape_dtype(ref_aval, transforms)
  return (jax.core.ShapedArray(shape, dtype),
          {internals.ReadEffect(0), internals.WriteEffect(0)})


atomic_cas_p.def_effectful_abstract_eval(_atomic_cas_abstract_eval)


@internals.register_discharge_rule(atomic_cas_p)
def _atomic_cas_discharge(in_avals, out_avals, ref_value, *args, tree):
  """Lanes run one after another (row-major): compare-and-swap does not compose into
  a scan, and kernels use it on few lanes (locks, flags)."""
  flat, (cmp, value) = _split(args, [tree.num_leaves, 2])
  offsets = _element_offsets(ref_value.shape, jax.tree_util.tree_unflatten(tree, flat))
  size = ref_value.size
  targets = jnp.where(offsets.reshape(-1) >= 0, offsets.reshape(-1), size)
  cmp, value = jnp.ravel(cmp), jnp.ravel(value)

  def lane(i, carry):
    ref_flat, old = carry
    current = ref_flat.at[targets[i]].get(mode="fill", fill_value=0)
    ref_flat = ref_flat.at[targets[i]].set(
        jnp.where(current == cmp[i], value[i], current), mode="drop")
    return ref_flat, old.at[i].set(current)

  ref_flat, old = lax.fori_loop(0, targets.shape[0], lane,
                                (ref_value.reshape(-1), jnp.zeros(cmp.shape, cmp.dtype)))
  return ((ref_flat.reshape(ref_value.shape),) + (None,) * (len(in_avals) - 1),
          old.reshape(offsets.shape))


# ------------------------------------------------------------------ compiler hints
def _identity_hint(name: str) -> Primitive:
  """A primitive that returns its input and carries a hint for GPU code generators."""
  prim = Primitive(name)
  prim.def_impl(lambda x, **_: x)
  prim.def_abstract_eval(lambda aval, **_: aval)
  mlir.register_lowering(prim, lambda ctx, x, **_: [x])
  jax.interpreters.batching.primitive_batchers[prim] = (
      lambda args, dims, **params: (prim.bind(*args, **params), dims[0]))
  jax.interpreters.ad.deflinear(prim, lambda t, **params: [prim.bind(t, **params)])
  return prim


multiple_of_p = _identity_hint("multiple_of")
max_contiguous_p = _identity_hint("max_contiguous")


def multiple_of(x: jax.Array, values: int | Sequence[int]) -> jax.Array:
  """Promises the code generator that `x` is a multiple of `values`."""
  values = tuple(values) if isinstance(values, (list, tuple)) else (int(values),)
  return multiple_of_p.bind(x, values=values)


def max_contiguous(x: jax.Array, values: int | Sequence[int]) -> jax.Array:
  """Promises the code generator that `x` has runs of `values` contiguous elements."""
  values = tuple(values) if isinstance(values, (list, tuple)) else (int(values),)
  return max_contiguous_p.bind(x, values=values)


# ------------------------------------------------------------------ debug_print
debug_print_p = Primitive("debug_print")
debug_print_p.multiple_results = True


def debug_print(fmt: str, *args: Any) -> None:
  """Prints from inside a kernel; `fmt` uses `{}` placeholders like `jax.debug.print`."""
  debug_print_p.bind(*[jnp.asarray(a) for a in args], fmt=fmt)


debug_print_p.def_effectful_abstract_eval(
    lambda *avals, fmt: ([], {internals.debug_effect}))


def _debug_print_impl(*args, fmt):
  jax.debug.print(fmt, *args)
  return []


debug_print_p.def_impl(_debug_print_impl)
mlir.register_lowering(
    debug_print_p, mlir.lower_fun(_debug_print_impl, multiple_results=True))


def _debug_print_batch(args, dims, *, fmt):
  _debug_print_impl(*args, fmt=fmt)
  return [], []


jax.interpreters.batching.primitive_batchers[debug_print_p] = _debug_print_batch


# ------------------------------------------------------------------ control flow
def when(condition: Any) -> Callable[[Callable[[], None]], None]:
  """Decorator: run the decorated function now, only if `condition` holds."""
  def decorator(body: Callable[[], None]) -> None:
    if isinstance(condition, (bool, np.bool_)):
      if condition:
        body()
      return
    if jnp.ndim(condition) != 0:
      name = current_kernel_name()
      where = f"kernel '{name}'" if name else "code outside a kernel"
      raise PalletError(
          f"pl.when in {where} at {checks.user_source()}: the condition has shape "
          f"{jnp.shape(condition)} ({jnp.result_type(condition)}); expected a scalar "
          f"(reduce it with jnp.any/jnp.all, or choose per element with jnp.where or a "
          f"masked pl.store)")
    lax.cond(jnp.asarray(condition).astype(jnp.bool_),
             lambda: (body(), None)[1], lambda: None)
  return decorator


def run_scoped(body: Callable[..., Any], *types: Any, **kw_types: Any) -> Any:
  """Calls `body` with fresh scratch refs of the given shapes (or pytrees of them, e.g.
  the allocations of `pltpu.emit_pipeline_with_allocations`); returns its result."""

  def fresh_tree(tree):
    def fresh(t):
      if isinstance(t, (ScratchShape, jax.ShapeDtypeStruct)):
        # semaphores start at zero even with poisoned buffers (checking mode)
        counter = getattr(t, "memory_space", None) is MemorySpace.SEMAPHORE
        return jax.new_ref(checks.uninitialized(tuple(t.shape), t.dtype,
                                                poison=False if counter else None))
      raise TypeError(f"pl.run_scoped: expected scratch shapes such as "
                      f"pallet.tpu.VMEM((8, 128), jnp.float32), got {tree!r}")
    return jax.tree_util.tree_map(fresh, tree, is_leaf=lambda t: isinstance(t, ScratchShape))
  def named(name, t):
    # the scope names the buffer in checking mode's reports (pallet/checking)
    with jax.named_scope(f"pallet_scoped.{name}"):
      return fresh_tree(t)
  try:
    params = list(inspect.signature(body).parameters)
  except (TypeError, ValueError):
    params = []
  refs = [named(params[i] if i < len(params) else f"scoped {i}", t)
          for i, t in enumerate(types)]
  kw_refs = {k: named(k, t) for k, t in kw_types.items()}
  return body(*refs, **kw_refs)


# ------------------------------------------------------------------ math helpers
def broadcast_to(x: Any, shape: Sequence[int]) -> jax.Array:
  return jnp.broadcast_to(x, shape)

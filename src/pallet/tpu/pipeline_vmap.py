"""`jax.vmap` of a `pltpu.emit_pipeline`: each batch axis becomes an outer grid axis.

Pallas batches its pipeline by prepending the batch to the pipeline's grid: every batch
element runs the whole pipeline over its slice of each batched ref (a ref vmap does not
batch is shared by all), and the body and index maps still see only the user's grid
(`pl.program_id`, `pl.num_programs`). pallet's pipeline is a loop traced into the
kernel, and the refs vmap hands it cannot be closed over by that loop. So a pipeline
called under vmap steps out of vmap's trace with the whole refs and loops over the batch
itself; nothing it traces is batched afterwards (a pipeline returns nothing).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

from pallet import _internals as internals
from pallet.errors import PalletError


@dataclasses.dataclass(frozen=True)
class BatchAxis:
  """One vmap level around the pipeline: its size and `axis_name` (or None)."""
  size: int
  name: Any


@dataclasses.dataclass(frozen=True)
class Level:
  """One vmap level stepped out of: its axis and each ref leaf's batch dimension
  (None where vmap did not batch that ref), counted in that level's view of the ref."""
  axis: BatchAxis
  leaf_dims: tuple[int | None, ...]


def _is_ref_leaf(x: Any) -> bool:
  return isinstance(x, internals.TransformedRef)


def _batched_leaves(tree: Any, vmap: Any) -> bool:
  return any(internals.unbatched(vmap, x)[1] is not None
             for x in jax.tree_util.tree_leaves(tree))


def step_out(refs: Any, grid: Sequence[Any], others: dict[str, Any], site: str
             ) -> tuple[Level, Any, Any] | None:
  """(level, the refs vmap batched replaced by the whole refs, the vmap trace) when the pipeline is called under `jax.vmap`, else None. What cannot be batched
  this way is a clear error: batched grid sizes, scratch buffers or allocations, views
  (`ref.at[...]`) of batched refs, and batched refs reached other than through vmap's
  own arguments."""
  vmap = internals.current_vmap()
  leaves, treedef = jax.tree_util.tree_flatten(refs, is_leaf=_is_ref_leaf)
  if vmap is None:
    if any(internals.is_vmapped(x) for x in
           jax.tree_util.tree_leaves((leaves, list(grid), others))):
      raise PalletError(
          f"emit_pipeline in {site}: a ref or grid size is batched by a jax.vmap that "
          f"does not call the pipeline directly (it is called inside a loop, cond or "
          f"other function traced under that vmap); pallet batches a pipeline only "
          f"when vmap calls it: jax.vmap(pltpu.emit_pipeline(...))(*refs)")
    return None
  size, name = internals.vmap_axis(vmap)
  if not isinstance(size, int):
    raise PalletError(f"emit_pipeline in {site}: jax.vmap of a pipeline needs a static "
                      f"batch size, got {size!r}")
  if _batched_leaves(list(grid), vmap):
    raise PalletError(f"emit_pipeline in {site}: a grid size is batched by jax.vmap; "
                      f"a vmapped pipeline's grid must be the same for every batch "
                      f"element (as in Pallas)")
  for what, value in others.items():
    if _batched_leaves(value, vmap):
      raise PalletError(f"emit_pipeline in {site}: {what} batched by jax.vmap are not "
                        f"supported; allocate them inside the vmapped function or pass "
                        f"them unbatched (in_axes=None)")
  whole, dims = [], []
  for i, leaf in enumerate(leaves):
    if _is_ref_leaf(leaf):
      if _batched_leaves((leaf.ref, leaf.transforms), vmap):
        raise PalletError(
            f"emit_pipeline in {site}: operand leaf {i} is a view (ref.at[...]) of a ref "
            f"batched by jax.vmap; pass the whole ref to the vmapped pipeline and cut "
            f"it with the BlockSpec's index_map instead")
      whole.append(leaf)
      dims.append(None)
      continue
    value, dim = internals.unbatched(vmap, leaf)
    whole.append(value)
    dims.append(dim)
  level = Level(BatchAxis(size, name), tuple(dims))
  return level, jax.tree_util.tree_unflatten(treedef, whole), vmap


def run_apart(emit: Callable[[Any], None], refs: Any, vmaps: Sequence[Any], site: str) -> None:
  """Traces `emit(refs)` (the pipeline over the whole refs) on its own, outside the vmaps
  stepped out of, then replays it in the kernel. A value those vmaps batched cannot be
  used out there: a body or index map that closes over one (rather than reading a ref
  operand) is a clear error here, instead of a leaked tracer when the kernel runs."""
  leaves, treedef = jax.tree_util.tree_flatten(refs, is_leaf=_is_ref_leaf)
  closed = jax.make_jaxpr(lambda *xs: emit(jax.tree_util.tree_unflatten(treedef, xs)))(*leaves)
  if any(internals.unbatched(vmap, c)[1] is not None for c in closed.consts for vmap in vmaps):
    raise PalletError(
        f"emit_pipeline in {site}: the pipeline's body or an index map uses a value "
        f"batched by the jax.vmap around the pipeline (closed over, not read from a ref "
        f"operand). pallet runs a vmapped pipeline as one loop over the whole refs and "
        f"cannot pick one batch element's part of such a value; pass it in a ref operand "
        f"instead")
  jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves)


@dataclasses.dataclass(frozen=True)
class Batch:
  """The vmap levels around a pipeline, outermost first (the loop's outer axes)."""
  axes: tuple[BatchAxis, ...] = ()
  leaf_dims: tuple[tuple[tuple[int, int], ...], ...] | None = None

  def dims_of(self, leaf: int) -> tuple[tuple[int, int], ...]:
    """(dimension of the whole ref, batch axis) pairs of ref leaf `leaf`."""
    return () if self.leaf_dims is None else self.leaf_dims[leaf]


def batch_of(levels: Sequence[Level], ndims: Sequence[int]) -> Batch:
  """The levels stepped out of (innermost first) as a Batch over the whole refs, whose
  ranks are `ndims`. A level's batch dimension counts in the view of the ref that the
  levels outside it leave, so the outermost level is placed first."""
  if not levels:
    return Batch()
  outermost_first = list(reversed(levels))
  per_leaf = []
  for leaf, ndim in enumerate(ndims):
    remaining, dims = list(range(ndim)), []
    for axis, level in enumerate(outermost_first):
      d = level.leaf_dims[leaf]
      if d is not None:
        dims.append((remaining.pop(d), axis))
    per_leaf.append(tuple(dims))
  return Batch(tuple(level.axis for level in outermost_first), tuple(per_leaf))


def batch_element(ref: Any, dims: tuple[tuple[int, int], ...], batch_ids: Sequence[Any]) -> Any:
  """The view of a whole ref that one batch element sees (its batch dimensions indexed)."""
  if not dims:
    return ref
  at = dict(dims)
  ndim = len(jax.typeof(ref).shape)
  return ref.at[tuple(batch_ids[at[d]] if d in at else slice(None) for d in range(ndim))]

"""`pltpu.emit_pipeline`: a grid of blocks run inside a kernel over whole (`ANY`) refs.

On a TPU the emitted pipeline double-buffers: it copies the next blocks in while
the body works on the current ones. Its observable meaning is a sequential loop
over the inner grid that, per step, copies each input's block into a buffer,
runs the body on the buffers and copies the output blocks back (an output buffer
is never filled from the output: it keeps its contents while its block stays and is
fresh memory when a new block starts); that is what this module builds (one
`fori_loop`, buffers allocated once). Blocks that
overhang an array edge read unspecified values there (zeros) and write only
their in-bounds part, as on a TPU. Inside the body and the pipeline's index maps,
`pl.program_id` and `pl.num_programs` answer for the inner grid.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallet import _internals as internals
from pallet.core import checks
from pallet._internals import Slice
from pallet.core import hitypes, primitives, regions
from pallet.core.dma import kernel_site
from pallet.errors import PalletError
from pallet.core.specs import (BlockSpec, Blocked, BoundedSlice, Element, MemorySpace, ScratchShape,
                               Squeezed, no_block_spec)
from pallet.core.unsupported import Unsupported
from pallet.tpu import pipeline_prefetch, pipeline_vmap

# The Mosaic scheduler's own buffers and its mesh-wide prefetching have no meaning
# here: the pipeline is a plain loop of copies.
_SCHEDULER_ONLY = ("the TPU pipeline scheduler's internals; pallet runs a pipeline as a "
                   "sequential loop of block copies")
BufferedRef = Unsupported("pltpu.BufferedRef", _SCHEDULER_ONLY, "use emit_pipeline")
BufferType = Unsupported("pltpu.BufferType", _SCHEDULER_ONLY, "use emit_pipeline")
emit_pipeline_with_async_prefetch = Unsupported(
    "pltpu.emit_pipeline_with_async_prefetch", _SCHEDULER_ONLY,
    "use emit_pipeline (inputs are copied in at every step)")


@dataclasses.dataclass(frozen=True)
class PipelineStep:
  """What a body built with `_explicit_indices=True` gets first: the step's grid
  indices and its linear position in the loop."""
  index: tuple[Any, ...]
  local_index: Any


@dataclasses.dataclass(frozen=True)
class _Window:
  """How one operand is cut: its block dims and the index map (grid indices -> block).
  Under `jax.vmap` the ref is the whole batched ref: its `batched` dimensions (each
  with its batch axis) are squeezed from every block, and the spec describes the rest."""
  spec: BlockSpec
  shape: tuple[int, ...]
  dtype: Any
  where: str
  batched: tuple[tuple[int, int], ...] = ()

  @property
  def dims(self) -> list[tuple[str, int]]:
    """(kind, size) per array dimension: 'blocked', 'squeezed', 'element' or 'bounded'
    (a pl.BoundedSlice: the index map's pl.ds(start, size) fills the first `size`
    elements of the buffer and the step writes back only those)."""
    out, block_dims = [], iter(self.spec.block_shape)
    batched = {d for d, _ in self.batched}
    for i, n in enumerate(self.shape):
      if i in batched:
        out.append(("squeezed", 1))
        continue
      d = next(block_dims)
      if d is None or isinstance(d, Squeezed):
        out.append(("squeezed", 1))
      elif isinstance(d, Element):
        out.append(("element", int(d.block_size)))
      elif isinstance(d, BoundedSlice):
        out.append(("bounded", int(d.block_size)))
      elif isinstance(d, Blocked):
        out.append(("blocked", int(d.block_size)))
      elif isinstance(d, (numbers.Integral,)) and not isinstance(d, bool):
        out.append(("blocked", int(d)))
      else:
        raise PalletError(f"{self.where}: block_shape entries must be ints, None, "
                          f"pl.Squeezed(), pl.Element(n), pl.Blocked(n) or "
                          f"pl.BoundedSlice(n); got {d!r}")
    return out

  @property
  def buffer(self) -> ScratchShape:
    return ScratchShape(tuple(n for kind, n in self.dims if kind != "squeezed"),
                        self.dtype, MemorySpace.VMEM)

  def starts(self, indices: Sequence[Any], batch_ids: Sequence[Any] = ()
             ) -> list[tuple[Any, Any]]:
    """(element offset, valid length or None) of the block in every array dimension
    at grid step `indices` of batch element `batch_ids`; only a bounded dimension has a
    length."""
    rank = len(self.shape) - len(self.batched)
    index_map = self.spec.index_map or (lambda *_: (0,) * rank)
    block = index_map(*indices)
    if not isinstance(block, (tuple, list)):
      block = (block,)
    if len(block) != rank:
      raise PalletError(f"{self.where}: index_map returned {len(block)} indices but the "
                        f"array has rank {rank}")
    block = list(block)
    for d, axis in sorted(self.batched):
      block.insert(d, batch_ids[axis])
    out = []
    for i, (b, (kind, n)) in enumerate(zip(block, self.dims)):
      if (kind == "bounded") != isinstance(b, Slice):
        raise PalletError(f"{self.where}: index_map result {i} is {b!r}. Must return a "
                          f"pl.ds from the index_map for a BoundedSlice dimension (and "
                          f"only for such a dimension)")
      if kind == "bounded":
        out.append((jnp.asarray(b.start, jnp.int32), self._checked_size(b.size, n, i)))
      else:
        out.append((jnp.asarray(b, jnp.int32) * (1 if kind == "element" else n), None))
    return out

  def _checked_size(self, size: Any, bound: int, i: int) -> Any:
    """A pl.ds size of a pl.BoundedSlice(n) dimension: in [0, n], checked while tracing
    when known then, else at run time on every step (a larger size has no meaning in
    an n-element buffer, and pallet would otherwise copy n elements silently)."""
    what = (f"{self.where}: index_map result {i} is pl.ds(..., size) but its "
            f"pl.BoundedSlice({bound}) block holds at most {bound} elements")
    if not internals.is_tracer(size):
      if not 0 <= int(np.asarray(size)) <= bound:
        raise PalletError(f"{what}; got size {int(np.asarray(size))}")
      return jnp.asarray(size, jnp.int32)
    size = jnp.asarray(size, jnp.int32)
    checks.check((size >= 0) & (size <= bound),
                 checks.failure_message("the pl.BoundedSlice size check", f"{what}; the size must be in "
                                        f"[0, {bound}]"))
    return size

  def view(self, starts: Sequence[tuple[Any, Any]]) -> tuple[tuple[Any, ...], Any]:
    """(index into the array for the block, mask of its in-bounds elements or None)."""
    idx, masks = [], []
    for (s, length), (kind, n), size in zip(starts, self.dims, self.shape):
      if kind == "squeezed":
        idx.append(s)
        continue
      idx.append(primitives.ds(s, n))
      overhangs = kind in ("element", "bounded") or size % n
      positions = s + lax.iota(jnp.int32, n)
      valid = (positions >= 0) & (positions < size)
      if length is not None:
        valid &= positions < s + length
      masks.append(valid if overhangs else None)
    mask = None
    for d, m in enumerate(masks):
      if m is not None:
        m = m.reshape([n if i == d else 1 for i, n in enumerate(self.buffer.shape)])
        mask = m if mask is None else mask & m
    if mask is not None:
      mask = jnp.broadcast_to(mask, self.buffer.shape)
    return tuple(idx), mask


def _is_windowed(spec: Any) -> bool:
  return (isinstance(spec, BlockSpec) and spec.block_shape is not None
          and spec.memory_space is not MemorySpace.ANY)


def _refuse_any_block(spec: Any, where: str) -> None:
  """A block of an `ANY` spec names no buffer to copy it into; Pallas refuses it, and
  passing the whole ref instead would run the body on the wrong elements."""
  if (isinstance(spec, BlockSpec) and spec.block_shape is not None
      and spec.memory_space is MemorySpace.ANY):
    raise PalletError(
        f"{where}: BlockSpec(block_shape={tuple(spec.block_shape)}, "
        f"memory_space=ANY) is not a pipeline block: emit_pipeline copies each step's "
        f"block into a buffer, and ANY names none (Pallas refuses it too). Leave "
        f"memory_space out to get the block copied in and out at every step (a nested "
        f"emit_pipeline can run over that buffer), or pass the whole ref with "
        f"BlockSpec(memory_space=ANY) and no block_shape")


def _ref_aval(ref: Any, where: str) -> Any:
  base, transforms = primitives.ref_and_transforms(ref)
  aval = jax.typeof(base)
  if not isinstance(aval, internals.AbstractRef):
    raise PalletError(f"{where}: expected a ref, got {type(ref).__name__}")
  return primitives.view_aval(aval, transforms)


def _normalize(specs: Any) -> tuple[Any, ...]:
  if specs is None:
    return ()
  return tuple(specs) if isinstance(specs, (list, tuple)) else (specs,)


def _windows(specs: tuple[Any, ...], refs: Sequence[Any], what: str, site: str,
             batch: pipeline_vmap.Batch = pipeline_vmap.Batch(), first_leaf: int = 0):
  """Flat (ref, window or None, batched dims) triples of a tuple of ref pytrees and
  matching specs, each followed by its pytree's treedef. Leaves are numbered from
  `first_leaf` in `batch`."""
  if len(specs) != len(refs):
    raise PalletError(f"emit_pipeline in {site}: {len(specs)} {what} specs for "
                      f"{len(refs)} {what} refs")
  pairs, leaf = [], first_leaf
  for i, (spec, tree) in enumerate(zip(specs, refs)):
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_ref_leaf)
    spec_leaves = ([spec] * len(leaves) if spec is None or spec is no_block_spec
                   or isinstance(spec, BlockSpec) else
                   treedef.flatten_up_to(spec))
    for j, (s, r) in enumerate(zip(spec_leaves, leaves)):
      where = f"emit_pipeline in {site}, {what} {i}" + (f" leaf {j}" if len(leaves) > 1 else "")
      aval = _ref_aval(r, where)
      batched = batch.dims_of(leaf)
      leaf += 1
      _refuse_any_block(s, where)
      if _is_windowed(s):
        skipped = {d for d, _ in batched}
        shape = tuple(n for d, n in enumerate(aval.shape) if d not in skipped)
        if len(s.block_shape) != len(shape):
          raise PalletError(f"{where}: block_shape {tuple(s.block_shape)} has rank "
                            f"{len(s.block_shape)} but the ref has shape {shape}")
        pairs.append((r, _Window(s, tuple(aval.shape), aval.dtype, where, batched), batched))
      else:
        pairs.append((r, None, batched))
    pairs.append(treedef)
  return pairs


def _is_ref_leaf(x: Any) -> bool:
  return isinstance(x, internals.TransformedRef)


def _unflatten(pairs: list, values: list) -> list[Any]:
  """Re-nests per-leaf values (in the order of `pairs`) into the operands' pytrees."""
  out, leaves, it = [], [], iter(values)
  for p in pairs:
    if isinstance(p, tuple):
      leaves.append(next(it))
    else:
      out.append(jax.tree_util.tree_unflatten(p, leaves))
      leaves = []
  return out


def _grid_steps(grid: Sequence[Any], site: str) -> tuple[tuple[Any, ...], Any]:
  grid = tuple(grid)
  for g in grid:
    if isinstance(g, (numbers.Integral,)) and not isinstance(g, bool):
      if g <= 0:
        raise PalletError(f"emit_pipeline in {site}: All elements in the grid must be "
                          f"strictly positive, got grid={grid}")
    elif not (hasattr(g, "shape") and g.shape == () and jnp.issubdtype(g.dtype, jnp.integer)):
      raise PalletError(f"emit_pipeline in {site}: grid entries must be ints or integer "
                        f"scalars, got {grid}")
  if all(isinstance(g, numbers.Integral) for g in grid):
    return grid, math.prod(grid)
  total = jnp.int32(1)
  for g in grid:
    total = total * jnp.asarray(g, jnp.int32)
  return grid, total


def _unravel(step: Any, grid: Sequence[Any]) -> list[Any]:
  ids = []
  for g in reversed(grid):
    ids.append(step % g)
    step = step // g
  return ids[::-1]


def emit_pipeline(body: Callable[..., None], *, grid: Sequence[Any], in_specs: Any = (),
                  out_specs: Any = (), tiling: Any = None, core_axis: Any = None,
                  core_axis_name: Any = None, dimension_semantics: Any = None,
                  trace_scopes: bool = True, no_pipelining: bool = False,
                  output_wait_read_only: bool = False,
                  _explicit_indices: bool = False) -> Callable[..., None]:
  """Returns `pipeline(*in_refs, *out_refs, scratches=(), allocations=None)`, which runs
  `body(*in_blocks, *out_blocks, *scratches)` for every step of `grid`.

  Hints for the TPU's scheduler (tiling, dimension_semantics, core partitioning on a
  single core, no_pipelining, output_wait_read_only) do not change the result and are
  accepted as such. With `_explicit_indices`, the body gets a `PipelineStep` first.
  """
  del tiling, core_axis, core_axis_name, dimension_semantics, trace_scopes, no_pipelining
  del output_wait_read_only
  in_specs, out_specs = _normalize(in_specs), _normalize(out_specs)

  def step_body(step: PipelineStep, *refs: Any) -> None:
    return body(step, *refs) if _explicit_indices else body(*refs)

  def pipeline(*refs: Any, scratches: Any = None, allocations: Any = None,
               body_prologue: Callable[[], None] | None = None) -> None:
    """`body_prologue` (JAX 0.10) runs before the body at every step, in its grid."""
    site = kernel_site()
    lowered = hitypes.lower_pipeline(refs, in_specs, out_specs, site)
    if lowered is not None:   # hi-typed refs: the pipeline over their lo refs
      return _over_lo_refs(lowered, body, grid, _explicit_indices)(
          *lowered.refs, scratches=scratches, allocations=allocations,
          body_prologue=body_prologue)
    levels, vmaps = [], []
    with contextlib.ExitStack() as outside:
      while (stepped := pipeline_vmap.step_out(
          refs, grid, {"scratch refs": scratches, "allocations": allocations}, site)):
        level, refs, vmap = stepped
        outside.enter_context(internals.outside_vmap(vmap))
        levels.append(level)
        vmaps.append(vmap)
      if not levels:
        return emit(refs, scratches, allocations, body_prologue, site, ())
      pipeline_vmap.run_apart(
          lambda whole: emit(whole, scratches, allocations, body_prologue, site, levels),
          refs, vmaps, site)

  def emit(refs, scratches, allocations, body_prologue, site, levels) -> None:
    """The pipeline over `refs`; under `jax.vmap`, over the whole refs of every vmap
    level around it (`levels`, innermost first), the batch looped over as outer axes.

    Inside a kernel the loop is traced inline: the kernel's jaxpr, buffers included, is
    pallet's to run and check. Called on refs anywhere else (`jax.make_jaxpr`,
    `jax.jit` over refs) it is a region whose effects are Pallas's: its inputs read and
    its outputs written, the buffers it allocates hidden."""
    if primitives.current_kernel_name() is None:
      return regions.run_region(
          lambda r, s, a: emit_inline(r, s, a, body_prologue, site, levels),
          refs, scratches, allocations)
    return emit_inline(refs, scratches, allocations, body_prologue, site, levels)

  def emit_inline(refs, scratches, allocations, body_prologue, site, levels) -> None:
    batch = pipeline_vmap.Batch()
    if levels:
      ndims = [len(_ref_aval(r, f"emit_pipeline in {site}").shape) for r in
               jax.tree_util.tree_leaves(refs, is_leaf=_is_ref_leaf)]
      batch = pipeline_vmap.batch_of(levels, ndims)
    steps_grid, n_steps = _grid_steps(grid, site)
    ins = _windows(in_specs, refs[:len(in_specs)], "input", site, batch)
    n_in = sum(isinstance(p, tuple) for p in ins)
    outs = _windows(out_specs, refs[len(in_specs):], "output", site, batch, n_in)
    scratch = () if scratches is None else tuple(scratches)
    operands = [p for p in ins + outs if isinstance(p, tuple)]
    windows = [w for _, w, _ in operands if w is not None]
    n_in_windows = sum(w is not None for _, w, _ in operands[:n_in])

    def run(allocated: list) -> None:
      """The loop over allocated buffers, each input's prefetched window bound."""
      bufs, prefetched = [], []
      for k, (w, a) in enumerate(zip(windows, allocated)):
        buf = a.buffer if isinstance(a, pipeline_prefetch.PrefetchedInputAllocation) else a
        bufs.append(buf)
        prefetched.append(pipeline_prefetch.bind(a, w.spec, w.buffer.shape, w.where)
                          if k < n_in_windows else None)
      if batch.axes and any(prefetched):
        raise PalletError(f"emit_pipeline in {site}: prefetched inputs "
                          f"(pl.Buffered(prefetched_count=...)) under jax.vmap are not "
                          f"supported")
      _run(step_body, body_prologue, steps_grid, n_steps, ins, outs, scratch, bufs,
           batch.axes, prefetched)

    if allocations is None:
      return primitives.run_scoped(lambda *bufs: run(list(bufs)),
                                   *[w.buffer for w in windows])
    allocated = jax.tree_util.tree_leaves(allocations, is_leaf=_is_allocation)
    if len(allocated) != len(windows):
      raise PalletError(f"emit_pipeline in {site}: allocations hold {len(allocated)} "
                        f"buffers, the pipeline needs {len(windows)} (one per windowed "
                        f"operand); make them with emit_pipeline_with_allocations")
    return run(allocated)

  return pipeline


def _over_lo_refs(lowered: hitypes.LoweredPipeline, body: Callable[..., None],
                  grid: Sequence[Any], explicit_indices: bool) -> Callable[..., None]:
  """The pipeline over the lo refs of hi-typed operands (core/hitypes.py): its body
  gets hi refs made of the lo block buffers (in a lowering trace of its own, so that
  a hi ref never crosses into the loop's trace as a captured value)."""
  n = len(lowered.trees)

  def lo_body(step: PipelineStep, *refs: Any) -> None:
    def hi_body(refs):
      blocks = lowered.raise_blocks(refs[:n])
      if explicit_indices:
        body(step, *blocks, *refs[n:])
      else:
        body(*blocks, *refs[n:])
    hitypes.run_lowering(hi_body, refs)

  return emit_pipeline(lo_body, grid=grid, in_specs=lowered.in_specs,
                       out_specs=lowered.out_specs, _explicit_indices=True)


def _is_allocation(x: Any) -> bool:
  return _is_ref_leaf(x) or isinstance(x, pipeline_prefetch.PrefetchedInputAllocation)


def _run(body, prologue, grid, n_steps, ins, outs, scratch, bufs,
         batch_axes: tuple[pipeline_vmap.BatchAxis, ...] = (), prefetched: Sequence[Any] = ()
         ) -> None:
  """The loop: per step, blocks in, body, blocks out. Batch axes (vmap) are outer loop
  axes that the index maps and the body do not see as grid axes. An input with a
  prefetched window reads its first fetches from that window; the loop carries how
  many times its block index changed, and each windowed output the block its buffer
  holds."""
  n_in_leaves = sum(isinstance(p, tuple) for p in ins)
  operands = [p for p in ins + outs if isinstance(p, tuple)]
  buf_of, pre_of, it, pre_it = [], [], iter(bufs), iter(prefetched)
  for _, w, _ in operands:
    buf_of.append(next(it) if w is not None else None)
    pre_of.append(next(pre_it, None) if w is not None else None)
  fetching = [k for k, pre in enumerate(pre_of) if pre is not None]
  writing = [k for k in range(n_in_leaves, len(operands)) if operands[k][1] is not None]
  kernel_name = primitives.current_kernel_name()
  batch_sizes = tuple(a.size for a in batch_axes)
  n_batch = math.prod(batch_sizes)

  def step(i, carry):
    carry, held = carry
    all_ids = _unravel(i, batch_sizes + tuple(grid))
    batch_ids, ids = all_ids[:len(batch_sizes)], all_ids[len(batch_sizes):]
    with _batch_context(batch_ids, batch_axes, kernel_name):
      # Index maps, like the body, see the pipeline's own grid: `pl.program_id` and
      # `pl.num_programs` there answer for this step of the inner grid.
      with primitives.grid_context(ids, grid, kernel_name=kernel_name, nested=True):
        starts = [w.starts(ids, batch_ids) if w is not None else None
                  for (_, w, _) in operands]
        views = [(r, w, buf) + (w.view(s) if w is not None else ((), None))
                 for (r, w, _), buf, s in zip(operands, buf_of, starts)]
      fetches = dict(zip(fetching, carry))
      held = dict(zip(writing, held))
      if fetching:
        previous = _unravel(jnp.maximum(i - 1, 0), tuple(grid))
        with primitives.grid_context(previous, grid, kernel_name=kernel_name, nested=True):
          for k in fetching:
            before = operands[k][1].starts(previous)
            changed = functools.reduce(jnp.logical_or, [
                jnp.asarray(a != b) for (a, _), (b, _) in zip(starts[k], before)],
                jnp.bool_(False))
            fetches[k] = fetches[k] + ((i > 0) & changed).astype(jnp.int32)
      block_refs = []
      for k, ((r, w, buf, idx, mask), (_, _, batched)) in enumerate(zip(views, operands)):
        if w is None:
          block_refs.append(pipeline_vmap.batch_element(r, batched, batch_ids))
          continue
        if k >= n_in_leaves:
          held[k] = _start_output_block(buf, i, starts[k], held[k])
          block_refs.append(buf)
          continue
        block = primitives.load(r, idx, mask=mask)
        if k in fetches:   # fetches before `count` are in the prefetched window
          block = jnp.where(fetches[k] < pre_of[k].count, pre_of[k].slot(fetches[k]), block)
        buf[...] = block
        block_refs.append(buf)
      with primitives.grid_context(ids, grid, kernel_name=kernel_name, nested=True):
        if prologue is not None:
          prologue()
        body(PipelineStep(tuple(ids), i), *_unflatten(ins, block_refs[:n_in_leaves]),
             *_unflatten(outs, block_refs[n_in_leaves:]), *scratch)
    for r, w, buf, idx, mask in views[n_in_leaves:]:
      if w is not None:
        primitives.store(r, idx, buf[...], mask=mask)
    return tuple(fetches[k] for k in fetching), tuple(held[k] for k in writing)

  total = n_steps * n_batch
  no_fetches = tuple(jnp.int32(0) for _ in fetching)
  nothing_held = tuple(_block_key([(0, 0 if kind == "bounded" else None) for kind, _ in
                                   operands[k][1].dims]) for k in writing)
  if isinstance(total, int) and total == 1:
    step(jnp.int32(0), (no_fetches, nothing_held))
  else:
    lax.fori_loop(0, total, step, (no_fetches, nothing_held))


def _block_key(starts: Sequence[tuple[Any, Any]]) -> jax.Array:
  """A block's offsets (and bounded lengths) as one int32 vector, to compare blocks."""
  parts = [p for start, length in starts for p in ((start,) if length is None
                                                   else (start, length))]
  return jnp.stack([jnp.asarray(p, jnp.int32) for p in parts]) if parts else \
      jnp.zeros((0,), jnp.int32)


def _start_output_block(buf: Any, i: Any, starts: Sequence[tuple[Any, Any]],
                        held: jax.Array) -> jax.Array:
  """An output's buffer at step `i`: kept while its block stays the one the buffer
  holds (`held`; so a body can accumulate into it across steps, as on a TPU), and
  fresh memory (zeros, or poison with `pl.enable_poison_buffers`) when a new block
  starts. Outputs are never read: a step writes its whole block back, so elements the
  body leaves unwritten are unspecified there, as in Pallas. Returns the block held."""
  key = _block_key(starts)

  @primitives.when((jnp.asarray(i) == 0) | jnp.any(key != held))
  def _():
    buf[...] = checks.uninitialized(tuple(buf.shape), buf.dtype)
  return key


def _batch_context(batch_ids: Sequence[Any], axes: Sequence[pipeline_vmap.BatchAxis],
                   kernel_name: str | None) -> Any:
  """Under vmap: `lax.axis_index` of a named vmap axis answers the batch element."""
  if not axes:
    return contextlib.nullcontext()
  return primitives.grid_context(batch_ids, [a.size for a in axes], kernel_name=kernel_name,
                                 grid_names=[a.name for a in axes], nested=True)


def _input_allocation(w: _Window) -> Any:
  """An input's block buffer; with `pl.Buffered(prefetched_count=k)`, one whose
  `with_window_ref` binds the window its first blocks were prefetched into."""
  k = pipeline_prefetch.prefetched_count(w.spec)
  if k <= 0:
    return w.buffer
  return pipeline_prefetch.PrefetchedInputAllocation(w.buffer, None, k,
                                                     pipeline_prefetch.buffer_count(w.spec))


def emit_pipeline_with_allocations(body: Callable[..., None], *, grid: Sequence[Any],
                                   in_specs: Any = (), out_specs: Any = ()):
  """(pipeline, make_allocations): `make_allocations(*refs)` gives the block buffers as
  scratch shapes (allocate them with `pl.run_scoped`) to pass as `allocations=`."""
  in_specs_, out_specs_ = _normalize(in_specs), _normalize(out_specs)
  pipeline = emit_pipeline(body, grid=grid, in_specs=in_specs, out_specs=out_specs)

  def make_allocations(*refs: Any) -> tuple[Any, ...]:
    site = kernel_site()
    ins = _windows(in_specs_, refs[:len(in_specs_)], "input", site)
    outs = _windows(out_specs_, refs[len(in_specs_):], "output", site)
    in_windows = [p[1] for p in ins if isinstance(p, tuple) and p[1] is not None]
    out_windows = [p[1] for p in outs if isinstance(p, tuple) and p[1] is not None]
    return (tuple(_input_allocation(w) for w in in_windows)
            + tuple(w.buffer for w in out_windows))

  return pipeline, make_allocations

"""Running a kernel in checking mode: instrument it (once per kernel and options),
launch the checked kernel, check what is left to check on its outputs, and turn
failures of eager calls into `KernelCheckError`s."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallet import _internals as internals
from pallet import checks
from pallet.checking import index_maps, instrument as instrument_lib
from pallet.checking.options import CheckOptions
from pallet.tracing import KernelDescription


def parallel_axes(kernel: KernelDescription) -> tuple[int, ...]:
  """Grid axes whose programs may run at the same time: declared "parallel", or
  proven independent by pallet's grid analysis (where it is available)."""
  gm = kernel.grid_mapping
  axes = set()
  if gm.dimension_semantics is not None:
    axes |= {a for a, s in enumerate(gm.dimension_semantics) if s == "parallel"}
  try:
    from pallet import grid_analysis
  except ImportError:
    grid_analysis = None
  if grid_analysis is not None and hasattr(grid_analysis, "independent_axes"):
    axes |= set(grid_analysis.independent_axes(kernel))
  return tuple(sorted(a for a in axes if gm.grid[a] is not None and gm.grid[a] > 1))


def _block_table(mapping: Any, grid: tuple[int, ...]) -> np.ndarray | None:
  """Index-map results over the grid (grid + (ndim,)), or None when they depend on
  run-time values."""
  im = mapping.index_map
  if len(im.in_avals) != len(grid):
    return None
  n = int(np.prod(grid, dtype=np.int64))
  coords = np.indices(grid).reshape(len(grid), n).astype(np.int32)
  with internals.eval_context():
    outs = jax.vmap(lambda *ids: jax.core.eval_jaxpr(im.jaxpr, im.consts, *ids))(
        *[jnp.asarray(c) for c in coords])
  return np.stack([np.broadcast_to(np.asarray(o), (n,)) for o in outs], -1).reshape(
      (*grid, len(outs)))


def _shared_across(mapping: Any, grid: tuple[int, ...], parallel: tuple[int, ...]) -> bool:
  """Whether programs differing along the parallel axes may see overlapping blocks."""
  if mapping.whole:
    return True
  table = _block_table(mapping, grid)
  if table is None or any(d.kind == "element" for d in mapping.dims):
    return True
  seen: dict[tuple, tuple] = {}
  for point in np.ndindex(*grid):
    block = tuple(table[point])
    par = tuple(point[a] for a in parallel)
    if seen.setdefault(block, par) != par:
      return True
  return False


@functools.lru_cache(maxsize=256)
def checked_kernel(kernel: KernelDescription, opts: CheckOptions, names: tuple[str, ...],
                   guard: bool) -> tuple[KernelDescription, instrument_lib.Layout]:
  gm = kernel.grid_mapping
  parallel = parallel_axes(kernel) if opts.races else ()
  read = instrument_lib.read_refs(kernel)
  n_ids = len(gm.grid) + len(gm.dynamic_axes)
  first_out = n_ids + len(gm.prefetch_avals) + len(gm.inputs)
  first_scratch = first_out + len(gm.outputs)
  static_grid = None not in gm.grid
  shadowed_outputs = tuple(
      o for o, b in enumerate(gm.outputs)
      if opts.unwritten
      or (opts.uninitialized and first_out + o in read)
      or (parallel and (not static_grid or _shared_across(b, gm.grid, parallel))))
  shadowed_scratch = tuple(s for s in range(len(gm.scratch_avals))
                           if opts.uninitialized and first_scratch + s in read)
  return instrument_lib.instrument(kernel, opts, list(names), parallel, shadowed_outputs,
                                   shadowed_scratch, guard)


def run(kernel: KernelDescription, opts: CheckOptions, param_names: Sequence[str] | None,
        bind: Callable[..., Sequence[Any]], sizes: Sequence[Any], prefetch: Sequence[Any],
        args: Sequence[Any], backend: str) -> list:
  """Launches `kernel` checked; returns its outputs (the original ones)."""
  names = tuple(instrument_lib.ref_names(kernel, param_names))
  if opts.bounds:
    index_maps.check_static(kernel, names)
  checked, layout = checked_kernel(kernel, opts, names, backend != "xla")
  eager = not any(internals.is_tracer(x) for x in (*sizes, *prefetch, *args))
  with _check_errors(eager):
    if opts.bounds:
      index_maps.check_at_run_time(kernel, names, prefetch)
    return _launch(kernel, opts, checked, layout, bind, sizes, prefetch, args, eager)


def _launch(kernel, opts, checked, layout, bind, sizes, prefetch, args, eager) -> list:
  gm = kernel.grid_mapping
  initial = [jnp.full(gm.outputs[o].array_shape, v, jnp.int32)
             for o, v in zip(layout.shadowed_outputs, layout.shadow_initial)]
  outs = list(bind(*sizes, *prefetch, *args, *initial, kernel=checked))
  n_out = len(gm.outputs)
  results, shadows = outs[:n_out], outs[n_out:]
  if opts.unwritten:
    for o, shadow in zip(layout.shadowed_outputs, shadows):
      written = (shadow >= 1) & (shadow <= layout.given)
      name = layout.output_names[o]
      info = checks.CheckInfo(kind="unwritten", kernel=kernel.name, ref=name,
                              line=kernel.source, grid=(),
                              detail="first unwritten element (flat index)")
      checks.check(jnp.all(written), f"no program wrote some elements of output '{name}'",
                   info, (jnp.argmin(written.reshape(-1)).astype(jnp.int32),))
  if eager:
    jax.block_until_ready(results + shadows)
  return results


@contextlib.contextmanager
def _check_errors(eager: bool) -> Iterator[None]:
  """Eager calls wait for their checks and raise the KernelCheckError itself (JAX's
  runtime wraps errors raised in host callbacks)."""
  try:
    yield
  except checks.KernelCheckError:
    raise
  except Exception as e:  # noqa: BLE001 - re-raised unless it wraps a check's error
    error = checks.pop_failure(e) if eager else None
    if error is None:
      raise
    raise error from None

"""Running a kernel in checking mode: instrument it (once per kernel and options),
launch the checked kernel, check what is left to check on its outputs, and turn
failures of eager calls into `KernelCheckError`s."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallet import _internals as internals
from pallet.core import checks
from pallet.core import grid_analysis
from pallet.core import trace_cache
from pallet.checking import aliasing, coverage, index_maps, instrument as instrument_lib
from pallet.checking import report as report_lib
from pallet.checking.options import CheckOptions
from pallet.core.tracing import KernelDescription


def parallel_axes(kernel: KernelDescription) -> tuple[int, ...]:
  """Grid axes whose programs may run at the same time: declared "parallel", or
  proven independent by pallet's grid analysis (where it is available). A kernel that
  updates a ref atomically and also stores into it plainly runs all its programs at
  once as far as that ref goes (the atomics say so): every axis counts then."""
  gm = kernel.grid_mapping
  if instrument_lib.mixes_atomics(kernel):
    axes = set(range(len(gm.grid)))
  else:
    facts = grid_analysis.analyse(kernel)
    axes = {a.axis for a in facts.axes if a.parallel or a.declared == "parallel"}
  return tuple(sorted(a for a in axes if gm.grid[a] is not None and gm.grid[a] > 1))


def _shared_across(mapping: Any, grid: tuple[int, ...], parallel: tuple[int, ...]) -> bool:
  """Whether programs differing along the parallel axes may see overlapping blocks."""
  if mapping.whole:
    return True
  table = grid_analysis.block_table(mapping, grid)
  if table is None or any(d.kind == "element" for d in mapping.dims):
    return True
  seen: dict[tuple, tuple] = {}
  for point in np.ndindex(*grid):
    block = tuple(table[point])
    par = tuple(point[a] for a in parallel)
    if seen.setdefault(block, par) != par:
      return True
  return False


def _initialized_before_read(kernel: KernelDescription) -> set[int]:
  """Outputs whose reads need no check: aliased ones (the caller's data), and proven
  accumulators (`o = maybe_zeroed(o) + f(inputs)`, see the XLA backend's body
  analysis) zeroed on the first visit of each of their blocks. Checking those would
  also cost the fast plans that sum such accumulators at once."""
  done = {o for _, o in kernel.input_output_aliases}
  gm = kernel.grid_mapping
  if None in gm.grid or gm.prefetch_avals or gm.num_steps == 0:
    return done
  from pallet.backends.xla import body_analysis
  facts = body_analysis.analyse_body(kernel)
  for o, resets in facts.accumulators.items():
    if gm.outputs[o].whole:
      continue
    zeroed = body_analysis.evaluate_resets(resets, gm.grid)
    table = grid_analysis.block_table(gm.outputs[o], gm.grid)
    if zeroed is None or table is None:
      continue
    first_visits = {}
    for point in np.ndindex(*gm.grid):    # grid order
      first_visits.setdefault(tuple(table[point]), point)
    if all(zeroed[p] for p in first_visits.values()):
      done.add(o)
  return done


@trace_cache.kernel_cache
def _aliasing_hazard(kernel: KernelDescription, names: tuple[str, ...]) -> Any:
  """The aliasing hazard between blocked operands (False: none), once per kernel."""
  gm = kernel.grid_mapping
  hazard = aliasing.static_hazard(kernel, names, parallel_axes(kernel),
                                  lambda b: grid_analysis.block_table(b, gm.grid))
  return hazard or False


@trace_cache.kernel_cache
def checked_kernel(kernel: KernelDescription, opts: CheckOptions, names: tuple[str, ...],
                   guard: bool, concurrent: bool) -> tuple[KernelDescription, instrument_lib.Layout]:
  gm = kernel.grid_mapping
  parallel = parallel_axes(kernel) if opts.races else ()
  read = instrument_lib.read_refs(kernel)
  n_ids = len(gm.grid) + len(gm.dynamic_axes)
  first_out = n_ids + len(gm.prefetch_avals) + len(gm.inputs)
  first_scratch = first_out + len(gm.outputs)
  static_grid = None not in gm.grid
  shadowed_scratch = tuple(s for s in range(len(gm.scratch_avals))
                           if opts.uninitialized and first_scratch + s in read)

  unwritten = set()
  if opts.unwritten:   # outputs not proven written by the kernel's structure
    aliased = {o for _, o in kernel.input_output_aliases}
    proven = coverage.proven_written(kernel, [None if b.whole else grid_analysis.block_table(b, gm.grid)
                                              for b in gm.outputs]) if static_grid else set()
    unwritten = set(range(len(gm.outputs))) - proven - aliased

  n_pre = len(gm.prefetch_avals)
  alias_pairs = tuple((i, o) for i, o in aliasing.whole_pairs(kernel)
                      if n_ids + n_pre + i in read) if opts.races else ()

  def instrumented(initialized):
    shadowed_outputs = tuple(
        o for o, b in enumerate(gm.outputs)
        if o in unwritten
        or (opts.uninitialized and first_out + o in read and o not in initialized)
        or (parallel and (not static_grid or _shared_across(b, gm.grid, parallel))))
    return instrument_lib.instrument(kernel, opts, list(names), parallel, shadowed_outputs,
                                     shadowed_scratch, guard, concurrent, alias_pairs)

  if not opts.uninitialized:
    return instrumented(set())
  # Without other checks, proven accumulators keep their fast plans (which run the
  # body on merged blocks, where checks per grid step would not hold).
  checked, layout = instrumented(_initialized_before_read(kernel))
  if not layout.catalog:
    return checked, layout
  return instrumented({o for _, o in kernel.input_output_aliases})


def run(kernel: KernelDescription, opts: CheckOptions, param_names: Sequence[str] | None,
        bind: Callable[..., Sequence[Any]], sizes: Sequence[Any], prefetch: Sequence[Any],
        args: Sequence[Any], backend: str, concurrent: bool = False) -> list:
  """Launches `kernel` checked; returns its outputs (the original ones), after raising
  the first failure (see report.py). `concurrent`: its programs run at the same time
  (compiled Triton on a GPU), not one after another."""
  names = tuple(instrument_lib.ref_names(kernel, param_names))
  if opts.bounds:
    index_maps.check_static(kernel, names)
  if opts.races:
    hazard = _aliasing_hazard(kernel, names)
    if hazard:
      raise hazard
  checked, layout = checked_kernel(kernel, opts, names, backend != "xla", concurrent)
  eager = not any(internals.is_tracer(x) for x in (*sizes, *prefetch, *args))
  with _check_errors(eager):
    catalog = list(layout.catalog)
    reports = []
    if opts.bounds:
      reports += index_maps.check_at_run_time(kernel, names, prefetch, catalog)
    results, kernel_reports = _launch(kernel, opts, checked, layout, bind, sizes, prefetch,
                                      args, catalog)
    reports += kernel_reports
    if reports:
      report_lib.raise_if_failed(report_lib.first(*reports), tuple(catalog))
    if eager:
      jax.block_until_ready(results)
    return results


def _launch(kernel, opts, checked, layout, bind, sizes, prefetch, args,
            catalog: list) -> tuple[list, list]:
  """The outputs, and the reports of the kernel's checks and of the checks on its
  outputs (entries of the latter are added to `catalog`)."""
  gm = kernel.grid_mapping
  initial = [jnp.full(gm.outputs[o].array_shape, v, jnp.int32)
             for o, v in zip(layout.shadowed_outputs, layout.shadow_initial)]
  initial += [jnp.zeros(gm.outputs[o].array_shape, jnp.int32) for o in layout.alias_outputs]
  if layout.record_has_ids:
    initial.append(report_lib.clean(len(gm.grid)))
  outs = list(bind(*sizes, *prefetch, *args, *initial, kernel=checked))
  n_out, n_shadow = len(gm.outputs), len(layout.shadowed_outputs)
  results, shadows = outs[:n_out], outs[n_out:n_out + n_shadow]
  n_shadow += len(layout.alias_outputs)
  reports = []
  if layout.record:
    record = outs[n_out + n_shadow]
    reports.append(record if layout.record_has_ids else report_lib.from_rows(record, gm.grid))
  if opts.unwritten:
    aliased = {o for _, o in kernel.input_output_aliases}
    for o, shadow in zip(layout.shadowed_outputs, shadows):
      if o in aliased:   # the caller's data where not written
        continue
      written = ((shadow >= 1) & (shadow <= layout.given)) | (shadow == layout.shared)
      name = layout.output_names[o]
      info = checks.CheckInfo(kind="unwritten", kernel=kernel.name, ref=name,
                              line=kernel.source, grid=(),
                              detail="first unwritten element (flat index)")
      catalog.append((f"no program wrote some elements of output '{name}'", info))
      reports.append(report_lib.single(~jnp.all(written), len(catalog),
                                       jnp.argmin(written.reshape(-1)), (), len(gm.grid)))
  return results, reports


@contextlib.contextmanager
def _check_errors(eager: bool) -> Iterator[None]:
  """Checks that still call back (pallet's own sanity checks, made while the kernel
  runs): eager calls raise the KernelCheckError itself (JAX's runtime wraps errors
  raised in host callbacks)."""
  try:
    yield
  except checks.KernelCheckError:
    raise
  except Exception as e:  # noqa: BLE001 - re-raised unless it wraps a check's error
    error = checks.pop_failure(e) if eager else None
    if error is None:
      raise
    # Raised in a host callback, it carries JAX's callback frames: the user's frame first.
    raise error.with_traceback(None) from None

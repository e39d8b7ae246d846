"""What a kernel surely does at each grid step, proven before it runs.

The walk follows the kernel's jaxpr at top level and into `pl.when`/`lax.cond`
branches whose condition is a function of the grid indices (evaluated at every grid
step with NumPy), and into inlined calls. It records, per ref, the steps where the
kernel surely reads it, surely writes part of it and surely stores its whole block.
Accesses in loops, or under conditions on loaded data, are not "sure": the facts
are under-approximations, so a check built on them can miss a bug but not report a
false one.

* `proven_written`: outputs every element of which some step surely stores: the
  `unwritten` check needs no shadow for them (a shadow costs a store per store and
  keeps the XLA backend off its fastest plans).
* The aliasing check (aliasing.py) uses the reads and writes.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend.core import Literal

from pallet import _internals as internals
from pallet.core import grid_eval
from pallet.core import trace_cache
from pallet.checking import merges
from pallet.core.tracing import KernelDescription

_CALLS = ("pjit", "jit", "closed_call", "core_call")
_READS = ("get", "masked_load", "addupdate", "atomic_rmw", "atomic_cas")
_WRITES = ("swap", "masked_store", "addupdate", "atomic_rmw", "atomic_cas")


@dataclasses.dataclass
class SureAccesses:
  """Per ref (its position among the kernel's refs: prefetch, inputs, outputs,
  scratch), bool arrays over the grid's steps (row-major)."""
  reads: dict[int, np.ndarray]
  writes: dict[int, np.ndarray]
  whole_writes: dict[int, np.ndarray]
  read_at: dict[int, Any]      # the first equation reading each ref


@trace_cache.kernel_cache
def sure_accesses(kernel: KernelDescription) -> SureAccesses | None:
  """None where the grid's size is known only at run time."""
  gm = kernel.grid_mapping
  if None in gm.grid or gm.num_steps == 0:
    return None
  jaxpr = kernel.jaxpr.jaxpr
  n_ids = len(gm.grid) + len(gm.dynamic_axes)
  n = gm.num_steps
  coords = np.indices(gm.grid, dtype=np.int32).reshape(len(gm.grid), n) if gm.grid else []
  values = {v: c for v, c in zip(jaxpr.invars, coords)}
  refs = {v: k for k, v in enumerate(jaxpr.invars[n_ids:])}
  facts = SureAccesses({}, {}, {}, {})
  _walk(jaxpr, kernel.jaxpr.consts, values, refs, np.ones(n, bool), facts)
  return facts


def proven_written(kernel: KernelDescription, block_tables: Sequence[Any]) -> set[int]:
  """Outputs whose every element some grid step surely stores. `block_tables[o]` is
  output o's index-map results over the grid (grid + (ndim,)), or None."""
  gm = kernel.grid_mapping
  facts = sure_accesses(kernel)
  if facts is None:
    return set()
  first_out = len(gm.prefetch_avals) + len(gm.inputs)
  proven = set()
  for o, b in enumerate(gm.outputs):
    steps = facts.whole_writes.get(first_out + o)
    if steps is None or not steps.any():
      continue
    if b.whole or (block_tables[o] is not None
                   and _tiles(b, block_tables[o].reshape(gm.num_steps, -1)[steps])):
      proven.add(o)
  return proven


def _tiles(mapping: Any, blocks: np.ndarray) -> bool:
  """Whether the blocks at these indices cover every element of the array."""
  if any(d.kind != "blocked" and d.kind != "squeezed" for d in mapping.dims):
    return False
  counts = [-(-n // d.size) for n, d in zip(mapping.array_shape, mapping.dims)]
  seen = {tuple(int(i) for i in row) for row in blocks}
  return all(c in seen for c in itertools.product(*[range(k) for k in counts]))


def _whole_block(transforms: Sequence[Any], shape: Sequence[int]) -> bool:
  if not transforms:
    return True
  if len(transforms) != 1 or not isinstance(transforms[0], internals.NDIndexer):
    return False
  for idx, size in zip(transforms[0].indices, shape):
    if not isinstance(idx, internals.Slice) or idx.stride != 1 or idx.size != size:
      return False
    start = idx.start.val if isinstance(idx.start, Literal) else idx.start
    if internals.is_tracer(start) or not isinstance(start, (int, np.integer)) or start != 0:
      return False
  return True


def _mark(table: dict, k: int, guard: np.ndarray) -> None:
  table[k] = table[k] | guard if k in table else guard.copy()


def _walk(jaxpr: Any, consts: Sequence[Any], values: dict, refs: dict, guard: np.ndarray,
          facts: SureAccesses) -> None:
  """Records the accesses of `jaxpr` under `guard` (the steps where it surely runs);
  `values` holds the grid-only scalars known so far (arrays over the steps)."""
  for v, c in zip(jaxpr.constvars, consts):
    if np.ndim(c) == 0:
      values[v] = np.asarray(c)

  def value(x):
    if isinstance(x, Literal):
      return np.asarray(x.val, x.aval.dtype)
    return values.get(x)

  merged = merges.find(jaxpr)   # merge writes store only the lanes they select
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    target = eqn.invars[0] if eqn.invars else None
    if name in _READS + _WRITES and not isinstance(target, Literal) and target in refs:
      k = refs[target]
      if name in _READS:
        _mark(facts.reads, k, guard)
        facts.read_at.setdefault(k, eqn)
      if name in _WRITES:
        _mark(facts.writes, k, guard)
      if name == "swap" and id(eqn) not in merged:
        transforms = jax.tree_util.tree_unflatten(eqn.params["tree"], list(eqn.invars[2:]))
        if _whole_block(tuple(transforms), target.aval.shape):
          _mark(facts.whole_writes, k, guard)
      continue
    if name == "cond":
      index = value(eqn.invars[0])
      if index is None:
        continue
      branches = eqn.params["branches"]
      for b, branch in enumerate(branches):
        taken = guard & (np.clip(index, 0, len(branches) - 1) == b)
        if taken.any():
          _walk_sub(branch.jaxpr, branch.consts, eqn.invars[1:], values, refs, taken, facts)
      continue
    if name in _CALLS:
      inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
      if inner is not None:
        _walk_sub(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()), eqn.invars,
                  values, refs, guard, facts)
      continue
    if eqn.effects or any(getattr(v.aval, "shape", ()) for v in eqn.outvars):
      continue
    ins = [value(x) for x in eqn.invars]
    if any(x is None for x in ins):
      continue
    try:
      outs = grid_eval.apply_equation(eqn, ins)
    except Exception:  # noqa: BLE001 - grid_eval.Unsupported or NumPy's refusal: unknown
      continue
    for v, o in zip(eqn.outvars, outs):
      values[v] = np.asarray(o)


def _walk_sub(jaxpr: Any, consts: Sequence[Any], operands: Sequence[Any], values: dict,
              refs: dict, guard: np.ndarray, facts: SureAccesses) -> None:
  inner_values, inner_refs = {}, {}
  for v, x in zip(jaxpr.invars, operands):
    if isinstance(x, Literal):
      inner_values[v] = np.asarray(x.val, x.aval.dtype)
      continue
    if x in values:
      inner_values[v] = values[x]
    if x in refs:
      inner_refs[v] = refs[x]
  _walk(jaxpr, consts, inner_values, inner_refs, guard, facts)

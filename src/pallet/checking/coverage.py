"""Outputs every element of which is written, proven before the kernel runs.

The `unwritten` check (output elements no program wrote) needs a shadow per output
while the kernel runs, which costs a store per store and keeps the XLA backend off
its fastest plans. Most kernels need none: each grid step stores its whole output
block (`o_ref[...] = ...`), unconditionally or under `pl.when` conditions on the
grid indices, and the blocks those steps see tile the array. This module proves
that from the kernel's jaxpr and its index maps, evaluating the conditions at every
grid step with NumPy; anything it does not follow (a store in a loop, a condition
on loaded data, a scalar-prefetch index map) leaves the output to the shadow.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend.core import Literal

from pallet import _internals as internals
from pallet import grid_eval
from pallet.tracing import KernelDescription

_CALLS = ("pjit", "jit", "closed_call", "core_call")
_WRITES = ("swap", "addupdate")


def proven_written(kernel: KernelDescription, block_tables: Sequence[Any]) -> set[int]:
  """Outputs whose every element some grid step writes for sure. `block_tables[o]`
  is output o's index-map results over the grid (grid + (ndim,)), or None."""
  gm = kernel.grid_mapping
  if None in gm.grid or gm.num_steps == 0:
    return set()
  jaxpr = kernel.jaxpr.jaxpr
  n_ids = len(gm.grid) + len(gm.dynamic_axes)
  first_out = n_ids + len(gm.prefetch_avals) + len(gm.inputs)
  outputs = {v: o for o, v in enumerate(jaxpr.invars[first_out:first_out + len(gm.outputs)])}
  n = gm.num_steps
  coords = np.indices(gm.grid, dtype=np.int32).reshape(len(gm.grid), n) if gm.grid else []
  values = {v: c for v, c in zip(jaxpr.invars, coords)}
  written = {o: np.zeros(n, bool) for o in range(len(gm.outputs))}
  _walk(jaxpr, kernel.jaxpr.consts, values, outputs, np.ones(n, bool), written)
  proven = set()
  for o, steps in written.items():
    b = gm.outputs[o]
    if b.whole:
      if steps.any():
        proven.add(o)
    elif block_tables[o] is not None and _tiles(b, block_tables[o].reshape(n, -1)[steps]):
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
    start = idx.start
    if isinstance(start, Literal):
      start = start.val
    if internals.is_tracer(start) or not isinstance(start, (int, np.integer)) or start != 0:
      return False
  return True


def _walk(jaxpr: Any, consts: Sequence[Any], values: dict, outputs: dict,
          guard: np.ndarray, written: dict) -> None:
  """Marks in `written` the steps where `guard` holds and `jaxpr` stores a whole output
  block; `values` has the grid-only scalars known so far (arrays over the steps)."""
  for v, c in zip(jaxpr.constvars, consts):
    if np.ndim(c) == 0:
      values[v] = np.asarray(c)

  def value(x):
    if isinstance(x, Literal):
      return np.asarray(x.val, x.aval.dtype)
    return values.get(x)

  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in _WRITES and eqn.invars[0] in outputs:
      transforms = jax.tree_util.tree_unflatten(eqn.params["tree"], list(eqn.invars[2:]))
      shape = eqn.invars[0].aval.shape
      if _whole_block(tuple(transforms), shape):
        o = outputs[eqn.invars[0]]
        written[o] |= guard
      continue
    if name == "cond":
      index = value(eqn.invars[0])
      if index is None:
        continue
      for b, branch in enumerate(eqn.params["branches"]):
        taken = guard & (np.clip(index, 0, len(eqn.params["branches"]) - 1) == b)
        if taken.any():
          _walk_sub(branch.jaxpr, branch.consts, eqn.invars[1:], values, outputs, taken,
                    written)
      continue
    if name in _CALLS:
      inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
      if inner is not None:
        _walk_sub(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()), eqn.invars,
                  values, outputs, guard, written)
      continue
    if eqn.effects or any(v.aval.shape for v in eqn.outvars if hasattr(v.aval, "shape")):
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
              outputs: dict, guard: np.ndarray, written: dict) -> None:
  inner_values = {}
  inner_outputs = {}
  for v, x in zip(jaxpr.invars, operands):
    if isinstance(x, Literal):
      inner_values[v] = np.asarray(x.val, x.aval.dtype)
    elif x in values:
      inner_values[v] = values[x]
    if not isinstance(x, Literal) and x in outputs:
      inner_outputs[v] = outputs[x]
  _walk(jaxpr, consts, inner_values, inner_outputs, guard, written)

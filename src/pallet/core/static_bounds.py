"""Indices known while tracing that fall outside their ref: an error then, not a clamp.

`x_ref[200]` on a 128-element ref traces fine in JAX (the index becomes a literal of the
`get`), and a discharged read clamps it onto the last element, so the kernel would run
and return a wrong value; JAX's TPU interpreter fails it at run time. The index is known
when the kernel is traced, so pallet refuses it then, naming the kernel, the ref, the
index, the shape and the user's line. This pass walks the traced kernel (control flow,
pipelines and DMAs included) and checks every index that is a literal or a constant:

* a scalar integer index must lie in [-n, n) (negative ones count from the end, as
  JAX's discharge reads them); integer-array indices (gathers and scatters) keep
  jax.numpy's meaning, reads clamped and writes dropped;
* a `pl.ds(start, size)` with a static start and size must lie inside the dimension,
  a negative start included (JAX refuses most of these itself when the view is made,
  and `kernel_errors` retells those; JAX's discharge fails on a negative one).

A branch decided by the grid position alone (`pl.when(pl.program_id(0) == 1)`) is
evaluated over the grid: an index in a branch some step takes is an error, one in a
branch no step takes is dead code. An access inside a branch decided by data
(`pl.when(i < n)` with `n` read from a ref) may never run: TPU kernels guard a loop
unrolled to a fixed bound that way (`for i in range(8): @pl.when(i < count)` over a
ref of `count <= 4` slots). There the index is a warning (`pl.IndexBoundsWarning`),
not an error: if the branch does run, the access is clamped onto the last element, and
checking mode reports it as `out_of_bounds` at run time.

Python slices (`x_ref[100:200]`) are clipped at the end as in NumPy and JAX, so they are
never out of bounds. The last index of a masked access (`pl.load`/`pl.store` with a
mask, masked atomics) may point anywhere its mask turns off, so it is not checked.
Blocks that overhang the array edge are legal: the ref is the block, and only indexing
past the ref's own shape is an error.
"""
from __future__ import annotations

import linecache
import os
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend.core import Literal

from pallet import _internals as internals
from pallet.errors import IndexBoundsWarning, PalletError
from pallet.core import grid_eval, tracebacks
from pallet.core.tracing import KernelDescription

# primitive -> position of the first flattened transform among the equation's inputs
_ACCESSES = {"get": 1, "swap": 2, "addupdate": 2, "masked_load": 1, "masked_store": 1,
             "atomic_rmw": 1, "atomic_update": 1, "atomic_cas": 1}
_MASKED = ("masked_load", "masked_store")
# primitives whose `tree` covers every input: (ref, transforms) pairs
_WHOLE_TREE = ("dma_start", "dma_wait")
_SEMAPHORES = ("semaphore_signal", "semaphore_wait", "semaphore_read")


def check(kernel: KernelDescription) -> None:
  """Raises PalletError for the first index of `kernel` that is known while tracing and
  outside its ref."""
  jaxpr = kernel.jaxpr.jaxpr
  gm = kernel.grid_mapping
  n_ids = len(gm.grid) + len(gm.dynamic_axes)
  kinds = ([("scalar prefetch", i) for i in range(len(gm.prefetch_avals))]
           + [("input", i) for i in range(len(gm.inputs))]
           + [("output", i) for i in range(len(gm.outputs))]
           + [("scratch", i) for i in range(len(gm.scratch_avals))])
  labels: dict[Any, str] = {}
  for k, v in enumerate(jaxpr.invars[n_ids:]):
    name = kernel.ref_names[k] if k < len(kernel.ref_names) else ""
    kind = f"{kinds[k][0]} {kinds[k][1]}" if k < len(kinds) else "a ref the kernel closed over"
    labels[v] = f"{kind} ('{name}')" if name else kind
  consts = dict(zip(jaxpr.constvars, kernel.jaxpr.consts))
  _walk(jaxpr, labels, consts, kernel, guarded=False)


def _walk(jaxpr: Any, labels: dict, consts: dict, kernel: KernelDescription,
          guarded: bool) -> None:
  """`guarded`: inside a branch that runs only if a value known at run time says so."""
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "new_ref":
      labels[eqn.outvars[0]] = _scoped_label(eqn)
    if "tree" in eqn.params:
      for ref, transforms, masked in _accesses(eqn, name, consts):
        _check_access(eqn, ref, transforms, masked, labels, kernel, guarded)
    taken = _branches_taken(eqn, jaxpr, consts, kernel) if name == "cond" else None
    for k, (sub, operands, sub_consts) in enumerate(_sub_jaxprs(eqn)):
      if taken is not None and k not in taken:
        continue   # no grid step runs this branch
      inner_labels = {v: labels[o] for v, o in zip(sub.invars, operands)
                      if not isinstance(o, Literal) and o in labels}
      inner_consts = {v: (o.val if isinstance(o, Literal) else consts[o])
                      for v, o in zip(sub.invars, operands)
                      if isinstance(o, Literal) or o in consts}
      inner_consts.update(zip(sub.constvars, sub_consts))
      decided = name != "cond" or taken is not None
      _walk(sub, inner_labels, inner_consts, kernel, guarded or not decided)


def _branches_taken(eqn: Any, jaxpr: Any, consts: dict, kernel: KernelDescription
                    ) -> set[int] | None:
  """The branches of a cond that some grid step runs, where its index is known while
  tracing or computed from the grid position in the kernel's own body (not inside a
  loop); None where data decides."""
  index = _value(eqn.invars[0], consts)
  gm = kernel.grid_mapping
  if index is None and jaxpr is kernel.jaxpr.jaxpr and not gm.dynamic_axes:
    values = grid_eval.value_over_grid(jaxpr, kernel.jaxpr.consts, eqn.invars[0], gm.grid)
    index = None if values is None else np.unique(values)
  if index is None:
    return None
  last = len(eqn.params["branches"]) - 1
  return {min(max(int(i), 0), last) for i in np.ravel(index)}   # clamped, as lax.switch


def _value(v: Any, consts: dict) -> Any:
  """The value of an equation input known while tracing, or None."""
  if isinstance(v, Literal):
    return v.val
  return consts.get(v)


def _accesses(eqn: Any, name: str, consts: dict) -> list[tuple[Any, tuple, bool]]:
  """(ref variable, transforms with known values or None, masked) per ref the equation
  indexes."""
  tree = eqn.params["tree"]
  if name in _ACCESSES:
    start = _ACCESSES[name]
    leaves = [_value(v, consts) for v in eqn.invars[start:start + tree.num_leaves]]
    masked = name in _MASKED or bool(eqn.params.get("has_mask"))
    return [(eqn.invars[0], tuple(_unflatten(tree, leaves)), masked)]
  if name in _WHOLE_TREE or name in _SEMAPHORES:
    n = tree.num_leaves
    refs = jax.tree_util.tree_unflatten(tree, list(eqn.invars[:n]))
    values = jax.tree_util.tree_unflatten(tree, [_value(v, consts) for v in eqn.invars[:n]])
    pairs = list(zip(refs[0::2], values[1::2]))
    return [(r, tuple(t or ()), False) for r, t in pairs if r is not None]
  return []


def _unflatten(tree: Any, leaves: list) -> Any:
  try:
    return jax.tree_util.tree_unflatten(tree, leaves)
  except (TypeError, ValueError):
    return ()


def _check_access(eqn: Any, ref: Any, transforms: Sequence[Any], masked: bool,
                  labels: dict, kernel: KernelDescription, guarded: bool) -> None:
  indexers = [t for t in transforms if isinstance(t, internals.NDIndexer)]
  for k, indexer in enumerate(indexers):
    if masked and k == len(indexers) - 1:
      continue
    shape = tuple(indexer.shape)
    for d, (index, size) in enumerate(zip(indexer.indices, shape)):
      if not isinstance(size, (int, np.integer)):
        continue
      problem = _problem(index, int(size))
      if problem is None:
        continue
      message = _message(eqn, ref, labels, kernel, problem, d, int(size), shape, k > 0)
      if not guarded:
        raise PalletError(message + " (the index is known while tracing; reading past the "
                          "end would return a clamped value)")
      tracebacks.warn(message + " (the index is known while tracing). It is inside a branch "
                      "decided at run time (pl.when, lax.cond), so pallet runs the kernel; "
                      "if the branch runs, the access is clamped onto the last element. "
                      "Checking mode (PALLET_CHECKS=1) reports it if it runs",
                      IndexBoundsWarning)


def _problem(index: Any, size: int) -> str | None:
  """Why `index` lies outside a dimension of `size`, or None (in bounds or unknown)."""
  if isinstance(index, internals.Slice):
    start, count = index.start, index.size
    if not all(isinstance(x, (int, np.integer)) for x in (start, count)) or count <= 0:
      return None
    start, count = int(start), int(count)
    last = start + (count - 1) * index.stride
    if 0 <= start and last < size:
      return None
    return (f"the slice pl.ds({start}, {count}" + (f", {index.stride}" if index.stride != 1
                                                  else "") + f") (elements {start} to {last})")
  if index is None or np.ndim(index) != 0:
    return None   # integer-array indices clamp reads and drop writes, as jax.numpy's do
  value = np.asarray(index)
  if value.dtype.kind not in "iu" or -size <= int(value) < size:
    return None
  return f"index {int(value)}"


def _message(eqn: Any, ref: Any, labels: dict, kernel: KernelDescription, problem: str,
             d: int, size: int, shape: tuple, of_view: bool) -> str:
  src = internals.equation_source(eqn)
  line = f"{src[0]}:{src[1]}" if src else kernel.source
  code = linecache.getline(src[0], src[1]).strip() if src else ""
  label = labels.get(ref, "a ref made inside the kernel")
  target = f"a view (shape {shape}) of {label}" if of_view else f"{label} (shape {shape})"
  return (f"kernel '{kernel.name}' ({kernel.source}) at {line}"
          + (f" (`{code}`)" if code else "")
          + f": {problem} is out of bounds for dimension {d} of {target}, which has "
          f"{size} elements; expected an index in [-{size}, {size})")


_PIPELINE_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "tpu", "pipeline.py")


def _scoped_label(eqn: Any) -> str:
  """A buffer made in the kernel: emit_pipeline's block buffers are named so;
  `pl.run_scoped` names the others after the body's parameter."""
  if any(os.path.abspath(f) == _PIPELINE_FILE for f in internals.equation_files(eqn)):
    return "a block buffer of pltpu.emit_pipeline"
  stack = str(eqn.source_info.name_stack)
  for part in reversed(stack.split("/")):
    if part.startswith("pallet_scoped."):
      return f"scoped buffer '{part[len('pallet_scoped.'):]}'"
  return "a ref made inside the kernel"


def _sub_jaxprs(eqn: Any) -> list[tuple[Any, list, Sequence[Any]]]:
  """(open jaxpr, the equation's inputs its inputs stand for, its constants) for each
  nested jaxpr; inputs that do not line up are left unnamed."""
  name, params = eqn.primitive.name, eqn.params
  ins = list(eqn.invars)
  if name == "cond":
    return [(b.jaxpr, ins[1:], b.consts) for b in params["branches"]]
  if name == "while":
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    return [(cond.jaxpr, ins[:nc] + ins[nc + nb:], cond.consts),
            (body.jaxpr, ins[nc:], body.consts)]
  out = []
  for value in params.values():
    for sub in (value if isinstance(value, (tuple, list)) else (value,)):
      inner = getattr(sub, "jaxpr", sub)
      if hasattr(inner, "eqns"):
        operands = ins if len(inner.invars) == len(ins) else []
        out.append((inner, operands, getattr(sub, "consts", ())))
  return out

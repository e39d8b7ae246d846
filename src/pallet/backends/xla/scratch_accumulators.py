"""Scratch accumulators (the TPU matmul form) proven and run as resident outputs.

TPU kernels accumulate a reduction in a scratch buffer and copy it out:

    @pl.when(k == 0)
    def _(): acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
    @pl.when(k == nk - 1)                       # or unconditionally, every step
    def _(): o_ref[...] = acc_ref[...].astype(o_ref.dtype)

Scratch state is opaque to the planner (it persists from step to step), so such
a kernel would loop its reduction axes. When the discharged body proves this
exact pattern for every output, the kernel equals one whose output block *is*
the accumulator (same block mapping, the scratch's dtype), followed by the
elementwise copy `G` (the cast) over the whole array. That kernel is an ordinary
resident-output accumulator, which the planner merges into one contraction or
reduction. What is proven, per scratch buffer `s` and output `o`:

* `s`'s final value is `reset(s) + F`, `F` free of every scratch and output block,
  `reset` a `pl.when`/select that zeroes `s` exactly on the first step of the
  reduction (grid ids only: evaluated over the whole grid);
* `o`'s final value is `G(s_final)` (every step: the last one wins), or a
  `pl.when` writing `G(s_final)` exactly on the last step and keeping `o`
  otherwise; `G` a chain of elementwise operations with literal operands;
* the reduction axes (those along which no output block moves, none declared
  "parallel") come after every other axis, there are no aliases, scalar prefetch
  or traced grid sizes, and `s` has `o`'s block shape.
Anything else leaves the kernel as it is (`why_not` says what failed).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from pallet import _internals as internals
from pallet.core import grid_analysis, grid_eval
from pallet.backends.xla import body_analysis
from pallet.core.grid_mapping import BlockMapping
from pallet.core.tracing import KernelDescription

_CALLS = ("pjit", "jit", "closed_call", "core_call")
# Elementwise primitives a copy-out `G` may use (other operands: literal scalars).
_COPY_OPS = frozenset({
    "convert_element_type", "copy", "copy_p", "neg", "abs", "mul", "div", "add", "sub",
    "max", "min", "exp", "log", "tanh", "logistic", "sqrt", "rsqrt", "integer_pow",
    "reduce_precision"})


@dataclasses.dataclass(frozen=True)
class ScratchRewrite:
  kernel: KernelDescription                       # scratch buffers as resident outputs
  finish: Callable[[list[Any]], list[Any]]        # accumulated arrays -> real outputs
  note: str


def rewrite(kernel: KernelDescription) -> ScratchRewrite | str:
  """The equivalent resident-accumulator kernel, or why the pattern is not proven."""
  gm = kernel.grid_mapping
  if not gm.scratch_avals:
    return "no scratch buffers"
  if gm.prefetch_avals or gm.dynamic_axes or kernel.input_output_aliases:
    return "scalar prefetch, traced grid sizes or aliases"
  n_out, n_s = len(gm.outputs), len(gm.scratch_avals)
  if n_out != n_s:
    return f"{n_out} outputs but {n_s} scratch buffers"
  from pallet.backends.xla.plan import _varies
  grid, G = gm.grid, len(gm.grid)
  tables = [grid_analysis.block_table(o, grid) for o in gm.outputs]
  # The reduction axes are those no output block moves along, whatever the declared
  # semantics: along an "arbitrary" axis that moves an output block the scratch carries
  # from one block to the next, which no resident output can stand for.
  sequential = [g for g in range(G) if not any(_varies(t, g) for t in tables)]
  if not sequential or sequential != list(range(G - len(sequential), G)):
    return "the reduction axes are not the grid's last axes"
  if gm.dimension_semantics is not None and any(
      gm.dimension_semantics[g] == "parallel" for g in sequential):
    return "a reduction axis is declared parallel (the grid analysis decides how it runs)"
  pure = body_analysis.discharged(kernel)   # the one discharge every analysis shares
  jaxpr = pure.jaxpr
  n_in = len(gm.inputs)
  o_in = jaxpr.invars[G + n_in:G + n_in + n_out]
  s_in = jaxpr.invars[G + n_in + n_out:]
  o_fin = jaxpr.outvars[n_in:n_in + n_out]
  s_fin = jaxpr.outvars[n_in + n_out:]
  blocks = set(o_in) | set(s_in)
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  coords = np.indices(grid)
  first = np.all([coords[g] == 0 for g in sequential], axis=0)
  last = np.all([coords[g] == grid[g] - 1 for g in sequential], axis=0)
  ids = jaxpr.invars[:G]

  def grid_table(var: Any) -> np.ndarray | None:
    return _grid_table(pure, var, ids, grid)

  accumulated, copies = [], []
  for j, (s, s_out) in enumerate(zip(s_in, s_fin)):
    o_block = gm.outputs[j].kernel_shape
    if tuple(gm.scratch_avals[j].shape) != o_block:
      return f"scratch {j} has shape {gm.scratch_avals[j].shape}, not the output block's {o_block}"
    final = _canonical(s_out, producer)
    why = _check_accumulation(final, s, blocks, producer, first, grid_table)
    if why:
      return f"scratch {j}: {why}"
    accumulated.append(final)
  for o, (o_var, o_out) in enumerate(zip(o_in, o_fin)):
    chain = _copy_out(o_out, o_var, accumulated[o], producer, last, grid_table)
    if isinstance(chain, str):
      return f"{gm.outputs[o].origin}: {chain}"
    copies.append(chain)

  virtual = _virtual_kernel(kernel, pure, accumulated)
  dtypes = [o.dtype for o in gm.outputs]

  def finish(accs: list[Any]) -> list[Any]:
    outs = []
    for acc, chain, dtype in zip(accs, copies, dtypes):
      for eqn, pos in chain:
        args = [acc if k == pos else x.val for k, x in enumerate(eqn.invars)]
        acc = eqn.primitive.bind(*args, **eqn.params)
      outs.append(acc.astype(dtype))
    return outs
  note = (f"scratch buffers accumulate over the reduction axes {sequential} (zeroed on "
          f"their first step, copied out elementwise on the last): run as resident outputs")
  return ScratchRewrite(virtual, finish, note)


# ------------------------------------------------------------------ matching
def _canonical(var: Any, producer: dict) -> Any:
  """`var` seen through conds/calls that pass one of their operands through unchanged."""
  while not isinstance(var, Literal) and var in producer:
    eqn = producer[var]
    k = eqn.outvars.index(var)
    if eqn.primitive.name == "cond":
      operands, picks = eqn.invars[1:], set()
      for b in eqn.params["branches"]:
        out = b.jaxpr.outvars[k]
        picks.add(b.jaxpr.invars.index(out) if out in b.jaxpr.invars else None)
      if len(picks) != 1 or None in picks:
        return var
      var = operands[picks.pop()]
    elif eqn.primitive.name in _CALLS and "jaxpr" in eqn.params:
      inner = eqn.params["jaxpr"].jaxpr
      out = inner.outvars[k]
      if out not in inner.invars:
        return var
      var = eqn.invars[inner.invars.index(out)]
    else:
      return var
  return var


def _depends_on(var: Any, blocks: set, producer: dict, seen: dict | None = None) -> bool:
  seen = {} if seen is None else seen
  if isinstance(var, Literal):
    return False
  if var in blocks:
    return True
  if var in seen:
    return seen[var]
  eqn = producer.get(var)
  seen[var] = eqn is not None and any(_depends_on(x, blocks, producer, seen)
                                      for x in eqn.invars)
  return seen[var]


def _is_zero(var: Any, jaxpr: Any) -> bool:
  if isinstance(var, Literal):
    return not np.any(np.asarray(var.val))
  eqn = next((e for e in jaxpr.eqns if var in e.outvars), None)
  return (eqn is not None and eqn.primitive.name in ("broadcast_in_dim", "convert_element_type")
          and _is_zero(eqn.invars[0], jaxpr))


def _check_accumulation(final: Any, s: Any, blocks: set, producer: dict, first: np.ndarray,
                        grid_table: Callable) -> str | None:
  """None when `final` is `reset(s) + F` with the reset exactly on the first step."""
  eqn = producer.get(final)
  if eqn is None or eqn.primitive.name not in ("add", "add_any"):
    return "its final value is not (reset scratch) + term"
  terms = list(eqn.invars)
  for r, f in (terms, terms[::-1]):
    if _depends_on(f, blocks, producer):
      continue
    zeroed = _reset_table(r, s, producer, grid_table)
    if zeroed is None:
      continue
    if not np.array_equal(zeroed, first):
      return "it is not zeroed exactly on the first step of the reduction"
    return None
  return "its final value is not (reset scratch) + a term free of scratch and outputs"


def _reset_table(var: Any, s: Any, producer: dict, grid_table: Callable) -> np.ndarray | None:
  """Where over the grid `var` is `s` zeroed (a pl.when / select on grid ids only)."""
  eqn = producer.get(var) if not isinstance(var, Literal) else None
  if eqn is None or eqn.primitive.name not in ("cond", "select_n"):
    return None
  k = eqn.outvars.index(var)
  zero_cases, keep_cases = set(), set()
  if eqn.primitive.name == "cond":
    operands = eqn.invars[1:]
    for i, b in enumerate(eqn.params["branches"]):
      out = b.jaxpr.outvars[k]
      if out in b.jaxpr.invars and operands[b.jaxpr.invars.index(out)] is s:
        keep_cases.add(i)
      elif _is_zero(out, b.jaxpr):
        zero_cases.add(i)
      else:
        return None
  else:
    for i, case in enumerate(eqn.invars[1:]):
      if case is s:
        keep_cases.add(i)
      elif _is_zero(case, _Eqns(producer)):
        zero_cases.add(i)
      else:
        return None
  if eqn.invars[0].aval.shape != ():
    return None
  table = grid_table(eqn.invars[0])
  return None if table is None else np.isin(table, sorted(zero_cases))


class _Eqns:
  """The equations of a producer map, for `_is_zero` on the top-level jaxpr."""

  def __init__(self, producer: dict):
    self.eqns = list({id(e): e for e in producer.values()}.values())


def _copy_out(o_out: Any, o_var: Any, acc: Any, producer: dict, last: np.ndarray,
              grid_table: Callable) -> list | str:
  """The elementwise chain `G` when `o_out` is `G(acc)` (unconditionally or on the last
  step only, keeping `o` before), as (equation, position of the running value)."""
  chain = _elementwise_chain(o_out, acc, producer)
  if chain is not None:
    return chain
  eqn = producer.get(o_out) if not isinstance(o_out, Literal) else None
  if eqn is None or eqn.primitive.name != "cond" or eqn.invars[0].aval.shape != ():
    return "its final value is not an elementwise copy of a scratch accumulator"
  k = eqn.outvars.index(o_out)
  operands, writes, found = eqn.invars[1:], set(), None
  for i, b in enumerate(eqn.params["branches"]):
    out = b.jaxpr.outvars[k]
    if out in b.jaxpr.invars and operands[b.jaxpr.invars.index(out)] is o_var:
      continue
    inner_producer = {v: e for e in b.jaxpr.eqns for v in e.outvars}
    targets = [v for v, x in zip(b.jaxpr.invars, operands) if _canonical(x, producer) is acc]
    chain = next((c for t in targets
                  if (c := _elementwise_chain(out, t, inner_producer)) is not None), None)
    if chain is None or (found is not None and _signature(chain) != _signature(found)):
      return "a pl.when branch writes it with something other than a copy of the accumulator"
    found = chain
    writes.add(i)
  table = grid_table(eqn.invars[0])
  if found is None or table is None or not np.array_equal(np.isin(table, sorted(writes)), last):
    return "it is not written exactly on the last step of the reduction"
  return found


def _signature(chain: list) -> list:
  return [(e.primitive.name, pos, tuple(sorted(map(str, e.params.items())))) for e, pos in chain]


def _elementwise_chain(var: Any, target: Any, producer: dict) -> list | None:
  chain = []
  while var is not target:
    if isinstance(var, Literal) or var not in producer:
      return None
    if _canonical(var, producer) is target:
      break
    eqn = producer[var]
    running = [k for k, x in enumerate(eqn.invars) if not isinstance(x, Literal)]
    if (eqn.primitive.name not in _COPY_OPS or len(running) != 1
        or any(np.ndim(x.val) != 0 for x in eqn.invars if isinstance(x, Literal))):
      return None
    chain.append((eqn, running[0]))
    var = eqn.invars[running[0]]
  return chain[::-1]


def _grid_table(pure: Any, var: Any, ids: Sequence[Any], grid: tuple[int, ...]
                ) -> np.ndarray | None:
  """`var` evaluated at every grid point, None if it depends on more than grid ids."""
  if isinstance(var, Literal):
    return np.full(grid, np.asarray(var.val))
  if list(ids) == list(pure.jaxpr.invars[:len(grid)]):   # NumPy first: eager JAX ops
    table = grid_eval.value_over_grid(pure.jaxpr, pure.consts, var, grid)  # compile each
    if table is not None:
      return table
  try:
    run = lambda *point: _evaluate(pure.jaxpr, pure.consts, dict(zip(ids, point)), [var])[0]
    n = int(np.prod(grid))
    coords = [jnp.asarray(c) for c in np.indices(grid).reshape(len(grid), n).astype(np.int32)]
    with internals.eval_context():
      return np.asarray(jax.vmap(run)(*coords)).reshape(grid)
  except _Unbound:
    return None


class _Unbound(Exception):
  """A value needs a jaxpr input that was not given."""


def _evaluate(jaxpr: Any, consts: Sequence[Any], bound: dict, targets: Sequence[Any]) -> list:
  """The `targets` of `jaxpr` from the inputs in `bound`, running only what they need."""
  needed = {t for t in targets if not isinstance(t, Literal)}
  eqns = []
  for eqn in reversed(jaxpr.eqns):
    if any(v in needed for v in eqn.outvars):
      eqns.append(eqn)
      needed.update(x for x in eqn.invars if not isinstance(x, Literal))
  env = dict(zip(jaxpr.constvars, consts))
  env.update(bound)

  def read(x):
    if isinstance(x, Literal):
      return x.val
    if x not in env:
      raise _Unbound()
    return env[x]
  for eqn in reversed(eqns):
    outs = internals.bind_equation(eqn, [read(x) for x in eqn.invars], source=False)
    env.update(zip(eqn.outvars, outs))
  return [read(t) for t in targets]


# ------------------------------------------------------------------ the new kernel
def _virtual_kernel(kernel: KernelDescription, pure: Any, accumulated: list) -> KernelDescription:
  """The kernel whose outputs are the scratch accumulators (blocks as the outputs')."""
  gm = kernel.grid_mapping
  G, n_in, n_out = len(gm.grid), len(gm.inputs), len(gm.outputs)
  jaxpr = pure.jaxpr
  ids, ins = jaxpr.invars[:G], jaxpr.invars[G:G + n_in]
  s_in = jaxpr.invars[G + n_in + n_out:]
  outputs = tuple(
      BlockMapping(origin=f"{o.origin}'s scratch accumulator", array_shape=o.array_shape,
                   dtype=a.dtype, dims=o.dims, index_map=o.index_map,
                   memory_space=o.memory_space, whole=o.whole)
      for o, a in zip(gm.outputs, gm.scratch_avals))
  new_gm = gm.replace(outputs=outputs, scratch_avals=())

  def body(*args):
    id_vals, refs = args[:G], args[G:]
    in_refs, acc_refs = refs[:n_in], refs[n_in:]
    bound = {**dict(zip(ids, id_vals)), **{v: r[...] for v, r in zip(ins, in_refs)},
             **{v: r[...] for v, r in zip(s_in, acc_refs)}}
    for r, value in zip(acc_refs, _evaluate(jaxpr, pure.consts, bound, accumulated)):
      r[...] = value
    return []

  avals = ([jax.core.ShapedArray((), jnp.int32)] * G
           + [internals.AbstractRef(b.kernel_aval) for b in (*gm.inputs, *outputs)])
  return kernel.replace(jaxpr=internals.trace_jaxpr(body, avals, "scratch accumulators"),
                        grid_mapping=new_gm,
                        ref_names=kernel.ref_names[:n_in] + kernel.ref_names[n_in + n_out:])

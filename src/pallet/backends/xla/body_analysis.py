"""Facts about a kernel body that the planner needs, proven from its discharged jaxpr.

* `trip_count_axes`: grid axes whose index reaches the condition of a while loop
  (a `fori_loop` with a program-dependent bound). Under `vmap` such a loop runs
  the longest trip count for every program, so the planner keeps these axes looped.
* `accumulators`: outputs whose final value is `mask * o + F`, where `o` is the
  block on entry, `F` does not depend on `o`, and `mask` is 0 or 1 per grid step,
  decided by scalar predicates of the grid indices (`pl.when(k == 0)` zeroing the
  block). For such outputs a reduction axis can run vectorized with `o = 0`,
  and the per-step results summed. Anything the analysis does not recognise makes
  the output a non-accumulator: the proof is conservative, never assumed.
* `intermediate_bytes`: the largest value one grid step creates, to bound how
  many steps may be vectorized at once;
* `has_matrix_product`: whether the body multiplies matrices (the planner only
  sums reduction axes of such compute-bound bodies, see plan.py).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from pallet import _internals as internals
from pallet.core import discharge, grid_eval, primitives, trace_cache
from pallet.core.grid_analysis import apply_equation, is_var as _is_var
from pallet.core.tracing import KernelDescription

_CALL_PRIMITIVES = ("pjit", "jit", "closed_call", "core_call")
_SHAPE_ONLY = ("reshape", "squeeze", "copy", "copy_p")


@dataclasses.dataclass(frozen=True)
class ResetPredicate:
  """The block is zeroed where `value(grid ids)` is one of `zero_when`."""
  value: Callable[[Sequence[Any], Callable], Any]   # (grid ids, apply) -> scalar
  zero_when: frozenset[int]


@dataclasses.dataclass(frozen=True)
class Accumulator:
  """Output `origin`'s block on entry, times a mask that the resets zero."""
  origin: int
  resets: tuple[ResetPredicate, ...] = ()


_ZERO = "zero"      # a value known to be all zeros (and free of outputs)
_DIRTY = "dirty"    # depends on an output block in a way not proven affine


@dataclasses.dataclass
class BodyFacts:
  trip_count_axes: frozenset[int]
  accumulators: dict[int, tuple[ResetPredicate, ...]]   # output -> its resets
  not_accumulators: dict[int, str]                       # output -> why not
  intermediate_bytes: int
  has_matrix_product: bool


class _NotGridOnly(Exception):
  """A reset predicate depends on data, not only on grid indices."""


# ------------------------------------------------------------------ helpers
def _live_eqns(jaxpr: Any) -> list[Any]:
  """Equations whose results are used (dead code would block the proofs)."""
  live = {v for v in jaxpr.outvars if _is_var(v)}
  kept = []
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(v in live for v in eqn.outvars):
      kept.append(eqn)
      live.update(v for v in eqn.invars if _is_var(v))
  return kept[::-1]


def _is_zero_literal(x: Any) -> bool:
  if not isinstance(x, Literal):
    return False
  val = np.asarray(x.val)
  return val.size > 0 and not np.any(val)


def itemsize(dtype: Any) -> int:
  """Bytes per element; extended dtypes (typed PRNG keys, key<fry>) are not NumPy
  dtypes but know their size."""
  return getattr(dtype, "itemsize", None) or np.dtype(dtype).itemsize


def _nbytes(aval: Any) -> int:
  shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  return math.prod(shape) * itemsize(dtype)


def _binds(jaxpr: Any, name: str) -> bool:
  return any(eqn.primitive.name == name or any(_binds(sub, name) for sub in _nested_jaxprs(eqn))
             for eqn in jaxpr.eqns)


def max_intermediate_bytes(jaxpr: Any) -> int:
  """Size of the largest value any equation (nested ones included) creates; a loop
  or branch result that is one of its operands, unchanged (a ref the kernel only
  reads, threaded through by state discharge), creates nothing."""
  best = 0
  for eqn in jaxpr.eqns:
    passed = _passed_through(eqn)
    best = max([best] + [_nbytes(v.aval) for k, v in enumerate(eqn.outvars)
                         if k not in passed])
    for sub in _nested_jaxprs(eqn):
      best = max(best, max_intermediate_bytes(sub))
  return best


def _passed_through(eqn: Any) -> set[int]:
  """Results of a while loop or cond that are always one of its operands."""
  name = eqn.primitive.name
  if name == "while":
    nb = eqn.params["body_nconsts"]
    body = eqn.params["body_jaxpr"].jaxpr
    return {k for k, (v, out) in enumerate(zip(body.invars[nb:], body.outvars)) if out is v}
  if name == "cond":
    branches = [b.jaxpr for b in eqn.params["branches"]]
    return {k for k in range(len(eqn.outvars))
            if len({b.invars.index(b.outvars[k]) if b.outvars[k] in b.invars else -1 - i
                    for i, b in enumerate(branches)}) == 1}
  return set()


# ------------------------------------------------------------------ trip counts
def _grid_dependencies(jaxpr: Any, in_deps: list[frozenset], feeds: set[int]) -> list[frozenset]:
  """Which grid axes each output of `jaxpr` depends on; adds to `feeds` the axes
  that reach a while-loop condition."""
  deps: dict[Any, frozenset] = dict(zip(jaxpr.invars, in_deps))

  def of(x):
    return deps.get(x, frozenset()) if _is_var(x) else frozenset()

  for eqn in jaxpr.eqns:
    ins = [of(x) for x in eqn.invars]
    everything = frozenset().union(*ins) if ins else frozenset()
    name = eqn.primitive.name
    if name == "while":
      nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
      cconsts, bconsts, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
      body = eqn.params["body_jaxpr"].jaxpr
      while True:   # carried dependencies grow to a fixed point
        new = _grid_dependencies(body, bconsts + carry, feeds)
        merged = [a | b for a, b in zip(carry, new)]
        if merged == carry:
          break
        carry = merged
      (cond_dep,) = _grid_dependencies(eqn.params["cond_jaxpr"].jaxpr, cconsts + carry, feeds)
      feeds.update(cond_dep)
      outs = carry
    elif name == "cond":
      branch_outs = [_grid_dependencies(b.jaxpr, ins[1:], feeds)
                     for b in eqn.params["branches"]]
      outs = [ins[0].union(*col) for col in zip(*branch_outs)]
    elif name in _CALL_PRIMITIVES and "jaxpr" in eqn.params:
      sub = eqn.params["jaxpr"]
      outs = _grid_dependencies(getattr(sub, "jaxpr", sub), ins, feeds)
    else:
      for sub in _nested_jaxprs(eqn):
        _grid_dependencies(sub, [everything] * len(sub.invars), feeds)
      outs = [everything] * len(eqn.outvars)
    for v, d in zip(eqn.outvars, outs):
      deps[v] = d
  return [of(x) for x in jaxpr.outvars]


def _nested_jaxprs(eqn: Any) -> list[Any]:
  subs = []
  for p in eqn.params.values():
    for x in (p if isinstance(p, (tuple, list)) else (p,)):
      inner = getattr(x, "jaxpr", None)
      if inner is not None and hasattr(inner, "eqns"):
        subs.append(inner)
      elif hasattr(x, "eqns") and hasattr(x, "invars"):
        subs.append(x)
  return subs


# ------------------------------------------------------------------ accumulators
class _Scope:
  """One jaxpr being analysed, able to evaluate grid-only values inside it."""

  def __init__(self, jaxpr: Any, consts: Sequence[Any],
               invar_value: Callable[[int, Sequence[Any], Callable], Any]):
    self.jaxpr = jaxpr
    self.consts = dict(zip(jaxpr.constvars, consts))
    self.invar_value = invar_value
    self.producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    self.invar_index = {v: i for i, v in enumerate(jaxpr.invars)}

  def value(self, x: Any, ids: Sequence[Any], apply: Callable,
            cache: dict | None = None) -> Any:
    """`x` as a function of the grid ids, its equations run by `apply` (JAX's
    `apply_equation`, traceable, or NumPy's); raises _NotGridOnly."""
    cache = {} if cache is None else cache
    numpy = apply is grid_eval.apply_equation
    if not _is_var(x):
      return np.asarray(x.val, x.aval.dtype) if numpy else x.val
    if x in cache:
      return cache[x]
    if x in self.consts:
      result = self.consts[x]
      if numpy and np.ndim(result):
        raise grid_eval.Unsupported("a non-scalar constant")
    elif x in self.invar_index:
      result = self.invar_value(self.invar_index[x], ids, apply)
    else:
      eqn = self.producer[x]
      if eqn.effects:
        raise _NotGridOnly()
      outs = apply(eqn, [self.value(v, ids, apply, cache) for v in eqn.invars])
      for v, o in zip(eqn.outvars, outs):
        cache[v] = o
      result = cache[x]
    cache[x] = result
    return result


def _child_scope(parent: _Scope, closed: Any, operands: Sequence[Any]) -> _Scope:
  jaxpr = getattr(closed, "jaxpr", closed)
  consts = getattr(closed, "consts", ())
  return _Scope(jaxpr, consts, lambda i, ids, apply: parent.value(operands[i], ids, apply))


def _forms(scope: _Scope, in_forms: list[Any]) -> list[Any]:
  """Abstract interpretation: for each output of the scope's jaxpr, None (free of
  output blocks), _ZERO, an Accumulator, or _DIRTY."""
  forms: dict[Any, Any] = dict(zip(scope.jaxpr.invars, in_forms))

  def of(x):
    if not _is_var(x):
      return _ZERO if _is_zero_literal(x) else None
    return forms.get(x)

  for eqn in _live_eqns(scope.jaxpr):
    ins = [of(x) for x in eqn.invars]
    outs = _eqn_forms(scope, eqn, ins)
    for v, f in zip(eqn.outvars, outs):
      forms[v] = f
  return [of(x) for x in scope.jaxpr.outvars]


def _free(form: Any) -> bool:
  return form is None or form is _ZERO


def _merge_choices(scope: _Scope, selector: Any, choices: list[Any]) -> Any:
  """Form of a value that is `choices[selector]` with `selector` a scalar."""
  if all(_free(c) for c in choices):
    return _ZERO if all(c is _ZERO for c in choices) else None
  accs = [c for c in choices if isinstance(c, Accumulator)]
  if len(accs) + sum(_free(c) for c in choices) != len(choices):
    return _DIRTY
  if len({(a.origin, a.resets) for a in accs}) != 1:
    return _DIRTY
  zero_when = frozenset(i for i, c in enumerate(choices) if _free(c))
  if not zero_when:
    return accs[0]
  if getattr(selector, "aval", None) is not None and selector.aval.shape != ():
    return _DIRTY
  predicate = ResetPredicate(lambda ids, apply, s=scope, x=selector: s.value(x, ids, apply),
                             zero_when)
  return Accumulator(accs[0].origin, accs[0].resets + (predicate,))


def _eqn_forms(scope: _Scope, eqn: Any, ins: list[Any]) -> list[Any]:
  n_out = len(eqn.outvars)
  if all(_free(f) for f in ins):
    if eqn.primitive.name == "broadcast_in_dim" and ins[0] is _ZERO:
      return [_ZERO]
    if eqn.primitive.name == "convert_element_type" and ins[0] is _ZERO:
      return [_ZERO]
    return [None] * n_out
  if any(f is _DIRTY for f in ins):
    return [_DIRTY] * n_out
  name = eqn.primitive.name
  acc_at = [i for i, f in enumerate(ins) if isinstance(f, Accumulator)]
  if name in _SHAPE_ONLY and eqn.params.get("dimensions") is None:  # no transposition
    return [ins[0]]
  if name == "convert_element_type":
    same = eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype
    return [ins[0] if same else _DIRTY]
  if name in ("add", "add_any") and len(acc_at) == 1:
    return [ins[acc_at[0]]]
  if name == "sub" and acc_at == [0]:
    return [ins[0]]
  if name == "scatter-add" and acc_at == [0]:
    return [ins[0]]
  if name == "select_n" and 0 not in acc_at:
    return [_merge_choices(scope, eqn.invars[0], ins[1:])]
  if name == "cond" and 0 not in acc_at:
    operands = eqn.invars[1:]
    per_branch = [_forms(_child_scope(scope, b, operands), ins[1:])
                  for b in eqn.params["branches"]]
    return [_merge_choices(scope, eqn.invars[0], list(col)) for col in zip(*per_branch)]
  if name in _CALL_PRIMITIVES and "jaxpr" in eqn.params:
    return _forms(_child_scope(scope, eqn.params["jaxpr"], eqn.invars), ins)
  return [_DIRTY] * n_out


def _accumulators(kernel: KernelDescription, pure: Any
                  ) -> tuple[dict[int, tuple[ResetPredicate, ...]], dict[int, str]]:
  gm = kernel.grid_mapping
  G, n_pre, n_in = len(gm.grid), len(gm.prefetch_avals), len(gm.inputs)
  n_out = len(gm.outputs)
  if gm.scratch_avals:
    why = "the kernel uses scratch buffers"
    return {}, {o: why for o in range(n_out)}

  def top_value(i, ids, apply):
    if i < G:
      return ids[i]
    raise _NotGridOnly()

  scope = _Scope(pure.jaxpr, pure.consts, top_value)
  in_forms = ([None] * (G + n_pre + n_in) + [Accumulator(o) for o in range(n_out)])
  finals = _forms(scope, in_forms)[n_pre + n_in:n_pre + n_in + n_out]
  found, why_not = {}, {}
  for o, form in enumerate(finals):
    if isinstance(form, Accumulator) and form.origin == o:
      found[o] = form.resets
    elif form is None or form is _ZERO:
      why_not[o] = "its final value does not depend on its previous value"
    else:
      why_not[o] = "its final value is not (maybe zeroed) previous value + a term free of it"
  return found, why_not


def evaluate_resets(resets: tuple[ResetPredicate, ...], grid: tuple[int, ...]) -> np.ndarray | None:
  """Bool table over the grid: where the block is zeroed; None if not grid-only."""
  n = math.prod(grid)
  if not resets:
    return np.zeros(grid, bool)
  coords = list(np.indices(grid).reshape(len(grid), n).astype(np.int32))
  try:   # NumPy first: eager JAX ops compile a program per primitive
    hit = np.zeros(n, bool)
    for r in resets:
      v = np.asarray(r.value(coords, grid_eval.apply_equation)).astype(np.int32)
      hit = hit | np.isin(v, sorted(r.zero_when))
    return hit.reshape(grid)
  except _NotGridOnly:
    return None
  except Exception:  # noqa: BLE001 - Unsupported, or a case NumPy gets wrong: JAX's path decides
    pass
  coords = [jnp.asarray(c) for c in coords]

  def at(*ids):
    hit = jnp.bool_(False)
    for r in resets:
      v = jnp.asarray(r.value(ids, apply_equation))
      hit = hit | jnp.isin(v.astype(jnp.int32), jnp.array(sorted(r.zero_when), jnp.int32))
    return hit
  try:
    with internals.eval_context():
      table = np.asarray(jax.vmap(at)(*coords))
  except _NotGridOnly:
    return None
  return table.reshape(grid)


@trace_cache.kernel_cache
def discharged(kernel: KernelDescription) -> Any:
  """The kernel's pure (state-discharged) jaxpr. Discharging traces every
  equation's rule, so the analyses and the emitted body share one per kernel;
  atomics whose results nothing reads discharge to plain scatters."""
  return discharge.discharge_state(primitives.unread_atomics_as_updates(kernel.jaxpr))


def trip_count_axes(jaxpr: Any, num_axes: int) -> frozenset[int]:
  """Grid axes whose index reaches the condition of a while loop in `jaxpr` (a
  discharged body whose first `num_axes` inputs are the grid indices)."""
  feeds: set[int] = set()
  in_deps = ([frozenset({g}) for g in range(num_axes)]
             + [frozenset()] * (len(jaxpr.invars) - num_axes))
  _grid_dependencies(jaxpr, in_deps, feeds)
  return frozenset(feeds)


def analyse_body(kernel: KernelDescription) -> BodyFacts:
  gm = kernel.grid_mapping
  pure = discharged(kernel)
  accumulators, not_accumulators = _accumulators(kernel, pure)
  return BodyFacts(trip_count_axes=trip_count_axes(pure.jaxpr, len(gm.grid)),
                   accumulators=accumulators,
                   not_accumulators=not_accumulators,
                   intermediate_bytes=max_intermediate_bytes(pure.jaxpr),
                   has_matrix_product=_binds(pure.jaxpr, "dot_general"))


# ------------------------------------------------------------------ merging into blocks
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "abs", "sign", "max", "min", "exp", "exp2", "log",
    "log1p", "expm1", "sqrt", "rsqrt", "square", "integer_pow", "tanh", "logistic", "sin",
    "cos", "pow", "convert_element_type"})


def blocks_merge_along(kernel: KernelDescription, tiled: dict[int, int]) -> str | None:
  """Whether the body may run once on input blocks widened along a reduction axis.

  `tiled` maps input index -> the array dimension it tiles along that axis. The
  answer is None (yes) when every output ends as `reset(o) + S`, where S is a
  `reduce_sum` over the widened dimension, or a matrix product contracting the
  widened dimensions of both its operands, of values elementwise in those inputs
  only (and literal scalars): then one run on the concatenated blocks gives the
  sum over the axis of every step's term. Otherwise, a reason why not.
  """
  gm = kernel.grid_mapping
  pure = discharged(kernel)
  jaxpr = pure.jaxpr
  G, n_pre, n_in = len(gm.grid), len(gm.prefetch_avals), len(gm.inputs)
  stacked: dict[Any, int] = {}           # value -> its widened (kernel) dimension
  for i, d in tiled.items():
    dims = gm.inputs[i].dims
    if dims[d].kind != "blocked":
      return f"{gm.inputs[i].origin} tiles a squeezed or element dimension"
    stacked[jaxpr.invars[G + n_pre + i]] = sum(1 for e in dims[:d] if e.kind != "squeezed")
  summed: set[Any] = set()
  out_vars = jaxpr.outvars[n_pre + n_in:n_pre + n_in + len(gm.outputs)]
  out_invars = jaxpr.invars[G + n_pre + n_in:G + n_pre + n_in + len(gm.outputs)]
  finals: dict[Any, Any] = {}
  for eqn in _live_eqns(jaxpr):
    name = eqn.primitive.name
    wide = [x for x in eqn.invars if _is_var(x) and x in stacked]
    if any(_is_var(x) and x in summed for x in eqn.invars):
      if name not in ("add", "add_any") or eqn.outvars[0] not in out_vars:
        return f"the block-wide sum feeds {name}, not the output's final add"
      finals[eqn.outvars[0]] = eqn
      continue
    if not wide:
      continue
    if name == "reduce_sum":
      if stacked[eqn.invars[0]] not in eqn.params["axes"]:
        return "a reduction keeps the dimension the blocks would be widened along"
      summed.add(eqn.outvars[0])
      continue
    if name == "dot_general":
      # sum_k a_k . b_k is the product of the blocks widened along the contraction
      (lhs_c, rhs_c), _ = eqn.params["dimension_numbers"]
      a, b = eqn.invars
      if not (len(wide) == 2 and (stacked[a], stacked[b]) in list(zip(lhs_c, rhs_c))):
        return "a matrix product does not contract the widened dimension of both blocks"
      summed.add(eqn.outvars[0])
      continue
    if name not in _ELEMENTWISE:
      return f"{name} is applied to a block of an input tiled along the axis"
    positions = {stacked[x] for x in wide}
    shapes = {x.aval.shape for x in wide}
    others = [x for x in eqn.invars if not (_is_var(x) and x in stacked)]
    if len(positions) != 1 or len(shapes) != 1 or any(
        _is_var(x) or np.ndim(x.val) != 0 for x in others):
      return f"{name} combines tiled blocks with other values"
    stacked[eqn.outvars[0]] = positions.pop()
  if any(x in stacked or x in summed for x in jaxpr.outvars[n_pre + n_in:] if _is_var(x)):
    return "a tiled block reaches an output unsummed"
  for o, (var, o_in) in enumerate(zip(out_vars, out_invars)):
    eqn = finals.get(var)
    if eqn is None:
      return f"{gm.outputs[o].origin} does not end as (maybe zeroed) o + a block-wide sum"
    other = [x for x in eqn.invars if not (_is_var(x) and x in summed)]
    if len(other) != 1 or not _plain_reset_of(jaxpr, other[0], o_in):
      return f"{gm.outputs[o].origin} adds more than a block-wide sum to its block"
  return None


def _plain_reset_of(jaxpr: Any, var: Any, block: Any, zeros: frozenset = frozenset()) -> bool:
  """Whether `var` is `block` or `block` zeroed by a select/cond, with nothing added.
  `zeros`: variables of `jaxpr` known to be zero (call parameters bound to 0)."""
  if var is block:
    return True
  if not _is_var(var):
    return False
  producer = next((e for e in jaxpr.eqns if var in e.outvars), None)
  if producer is None:
    return False
  k = producer.outvars.index(var)
  name = producer.primitive.name
  if name == "select_n":
    return all(_plain_reset_of(jaxpr, x, block, zeros) or _is_zero_value(jaxpr, x, zeros)
               for x in producer.invars[1:])
  if name == "cond":
    operands = producer.invars[1:]
    for branch in producer.params["branches"]:
      out = branch.jaxpr.outvars[k]
      if out in branch.jaxpr.invars:
        if operands[branch.jaxpr.invars.index(out)] is not block:
          return False
      elif not _is_zero_value(branch.jaxpr, out):
        return False
    return True
  if name in _CALL_PRIMITIVES and "jaxpr" in producer.params:
    inner = producer.params["jaxpr"].jaxpr
    bound = list(zip(inner.invars, producer.invars))
    inner_zeros = frozenset(v for v, x in bound
                            if (x in zeros if _is_var(x) else _is_zero_literal(x)))
    # the inner result must be a reset of the inner parameter bound to `block`
    return any(_plain_reset_of(inner, inner.outvars[k], v, inner_zeros)
               for v, x in bound if x is block)
  return False


def _is_zero_value(jaxpr: Any, x: Any, zeros: frozenset = frozenset()) -> bool:
  if not _is_var(x):
    return _is_zero_literal(x)
  if x in zeros:
    return True
  producer = next((e for e in jaxpr.eqns if x in e.outvars), None)
  if producer is None or producer.primitive.name not in ("broadcast_in_dim",
                                                          "convert_element_type"):
    return False
  return _is_zero_value(jaxpr, producer.invars[0], zeros)

"""Lanes a kernel pads onto its data, dropped where nothing can observe them.

Triton-style kernels work on power-of-two blocks: a row of 192 columns is loaded
as 256 lanes, `plgpu.load(x_ref.at[cols], mask=cols < 192, other=0)` with `cols =
jnp.arange(256)`, reduced, and stored back through the same mask. In the
discharged body that load is a `pad` of the 192 real values, and on the CPU the pad
costs more than the kernel: XLA:CPU materialises it (its reductions run in a
library that takes no fused pad), a copy of the whole block, 40-54% of the time of
JAX's GPU layer norm, RMS norm and softmax at the sizes of JAX's tests.

`narrow` rewrites the body to compute on the real lanes only, where that provably
gives the same values. An abstract interpretation follows every value derived
from such a pad along the padded axis, keeping for each the *tail*: what its lanes
past the real width hold, a constant (the load's `other`, or what arithmetic on
constants makes of it), a range of integers (an iota's positions and shifts of
them), or unknown. A reduction over the axis drops the tail where the tail is the
reduction's identity (0 for a sum, -inf for a max); a slice that keeps only real
lanes (the masked store) drops it; a product contracts over real lanes only where
both tails are finite constants whose product is 0. Anything else that reads a
narrowed value gets it padded back with its constant tail, and where the tail is
unknown there the body is left as it was. Masks compare an iota with the width,
so their tails are constants, and selects on them pick one side's tail.

Blocks are seeds too. A Triton-style attention kernel pads a head dimension of 72 to
a block of 128 lanes with its BlockSpecs, so the block runs past its array's end; the
executor says which blocks do (`Boundary`). Their lanes past the width hold padding,
an unknown tail, and what the body writes there lands past the array's end, where
nothing reads it: an output block may be returned with those lanes as they came.
Such kernels work in loops, so calls, conds, scans and while loops are entered: their
bodies are planned on the narrowed operands, a loop's carries iterated to a fixpoint
(narrow where the initial value or the body's result is, tails joined), and the
bodies traced again on the real lanes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
from jax import dtypes, lax
from jax.extend.core import ClosedJaxpr, Literal

from pallet import _internals as internals
from pallet.backends.xla import nested_jaxprs
from pallet.backends.xla.widening import ELEMENTWISE


@dataclasses.dataclass(frozen=True)
class Tail:
  """What the lanes past the real width hold: `const` (a NumPy scalar), or integers
  in [`low`, `high`], or (both None) unknown. With `nan_rows`, `const` holds except
  in rows (positions along the other axes) whose real lanes are all NaN: `x - max(x)`
  over a row padded with -inf is -inf past the width unless the max is -inf or NaN,
  and then every real lane of the row is NaN, as every sum or max over it."""
  const: Any = None
  low: int | None = None
  high: int | None = None
  nan_rows: bool = False

  @property
  def known(self) -> bool:
    return self.const is not None

  @property
  def exact(self) -> bool:
    """Whether the padded lanes surely hold `const` (the value can be padded back)."""
    return self.known and not self.nan_rows


UNKNOWN = Tail()


@dataclasses.dataclass(frozen=True)
class Lanes:
  """A value kept narrow: `axis` has `width` real lanes of `padded`; `head` is what
  is known of the real lanes alike (a mask that holds on all of them)."""
  axis: int
  width: int
  padded: int
  tail: Tail
  head: Tail = Tail()


_COMPARISONS = {"lt": np.less, "le": np.less_equal, "gt": np.greater,
                "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal}
_IDENTITY = {"reduce_sum": 0, "reduce_max": -np.inf, "reduce_min": np.inf,
             "reduce_or": False, "reduce_and": True}
# Elementwise arithmetic that gives NaN wherever an operand is NaN (so rows of NaN
# stay rows of NaN); XLA's max and min propagate NaN too.
_NAN_PROPAGATING = frozenset({"add", "sub", "mul", "div", "neg", "exp", "exp2", "log",
                              "log1p", "expm1", "sqrt", "rsqrt", "tanh", "logistic",
                              "integer_pow", "square", "max", "min"})


@dataclasses.dataclass(frozen=True)
class Boundary:
  """What the executor knows of a body's blocks. `seeds`: invar index -> (axis, real
  width) of a block that lies past its array's end from that width on at every step
  (its lanes there hold padding); `sinks`: outvar index -> the invar index of the same
  block, whose lanes past the width land past the array's end, where no result and no
  later step (its seed lanes are unknown) reads them."""
  seeds: dict = dataclasses.field(default_factory=dict)
  sinks: dict = dataclasses.field(default_factory=dict)


def narrow(closed: ClosedJaxpr, boundary: Boundary = Boundary()) -> ClosedJaxpr:
  """`closed` computing on real lanes only where its padded lanes cannot be
  observed (itself where no lane can be dropped)."""
  jaxpr = closed.jaxpr
  if not boundary.seeds and not any(_seed(e) for e in jaxpr.eqns):
    return closed
  entry = {}
  for i, (axis, width) in boundary.seeds.items():
    v = jaxpr.invars[i]
    entry[v] = Lanes(axis, width, v.aval.shape[axis], UNKNOWN)
  plan = _plan(jaxpr, _Scope(dict(zip(jaxpr.constvars, closed.consts)), _producers(jaxpr)),
               entry)
  if plan is None or not _saves(plan):
    return closed
  lanes = plan[0]
  sink_of = {}   # outvar index -> invar index, for sinks narrowed as their seed is
  for i, x in enumerate(jaxpr.outvars):
    if isinstance(x, Literal) or x not in lanes:
      continue
    j = boundary.sinks.get(i)
    if j is not None and (lanes[x].axis, lanes[x].width) == boundary.seeds[j]:
      sink_of[i] = j
    elif not lanes[x].tail.exact:
      return closed

  def rewritten(*args):
    narrowed = [_real_lanes(a, lanes[v]) if v in entry else a
                for v, a in zip(jaxpr.invars, args)]
    read, whole = _evaluate(jaxpr, closed.consts, narrowed, plan)
    results = []
    for i, x in enumerate(jaxpr.outvars):
      j = sink_of.get(i)
      if j is None:
        results.append(whole(x))
      elif x is jaxpr.invars[j]:
        results.append(args[j])
      else:   # the real lanes written into the block as it came (in place for XLA)
        results.append(lax.dynamic_update_slice(args[j], read(x), [np.int32(0)] * x.aval.ndim))
    return results
  avals = [v.aval for v in jaxpr.invars]
  return internals.trace_jaxpr(rewritten, avals, "padded lanes")


def _seed(eqn: Any) -> tuple[int, int] | None:
  """(axis, real width) of a pad that appends lanes along one axis only."""
  if eqn.primitive.name != "pad":
    return None
  config = eqn.params["padding_config"]
  padded = [d for d, (lo, hi, inner) in enumerate(config) if (lo, hi, inner) != (0, 0, 0)]
  if len(padded) != 1:
    return None
  d = padded[0]
  lo, hi, inner = config[d]
  if lo != 0 or inner != 0 or hi <= 0 or not isinstance(eqn.invars[1], Literal):
    return None
  return d, eqn.invars[0].aval.shape[d]


# ------------------------------------------------------------------ analysis
# actions; anything else is read whole. PRODUCT: a matrix product computed narrow.
SEED, NARROW, DROP, PRODUCT = "seed", "narrow", "drop", "product"
_FIXPOINT_ROUNDS = 4   # a carry's tail only ever widens: constant, then unknown


@dataclasses.dataclass
class _Scope:
  """Where the values of one jaxpr come from: constants, producing equations, and for
  a nested jaxpr's invariant inputs (a call's operands, a loop's constants) the value
  outside it they are (and that value's scope)."""
  const_of: dict
  producer: dict
  outer: dict = dataclasses.field(default_factory=dict)


def _producers(jaxpr: Any) -> dict:
  return {v: e for e in jaxpr.eqns for v in e.outvars}


def _plan(jaxpr: Any, scope: _Scope, entry: dict) -> tuple[dict, dict] | None:
  """({var: Lanes} of the values kept narrow, {equation index: action}) with the
  invars in `entry` arriving narrow, or None where a narrowed value with an unknown
  tail would be read whole. Results may stay narrow: the caller decides."""
  lanes: dict = dict(entry)
  actions: dict = {}
  paddable = lambda x: isinstance(x, Literal) or x not in lanes or lanes[x].tail.exact
  for k, eqn in enumerate(jaxpr.eqns):
    ins = eqn.invars
    narrowed = [x for x in ins if not isinstance(x, Literal) and x in lanes]
    seed = _seed(eqn)
    if seed is not None and not narrowed:
      d, width = seed
      lanes[eqn.outvars[0]] = Lanes(d, width, eqn.outvars[0].aval.shape[d],
                                    Tail(const=np.asarray(ins[1].val)))
      actions[k] = SEED
      continue
    if not narrowed:
      continue
    nested = _nested(eqn, lanes, scope)
    out = _rule(eqn, lanes, scope) if nested is None else None
    if nested is not None and nested is not _WHOLE:
      action, out_lanes = nested
      actions[k] = action
      lanes.update((v, ln) for v, ln in zip(eqn.outvars, out_lanes) if ln is not None)
    elif out is None:     # read whole: padded back with its constant tail
      if not all(paddable(x) for x in ins):
        return None
    elif out == DROP:
      actions[k] = DROP
    else:
      lanes[eqn.outvars[0]] = out
      actions[k] = PRODUCT if eqn.primitive.name == "dot_general" else (
          _shortcut(eqn, out, lanes, scope) or NARROW)
  return lanes, actions


def _saves(plan: tuple[dict, dict]) -> bool:
  """Whether a plan (or one nested in it) drops padded lanes from a reduction or a
  product: elementwise work alone saves less than slicing and padding back cost."""
  return any(action in (DROP, PRODUCT) or any(_saves(p) for p in _nested_plans(action))
             for action in plan[1].values())


def _nested_plans(action: Any) -> tuple:
  if not isinstance(action, tuple):
    return ()
  if action[0] in ("call", "scan"):
    return action[1:2]
  if action[0] == "while":
    return action[1:3]
  return tuple(action[1]) if action[0] == "cond" else ()


# ------------------------------------------------------------------ nested jaxprs
_WHOLE = object()   # a nested jaxpr that cannot take narrowed operands: read them whole


def _nested(eqn: Any, lanes: dict, scope: _Scope) -> Any:
  """For a call, cond, scan or while loop with narrowed operands: (action, Lanes of
  each result or None), `_WHOLE` where its operands must be read whole, None for any
  other equation."""
  name = eqn.primitive.name
  if name == "scan":
    return _scan(eqn, lanes, scope)
  if name == "while":
    return _while(eqn, lanes, scope)
  if name == "cond":
    return _cond(eqn, lanes, scope)
  body = nested_jaxprs.called(eqn)
  if name in nested_jaxprs.CALLS:
    if body is None or eqn.effects:
      return _WHOLE
    jaxpr, consts = getattr(body, "jaxpr", body), tuple(getattr(body, "consts", ()))
    inner, entry = _inner_scope(jaxpr, consts, eqn.invars, lanes, scope, len(eqn.invars))
    plan = _plan(jaxpr, inner, entry)
    if plan is None:
      return _WHOLE
    return ("call", plan, jaxpr, consts), [_lanes_of(x, plan[0]) for x in jaxpr.outvars]
  return None


def _lanes_of(x: Any, lanes: dict) -> Lanes | None:
  return None if isinstance(x, Literal) else lanes.get(x)


def _inner_scope(jaxpr: Any, consts: Sequence[Any], operands: Sequence[Any], lanes: dict,
                 scope: _Scope, n_invariant: int) -> tuple[_Scope, dict]:
  """The scope of a nested jaxpr fed `operands`, of which the first `n_invariant` keep
  their value throughout (constants of a loop), and the Lanes of its narrowed invars."""
  const_of, outer, entry = dict(zip(jaxpr.constvars, consts)), {}, {}
  for k, (x, v) in enumerate(zip(operands, jaxpr.invars)):
    if isinstance(x, Literal):
      const_of[v] = np.asarray(x.val)
    elif x in lanes:
      entry[v] = lanes[x]
    elif k < n_invariant:
      outer[v] = (x, scope)
  return _Scope(const_of, _producers(jaxpr), outer), entry


def _carried(jaxpr: Any, inner: _Scope, entry: dict, first: int, inits: Sequence[Any],
             lanes: dict, scope: _Scope) -> tuple[tuple[dict, dict], list] | None:
  """The plan of a loop body whose carries are invars `first`.. and its leading
  outvars, and the Lanes each carry has at every step, or None. A carry is narrow
  where its initial value or the body's result for it is, with the tails of both
  joined, found by iterating the body to a fixpoint."""
  n = len(inits)
  carry = [_lanes_of(x, lanes) for x in inits]
  for _ in range(_FIXPOINT_ROUNDS):
    carried = {v: ln for v, ln in zip(jaxpr.invars[first:first + n], carry) if ln is not None}
    plan = _plan(jaxpr, inner, {**entry, **carried})
    if plan is None:
      return None
    new = [_either([(init, c, scope), (out, _lanes_of(out, plan[0]), inner)])
           for c, init, out in zip(carry, inits, jaxpr.outvars[:n])]
    if _CONFLICT in new:
      return None
    if new == carry:
      return plan, carry
    carry = new
  return None


_CONFLICT = object()   # values narrowed along different axes or widths


def _either(values: Sequence[tuple[Any, Lanes | None, _Scope]]) -> Any:
  """The Lanes of a value that is any of `values` (a carry's initial value or the
  body's result, a cond's branch results), each (var, its Lanes or None, its scope):
  None where all are whole, else narrow with their tails joined (those computed whole
  are sliced, with what their padded lanes hold), `_CONFLICT` where they disagree."""
  ref = next((ln for _, ln, _ in values if ln is not None), None)
  if ref is None:
    return None
  joined = None
  for x, ln, scope in values:
    if ln is None:
      ln = dataclasses.replace(ref, tail=_known(x, ref, scope, ref.width, ref.padded),
                               head=UNKNOWN)
    if (ln.axis, ln.width) != (ref.axis, ref.width):
      return _CONFLICT
    joined = ln if joined is None else Lanes(ln.axis, ln.width, ln.padded,
                                             _join(joined.tail, ln.tail),
                                             _join(joined.head, ln.head))
  return joined


def _join(a: Tail, b: Tail) -> Tail:
  """What holds of the lanes of a carry that is either."""
  if a.known and b.known and a.nan_rows == b.nan_rows and a.const.dtype == b.const.dtype \
      and np.array_equal(a.const, b.const, equal_nan=True):
    return a
  if a.low is not None and b.low is not None:
    return Tail(low=min(a.low, b.low), high=max(a.high, b.high))
  return UNKNOWN


def _scan(eqn: Any, lanes: dict, scope: _Scope) -> Any:
  body, consts, n_consts, n_carry = internals.scan_layout(eqn.params)
  ops = eqn.invars
  if any(_lanes_of(x, lanes) is not None for x in ops[n_consts + n_carry:]):
    return _WHOLE   # scanned elements stay whole
  inner, entry = _inner_scope(body, consts, ops, lanes, scope, n_consts)
  found = _carried(body, inner, entry, n_consts, ops[n_consts:n_consts + n_carry], lanes, scope)
  if found is None:
    return _WHOLE
  plan, carry = found
  ys = body.outvars[n_carry:]
  if not all(_lanes_of(y, plan[0]) is None or plan[0][y].tail.exact for y in ys):
    return _WHOLE
  return ("scan", plan, carry), carry + [None] * len(ys)


def _cond(eqn: Any, lanes: dict, scope: _Scope) -> Any:
  """Each branch planned on the narrowed operands; a result is narrow where a branch
  gives it narrow (the others' sliced), with the branches' tails joined."""
  branches, ops = eqn.params["branches"], eqn.invars[1:]
  plans, scopes = [], []
  for branch in branches:
    inner, entry = _inner_scope(branch.jaxpr, branch.consts, ops, lanes, scope, len(ops))
    plan = _plan(branch.jaxpr, inner, entry)
    if plan is None:
      return _WHOLE
    plans.append(plan)
    scopes.append(inner)
  out = [_either([(b.jaxpr.outvars[k], _lanes_of(b.jaxpr.outvars[k], p[0]), inner)
                   for b, p, inner in zip(branches, plans, scopes)])
         for k in range(len(eqn.outvars))]
  if _CONFLICT in out:
    return _WHOLE
  return ("cond", plans, out), out


def _while(eqn: Any, lanes: dict, scope: _Scope) -> Any:
  p = eqn.params
  n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
  ops = eqn.invars
  cond_ops, body_ops, inits = ops[:n_cond], ops[n_cond:n_cond + n_body], ops[n_cond + n_body:]
  body = p["body_jaxpr"]
  inner, entry = _inner_scope(body.jaxpr, body.consts, [*body_ops, *inits], lanes, scope,
                              n_body)
  found = _carried(body.jaxpr, inner, entry, n_body, inits, lanes, scope)
  if found is None:
    return _WHOLE
  plan, carry = found
  cond = p["cond_jaxpr"]
  cond_inner, cond_entry = _inner_scope(cond.jaxpr, cond.consts, [*cond_ops, *inits], lanes,
                                        scope, n_cond)
  cond_entry.update((v, ln) for v, ln in zip(cond.jaxpr.invars[n_cond:], carry)
                    if ln is not None)
  cond_plan = _plan(cond.jaxpr, cond_inner, cond_entry)
  if cond_plan is None or any(_lanes_of(x, cond_plan[0]) is not None
                              for x in cond.jaxpr.outvars):
    return _WHOLE
  return ("while", plan, cond_plan, carry), carry


def _rule(eqn: Any, lanes: dict, scope: _Scope) -> Lanes | str | None:
  """The result of `eqn` on narrowed operands: narrow (its Lanes), whole from real
  lanes only (DROP), or None where the operands must be read whole."""
  name, ins = eqn.primitive.name, eqn.invars
  if len(eqn.outvars) != 1:
    return None
  if name in ELEMENTWISE:
    return _elementwise(eqn, lanes, scope)
  if name == "dot_general":
    return _dot(eqn, lanes)
  if name == "dynamic_slice":
    return _dynamic_slice(eqn, lanes)
  if name == "pad":
    return _pad(eqn, lanes)
  ln = lanes.get(ins[0]) if len(ins) == 1 else None
  if ln is None:
    return None
  if name in _IDENTITY:
    return _reduction(eqn, ln)
  if name == "slice":
    return _slice(eqn, ln)
  if name == "transpose":
    return dataclasses.replace(ln, axis=eqn.params["permutation"].index(ln.axis))
  if name == "broadcast_in_dim":
    return dataclasses.replace(ln, axis=eqn.params["broadcast_dimensions"][ln.axis])
  return None


def _shortcut(eqn: Any, out: Lanes, lanes: dict, scope: _Scope) -> tuple[str, Any] | None:
  """A narrowed elementwise result known without computing it: a constant on every
  real lane, or a select whose mask holds alike on all of them."""
  if eqn.primitive.name not in ELEMENTWISE:
    return None
  if out.head.known:
    return ("fill", out.head.const)
  if eqn.primitive.name == "select_n":
    pred = eqn.invars[0]
    head = (Tail(const=np.asarray(pred.val)) if isinstance(pred, Literal) else
            UNKNOWN if pred.aval.shape == () else lanes[pred].head if pred in lanes else
            _known(pred, out, scope, 0, out.width))
    picked = eqn.invars[1 + int(head.const)] if head.known else None
    if picked is not None and not isinstance(picked, Literal) and \
        picked.aval.shape == eqn.outvars[0].aval.shape:
      return ("pick", 1 + int(head.const))
  return None


def _elementwise(eqn: Any, lanes: dict, scope: _Scope) -> Lanes | None:
  shape = eqn.outvars[0].aval.shape
  first = next(lanes[x] for x in eqn.invars if not isinstance(x, Literal) and x in lanes)
  tails = []
  for x in eqn.invars:
    if isinstance(x, Literal):
      tails.append((Tail(const=np.asarray(x.val)),) * 2)
    elif x.aval.shape == () or _broadcast_along(x, first.axis, shape):
      tails.append((UNKNOWN, UNKNOWN))
    elif not _stretches_to(x.aval.shape, shape, first.axis):
      return None
    elif x in lanes:
      if (lanes[x].axis, lanes[x].width) != (first.axis, first.width):
        return None
      tails.append((lanes[x].tail, lanes[x].head))
    else:
      tails.append((_known(x, first, scope, first.width, first.padded),
                    _known(x, first, scope, 0, first.width)))
  tail = _combine(eqn, [t for t, _ in tails])
  if eqn.primitive.name == "sub" and _minus_row_max(eqn, lanes, scope.producer):
    tail = Tail(const=np.asarray(-np.inf, eqn.outvars[0].aval.dtype), nan_rows=True)
  return dataclasses.replace(first, tail=tail, head=_combine(eqn, [h for _, h in tails]))


def _stretches_to(own: tuple[int, ...], shape: tuple[int, ...], axis: int) -> bool:
  """Whether an operand of shape `own` is whole along `axis` and broadcast (size 1) at
  most along other dimensions of `shape`: a per-row statistic against a block."""
  return len(own) == len(shape) and own[axis] == shape[axis] and all(
      a in (1, b) for a, b in zip(own, shape))


def _broadcast_along(x: Any, axis: int, shape: tuple[int, ...]) -> bool:
  """Whether operand `x` of an elementwise op of `shape` is broadcast along `axis` (its
  size-1 dimensions stretch, as JAX's binary ops allow)."""
  own = x.aval.shape
  return len(own) == len(shape) and own[axis] == 1 != shape[axis] and all(
      a in (1, b) for a, b in zip(own, shape))


def _minus_row_max(eqn: Any, lanes: dict, producer: dict) -> bool:
  """Whether `eqn` is `x - max(x)` over the padded axis, x padded with -inf: the max
  itself (a scalar of a 1-D x), or broadcast back along the axis (keepdims or not)."""
  x, m = eqn.invars
  if isinstance(x, Literal) or isinstance(m, Literal) or x not in lanes:
    return False
  ln = lanes[x]
  if not (ln.tail.exact and ln.tail.const == -np.inf):
    return False
  others = tuple(d for d in range(x.aval.ndim) if d != ln.axis)
  kept = tuple(1 if d == ln.axis else n for d, n in enumerate(x.aval.shape))
  if m.aval.shape == x.aval.shape:   # broadcast back along the axis
    step = producer.get(m)
    if step is None or step.primitive.name != "broadcast_in_dim" or \
        isinstance(step.invars[0], Literal):
      return False
    dims, m = step.params["broadcast_dimensions"], step.invars[0]
    if dims == others:
      return _row_max(m, x, ln.axis, producer)
    if dims != tuple(range(x.aval.ndim)):
      return False
  if m.aval.shape == kept and x.aval.ndim > 1:   # keepdims: the axis of size 1
    step = producer.get(m)
    if step is None or isinstance(step.invars[0], Literal) or not (
        step.primitive.name == "reshape" or step.primitive.name == "broadcast_in_dim"
        and step.params["broadcast_dimensions"] == others):
      return False
    m = step.invars[0]
  return _row_max(m, x, ln.axis, producer)


def _row_max(m: Any, x: Any, axis: int, producer: dict) -> bool:
  """Whether `m` is `reduce_max(x)` over `axis` alone."""
  step = producer.get(m)
  return (step is not None and step.primitive.name == "reduce_max" and step.invars[0] is x
          and tuple(step.params["axes"]) == (axis,))


def _known(x: Any, ln: Lanes, scope: _Scope, start: int, stop: int, depth: int = 8) -> Tail:
  """What lanes [start, stop) of a value computed whole hold, where it meets a
  narrowed one: read off a constant, an iota's positions, a broadcast of those,
  elementwise arithmetic on them (at most `depth` equations back: a mask is a few,
  and it may be computed outside the loop that uses it), else unknown."""
  if isinstance(x, Literal):
    return Tail(const=np.asarray(x.val))
  while x in scope.outer and x not in scope.const_of:
    x, scope = scope.outer[x]
  if x in scope.const_of:
    part = np.moveaxis(np.asarray(scope.const_of[x]), ln.axis, 0)[start:stop]
    if part.size and (part == part.flat[0]).all():
      return Tail(const=part.flat[0])
    if part.size and np.issubdtype(part.dtype, np.integer):   # positions: their range
      return Tail(low=int(part.min()), high=int(part.max()))
    return UNKNOWN
  eqn = scope.producer.get(x)
  if eqn is None or depth == 0:
    return UNKNOWN
  if eqn.primitive.name == "iota" and eqn.params["dimension"] == ln.axis:
    return Tail(low=start, high=stop - 1)
  if eqn.primitive.name == "broadcast_in_dim":
    y, dims = eqn.invars[0], eqn.params["broadcast_dimensions"]
    if isinstance(y, Literal):
      return Tail(const=np.asarray(y.val))   # jnp.full's value
    if ln.axis in dims and y.aval.shape[dims.index(ln.axis)] == x.aval.shape[ln.axis]:
      return _known(y, dataclasses.replace(ln, axis=dims.index(ln.axis)), scope, start, stop,
                    depth - 1)
    return UNKNOWN
  if eqn.primitive.name in ELEMENTWISE and len(eqn.outvars) == 1 and all(
      isinstance(y, Literal) or y.aval.shape in ((), x.aval.shape) for y in eqn.invars):
    return _combine(eqn, [Tail(const=np.asarray(y.val)) if isinstance(y, Literal) else
                          UNKNOWN if y.aval.shape == () else
                          _known(y, ln, scope, start, stop, depth - 1)
                          for y in eqn.invars])
  return UNKNOWN


def _combine(eqn: Any, tails: list[Tail]) -> Tail:
  """The tail of an elementwise result from its operands' tails."""
  name = eqn.primitive.name
  if name == "select_n" and tails[0].exact:
    picked = tails[1 + int(tails[0].const)]
    return UNKNOWN if picked.nan_rows else picked   # the row's real lanes may be others
  flagged = any(t.nan_rows for t in tails)
  float_to_float = name == "convert_element_type" and all(
      dtypes.issubdtype(v.aval.dtype, np.floating) for v in (*eqn.invars, *eqn.outvars))
  if flagged and name not in _NAN_PROPAGATING and not float_to_float:
    return UNKNOWN
  if all(t.known for t in tails):
    result = _scalar(eqn, [np.asarray(t.const, v.aval.dtype)
                           for t, v in zip(tails, eqn.invars)])
    return UNKNOWN if result is None else Tail(const=result, nan_rows=flagged)
  if len(tails) != 2 or name not in ("add", "sub", *_COMPARISONS):
    return UNKNOWN
  a, b = tails
  is_int = lambda t: t.known and np.issubdtype(t.const.dtype, np.integer)
  if not (a.low is not None and is_int(b) or b.low is not None and is_int(a)):
    return UNKNOWN
  ends = lambda t: (int(t.const),) * 2 if t.known else (t.low, t.high)
  if name in ("eq", "ne"):   # a range and a constant: equal only if it lies inside
    (lo, hi), (k, _) = sorted((ends(a), ends(b)), key=lambda e: e[0] == e[1])
    return UNKNOWN if lo <= k <= hi else Tail(const=np.bool_(name == "ne"))
  if name in _COMPARISONS:   # the other four are monotone: the ends decide
    found = {bool(_COMPARISONS[name](x, y)) for x in ends(a) for y in ends(b)}
    return Tail(const=np.bool_(found.pop())) if len(found) == 1 else UNKNOWN
  if name == "sub" and b.low is not None:
    return UNKNOWN
  (lo, hi), (k, _) = (ends(a), ends(b)) if a.low is not None else (ends(b), ends(a))
  k = -k if name == "sub" else k
  return Tail(low=lo + k, high=hi + k)


# NumPy's forms of elementwise primitives on scalars. Those in _EXACT round as XLA
# does (IEEE arithmetic, comparisons, conversions); the others only where the
# operand is 0 or not finite, where their result is exact (exp(-inf) = 0).
_EXACT = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "max": np.maximum, "min": np.minimum, "neg": np.negative, "abs": np.abs,
          "sign": np.sign, "floor": np.floor, "ceil": np.ceil, "square": np.square,
          "and": np.bitwise_and, "or": np.bitwise_or, "not": np.invert,   # bitwise on ints
          **_COMPARISONS}
_AT_SPECIAL_VALUES = {"exp": np.exp, "exp2": np.exp2, "expm1": np.expm1, "log": np.log,
                      "log1p": np.log1p, "sqrt": np.sqrt, "tanh": np.tanh,
                      "rsqrt": lambda x: np.divide(1, np.sqrt(x)),
                      "logistic": lambda x: np.divide(1, 1 + np.exp(-x))}


def _scalar(eqn: Any, args: list[np.ndarray]) -> np.ndarray | None:
  """`eqn` on scalar constants, in NumPy (binding JAX's primitive eagerly would
  compile each one on a first call), or None where NumPy's result could differ."""
  name, dtype = eqn.primitive.name, eqn.outvars[0].aval.dtype
  with np.errstate(all="ignore"):
    if name == "convert_element_type":
      return np.asarray(args[0]).astype(dtype)
    if name == "integer_pow":
      return np.asarray(np.power(args[0], eqn.params["y"]), dtype) \
          if eqn.params["y"] in (0, 1, 2) else None
    if name == "div" and not dtypes.issubdtype(dtype, np.inexact):
      return None   # XLA's integer division by zero is not NumPy's
    if name in _EXACT:
      return np.asarray(_EXACT[name](*args)).astype(dtype)
    if name in _AT_SPECIAL_VALUES and (args[0] == 0 or not np.isfinite(args[0])):
      return np.asarray(_AT_SPECIAL_VALUES[name](args[0])).astype(dtype)
  return None


def _reduction(eqn: Any, ln: Lanes) -> Lanes | str | None:
  """Over the padded axis, the tail is dropped where it is the identity."""
  axes = tuple(eqn.params["axes"])
  if ln.axis in axes:
    known = ln.tail.known and ln.tail.const == _IDENTITY[eqn.primitive.name]
    return DROP if known else None
  kept = ln.axis - sum(a < ln.axis for a in axes)
  same = lambda t: UNKNOWN if t.nan_rows else t if (
      eqn.primitive.name != "reduce_sum" or t.known and t.const == 0) else UNKNOWN
  return Lanes(kept, ln.width, ln.padded, same(ln.tail), same(ln.head))


def _slice(eqn: Any, ln: Lanes) -> Lanes | str | None:
  start = eqn.params["start_indices"][ln.axis]
  limit = eqn.params["limit_indices"][ln.axis]
  strides = eqn.params["strides"]
  if strides is not None and strides[ln.axis] != 1:
    return None
  if limit <= ln.width:
    return DROP
  return ln if start == 0 and limit == ln.padded else None


def _dynamic_slice(eqn: Any, lanes: dict) -> Lanes | None:
  """A window along other axes, all lanes kept (a row block of K in a key loop): its
  start along the lanes is clamped to 0, whatever it is."""
  x, *starts = eqn.invars
  ln = _lanes_of(x, lanes)
  if ln is None or any(_lanes_of(s, lanes) is not None for s in starts) or \
      eqn.params["slice_sizes"][ln.axis] != ln.padded:
    return None
  return ln


def _pad(eqn: Any, lanes: dict) -> Lanes | None:
  """Padding along other axes (a ref padded for windows at run-time starts): the new
  positions hold the padding value on every lane, real ones too."""
  x, value = eqn.invars
  ln = _lanes_of(x, lanes)
  if ln is None or not isinstance(value, Literal) or \
      tuple(eqn.params["padding_config"][ln.axis]) != (0, 0, 0):
    return None
  fill = Tail(const=np.asarray(value.val, x.aval.dtype))
  return Lanes(ln.axis, ln.width, ln.padded, _join(ln.tail, fill), _join(ln.head, fill))


def _dot(eqn: Any, lanes: dict) -> Lanes | str | None:
  """Contracted over real lanes only (both tails finite constants, their product 0),
  or narrow along a free dimension of one operand (the result's tail unknown)."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = eqn.invars
  a, b = lanes.get(lhs), lanes.get(rhs)
  if a is not None and b is not None:
    pair = a.axis in lc and b.axis in rc and lc.index(a.axis) == rc.index(b.axis)
    if pair and a.width == b.width and a.tail.exact and b.tail.exact:
      x, y = float(a.tail.const), float(b.tail.const)
      if np.isfinite(x) and np.isfinite(y) and x * y == 0:
        return DROP
    return None
  ln, side = (a, 0) if a is not None else (b, 1)
  contracting, batch = (lc, lb) if side == 0 else (rc, rb)
  if ln.axis in tuple(contracting) + tuple(batch):
    return None
  ndim = (lhs if side == 0 else rhs).aval.ndim
  free = [d for d in range(ndim) if d not in tuple(contracting) + tuple(batch)]
  before = len(lb) + (0 if side == 0 else lhs.aval.ndim - len(lc) - len(lb))
  return Lanes(before + free.index(ln.axis), ln.width, ln.padded, UNKNOWN)


# ------------------------------------------------------------------ rewrite
def _evaluate(jaxpr: Any, consts: Any, args: Any, plan: tuple[dict, dict]
              ) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
  """The body on `args` (narrow where `plan` has their invars narrow), the values in
  `plan` kept narrow: (`read`, `whole`), reading a result as computed or padded back."""
  lanes, actions = plan
  env: dict = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda x: x.val if isinstance(x, Literal) else env[x]

  def whole(x: Any) -> Any:
    if isinstance(x, Literal) or x not in lanes:
      return read(x)
    ln = lanes[x]
    config = [(0, 0, 0)] * x.aval.ndim
    config[ln.axis] = (0, ln.padded - ln.width, 0)
    return lax.pad(env[x], np.asarray(ln.tail.const, x.aval.dtype), config)

  def real(x: Any, ln: Lanes) -> Any:
    """An elementwise operand's real lanes: kept narrow, a scalar, or sliced."""
    if isinstance(x, Literal) or x.aval.shape == () or x in lanes or \
        x.aval.shape[ln.axis] != ln.padded:   # a scalar, or broadcast along the axis
      return read(x)
    return _real_lanes(read(x), ln)

  for k, eqn in enumerate(jaxpr.eqns):
    action = actions.get(k)
    if action == SEED:
      env[eqn.outvars[0]] = read(eqn.invars[0])
      continue
    if action is None:
      env.update(zip(eqn.outvars, internals.bind_equation(eqn, [whole(x) for x in eqn.invars])))
      continue
    if isinstance(action, tuple) and action[0] in ("call", "scan", "while", "cond"):
      env.update(zip(eqn.outvars, _nested_results(eqn, action, lanes, read, real)))
      continue
    name, params = eqn.primitive.name, dict(eqn.params)
    ln = next(lanes[x] for x in eqn.invars if not isinstance(x, Literal) and x in lanes)
    out_ln = lanes.get(eqn.outvars[0])
    if name in ELEMENTWISE:
      if isinstance(action, tuple) and action[0] == "fill":
        env[eqn.outvars[0]] = lax.full(_narrowed(eqn.outvars[0].aval.shape, out_ln),
                                       action[1], eqn.outvars[0].aval.dtype)
        continue
      if isinstance(action, tuple):   # a select whose mask holds alike on real lanes
        env[eqn.outvars[0]] = real(eqn.invars[action[1]], ln)
        continue
      ins = [real(x, ln) for x in eqn.invars]
    else:
      ins = [read(x) for x in eqn.invars]
    if name == "broadcast_in_dim":
      params["shape"] = _narrowed(params["shape"], out_ln)
    elif name == "slice" and action == NARROW:
      params["limit_indices"] = _narrowed(params["limit_indices"], out_ln)
    elif name == "dynamic_slice":
      params["slice_sizes"] = _narrowed(params["slice_sizes"], out_ln)
    env[eqn.outvars[0]] = eqn.primitive.bind(*ins, **params)
  return read, whole


def _nested_results(eqn: Any, action: tuple, lanes: dict, read: Callable,
                    real: Callable) -> list[Any]:
  """A call (inlined), scan or while loop (its bodies traced again) on narrowed
  operands, its results narrow as `action` planned them."""
  if action[0] == "call":   # narrowed values are stored narrow
    _, plan, jaxpr, consts = action
    inner_read, _ = _evaluate(jaxpr, consts, [read(x) for x in eqn.invars], plan)
    return [inner_read(x) for x in jaxpr.outvars]
  p = eqn.params
  if action[0] == "cond":
    _, plans, out = action
    branches = tuple(_traced(b.jaxpr, b.consts, plan, out, closed=True)
                     for b, plan in zip(p["branches"], plans))
    return internals.bind_equation(eqn, [read(x) for x in eqn.invars],
                                   {**p, "branches": branches})
  if action[0] == "scan":
    _, plan, carry = action
    body, consts, first, n = internals.scan_layout(p)
    key, cond_key = "jaxpr", None
  else:
    _, plan, cond_plan, carry = action
    body, consts = p["body_jaxpr"].jaxpr, p["body_jaxpr"].consts
    first, n, key, cond_key = p["body_nconsts"], len(carry), "body_jaxpr", "cond_jaxpr"
  ops = eqn.invars
  start = len(ops) - len(body.invars) + first   # the first carry among the operands
  planned = [None] * start + carry + [None] * (len(ops) - start - n)
  # narrowed operands are narrow already; a whole initial value of a narrow carry is sliced
  args = [real(x, ln) if ln is not None and _lanes_of(x, lanes) is None else read(x)
          for x, ln in zip(ops, planned)]

  params = {**p, key: _traced(body, consts, plan, carry, closed=hasattr(p[key], "jaxpr"))}
  if cond_key is not None:
    cond = p[cond_key]
    params[cond_key] = _traced(cond.jaxpr, cond.consts, cond_plan, [], closed=True)
  return internals.bind_equation(eqn, args, params)


def _traced(jaxpr: Any, consts: Any, plan: tuple[dict, dict], keep: list, closed: bool) -> Any:
  """A nested jaxpr traced again on its narrowed invars; its leading results narrow as
  `keep` says (None: whole), a whole one sliced where `keep` wants it narrow."""
  avals = [v.aval.update(shape=_narrowed(v.aval.shape, plan[0][v])) if v in plan[0]
           else v.aval for v in jaxpr.invars]

  def run(*args):
    inner_read, inner_whole = _evaluate(jaxpr, consts, args, plan)
    return [inner_whole(x) if ln is None else
            inner_read(x) if _lanes_of(x, plan[0]) is not None else
            _real_lanes(inner_read(x), ln)
            for x, ln in zip(jaxpr.outvars, keep + [None] * (len(jaxpr.outvars) - len(keep)))]
  new = internals.trace_jaxpr(run, avals, "padded lanes")
  return new if closed else new.jaxpr


def _real_lanes(value: Any, ln: Lanes) -> Any:
  """`value`'s first `ln.width` lanes along `ln.axis` (a constant stays one)."""
  if not internals.is_tracer(value):
    return np.take(np.asarray(value), np.arange(ln.width), axis=ln.axis)
  return lax.slice_in_dim(value, 0, ln.width, axis=ln.axis)


def _narrowed(shape: Any, ln: Lanes) -> tuple[int, ...]:
  shape = list(shape)
  shape[ln.axis] = ln.width
  return tuple(shape)

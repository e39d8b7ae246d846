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
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax import dtypes, lax
from jax.extend.core import ClosedJaxpr, Literal

from pallet import _internals as internals
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


def narrow(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` computing on real lanes only where its padded lanes cannot be
  observed (itself where no lane can be dropped)."""
  jaxpr = closed.jaxpr
  if not any(_seed(e) for e in jaxpr.eqns):
    return closed
  plan = _plan(jaxpr, closed.consts)
  if plan is None:
    return closed
  avals = [v.aval for v in jaxpr.invars]
  return internals.trace_jaxpr(
      lambda *args: _evaluate(jaxpr, closed.consts, args, plan), avals, "padded lanes")


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
SEED, NARROW, DROP = "seed", "narrow", "drop"   # actions; anything else is read whole


def _plan(jaxpr: Any, consts: Any) -> tuple[dict, dict] | None:
  """({var: Lanes} of the values kept narrow, {equation index: action}), or None
  when the body stays as it is (a narrowed value with an unknown tail would be
  read whole, or no equation drops padded lanes)."""
  const_of = dict(zip(jaxpr.constvars, consts))
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  lanes: dict = {}
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
    out = _rule(eqn, lanes, const_of, producer)
    if out is None:     # read whole: padded back with its constant tail
      if not all(paddable(x) for x in ins):
        return None
      continue
    if out == DROP:
      actions[k] = DROP
    else:
      lanes[eqn.outvars[0]] = out
      actions[k] = _shortcut(eqn, out, lanes, const_of, producer) or NARROW
  if DROP not in actions.values() or not all(paddable(x) for x in jaxpr.outvars):
    return None
  return lanes, actions


def _rule(eqn: Any, lanes: dict, const_of: dict, producer: dict) -> Lanes | str | None:
  """The result of `eqn` on narrowed operands: narrow (its Lanes), whole from real
  lanes only (DROP), or None where the operands must be read whole."""
  name, ins = eqn.primitive.name, eqn.invars
  if len(eqn.outvars) != 1:
    return None
  if name in ELEMENTWISE:
    return _elementwise(eqn, lanes, const_of, producer)
  if name == "dot_general":
    return _dot(eqn, lanes)
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


def _shortcut(eqn: Any, out: Lanes, lanes: dict, const_of: dict,
              producer: dict) -> tuple[str, Any] | None:
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
            _known(pred, out, const_of, producer, 0, out.width))
    picked = eqn.invars[1 + int(head.const)] if head.known else None
    if picked is not None and not isinstance(picked, Literal) and \
        picked.aval.shape == eqn.outvars[0].aval.shape:
      return ("pick", 1 + int(head.const))
  return None


def _elementwise(eqn: Any, lanes: dict, const_of: dict, producer: dict) -> Lanes | None:
  shape = eqn.outvars[0].aval.shape
  first = next(lanes[x] for x in eqn.invars if not isinstance(x, Literal) and x in lanes)
  tails = []
  for x in eqn.invars:
    if isinstance(x, Literal):
      tails.append((Tail(const=np.asarray(x.val)),) * 2)
    elif x.aval.shape == () or _broadcast_along(x, first.axis, shape):
      tails.append((UNKNOWN, UNKNOWN))
    elif x.aval.shape != shape:
      return None
    elif x in lanes:
      if (lanes[x].axis, lanes[x].width) != (first.axis, first.width):
        return None
      tails.append((lanes[x].tail, lanes[x].head))
    else:
      tails.append((_known(x, first, const_of, producer, first.width, first.padded),
                    _known(x, first, const_of, producer, 0, first.width)))
  tail = _combine(eqn, [t for t, _ in tails])
  if eqn.primitive.name == "sub" and _minus_row_max(eqn, lanes, producer):
    tail = Tail(const=np.asarray(-np.inf, eqn.outvars[0].aval.dtype), nan_rows=True)
  return dataclasses.replace(first, tail=tail, head=_combine(eqn, [h for _, h in tails]))


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


def _known(x: Any, ln: Lanes, const_of: dict, producer: dict, start: int, stop: int,
           depth: int = 8) -> Tail:
  """What lanes [start, stop) of a value computed whole hold, where it meets a
  narrowed one: read off a constant, an iota's positions, elementwise arithmetic on
  those (at most `depth` equations back: a mask is a few), else unknown."""
  if x in const_of:
    part = np.moveaxis(np.asarray(const_of[x]), ln.axis, 0)[start:stop]
    return Tail(const=part.flat[0]) if part.size and (part == part.flat[0]).all() else UNKNOWN
  eqn = producer.get(x)
  if eqn is None or depth == 0:
    return UNKNOWN
  if eqn.primitive.name == "iota" and eqn.params["dimension"] == ln.axis:
    return Tail(low=start, high=stop - 1)
  if eqn.primitive.name == "broadcast_in_dim" and isinstance(eqn.invars[0], Literal):
    return Tail(const=np.asarray(eqn.invars[0].val))   # jnp.full's value
  if eqn.primitive.name in ELEMENTWISE and len(eqn.outvars) == 1 and all(
      isinstance(y, Literal) or y.aval.shape in ((), x.aval.shape) for y in eqn.invars):
    return _combine(eqn, [Tail(const=np.asarray(y.val)) if isinstance(y, Literal) else
                          UNKNOWN if y.aval.shape == () else
                          _known(y, ln, const_of, producer, start, stop, depth - 1)
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
def _evaluate(jaxpr: Any, consts: Any, args: Any, plan: tuple[dict, dict]) -> list[Any]:
  """The body on `args`, the values in `plan` kept narrow."""
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
    value = read(x)
    if not internals.is_tracer(value):   # a constant stays one
      return np.take(np.asarray(value), np.arange(ln.width), axis=ln.axis)
    return lax.slice_in_dim(value, 0, ln.width, axis=ln.axis)

  for k, eqn in enumerate(jaxpr.eqns):
    action = actions.get(k)
    if action == SEED:
      env[eqn.outvars[0]] = read(eqn.invars[0])
      continue
    if action is None:
      outs = eqn.primitive.bind(*[whole(x) for x in eqn.invars], **eqn.params)
      env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
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
    env[eqn.outvars[0]] = eqn.primitive.bind(*ins, **params)
  return [whole(x) for x in jaxpr.outvars]


def _narrowed(shape: Any, ln: Lanes) -> tuple[int, ...]:
  shape = list(shape)
  shape[ln.axis] = ln.width
  return tuple(shape)

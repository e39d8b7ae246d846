"""Windows a loop keeps inside their ref, read without the padding around them.

A masked load at a start known only at run time, `plgpu.load(k_ref.at[pl.ds(j * bk,
bk)], mask=...)` in a `fori_loop` (JAX's GPU attention kernels), is discharged as a
read of the ref padded by the window on both sides, at the start shifted by the
window, and a select that zeroes the positions outside the ref (`_window_place` in
core/primitives.py): a start past either end is never clamped onto other elements.
Inside a loop that is a pad of the whole ref at every step (XLA:CPU hoists it out of a
while loop: a copy of the block per call, 5-8% of JAX's GPU attention kernels on the
CPU) and a select per element.

`drop_window_padding` proves with integer ranges that such a start stays inside the
ref. Ranges come from constants, grid indices (0 to the axis size - 1), loop counters
(a scan's carry that grows by a constant per step: `length` steps; a while loop's
carry that grows by a constant while it is below a bound) and the integer arithmetic
between them. A dynamic slice of a pad that provably reads only the unpadded operand
reads the operand itself, at the start less the padding (neither start is clamped,
so the values are the same); a select whose predicate is then decided everywhere
(every position inside the ref) is the operand it picks.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from jax import dtypes, lax
from jax.extend.core import ClosedJaxpr, Literal

from pallet import _internals as internals

Range = tuple[int, int] | None   # inclusive bounds of an integer or boolean value

_CALL_PARAMS = ("call_jaxpr", "jaxpr")   # eval_jaxpr, closed_call; pjit and jit


def drop_window_padding(closed: ClosedJaxpr, input_ranges: Sequence[Range]) -> ClosedJaxpr:
  """`closed` with in-bounds window reads taken from the unpadded ref (itself where
  no window is proven inside). `input_ranges[i]` bounds input i (None: unknown)."""
  if not _has_window(closed.jaxpr):
    return closed
  rewriter = _Rewriter()
  ranges = list(input_ranges) + [None] * (len(closed.jaxpr.invars) - len(input_ranges))
  new = internals.trace_jaxpr(
      lambda *args: rewriter.run(closed.jaxpr, closed.consts, args, ranges),
      [v.aval for v in closed.jaxpr.invars], "window ranges")
  return new if rewriter.changed else closed


# ------------------------------------------------------------------ which jaxprs
def _nested(eqn: Any) -> list[Any]:
  """The open jaxprs a loop or call runs (none for a cond: conds are left as they
  are)."""
  name = eqn.primitive.name
  keys = {"scan": ("jaxpr",), "while": ("body_jaxpr",)}.get(name, _CALL_PARAMS)
  found = [eqn.params.get(k) for k in keys if k in eqn.params]
  return [getattr(j, "jaxpr", j) for j in found if hasattr(getattr(j, "jaxpr", j), "eqns")]


def _has_window(jaxpr: Any) -> bool:
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dynamic_slice" and _padding(eqn.invars[0], producer):
      return True
    if any(_has_window(j) for j in _nested(eqn)):
      return True
  return False


def _padding(x: Any, producer: dict) -> Any:
  """The `pad` equation that made `x`: low and high padding only, a literal value."""
  eqn = None if isinstance(x, Literal) else producer.get(x)
  if eqn is None or eqn.primitive.name != "pad" or not isinstance(eqn.invars[1], Literal):
    return None
  config = eqn.params["padding_config"]
  if any(inner != 0 or lo < 0 or hi < 0 for lo, hi, inner in config) or all(
      (lo, hi) == (0, 0) for lo, hi, _ in config):
    return None
  return eqn


# ------------------------------------------------------------------ ranges
def _integral(aval: Any) -> bool:
  dtype = getattr(aval, "dtype", None)
  return dtype is not None and (dtype == np.bool_ or dtypes.issubdtype(dtype, np.integer))


def _fit(lo: int, hi: int, aval: Any) -> Range:
  """(lo, hi) where the dtype holds every value between them (no wrap-around)."""
  if aval.dtype == np.bool_:
    return (lo, hi) if 0 <= lo <= hi <= 1 else None
  info = np.iinfo(aval.dtype)
  return (lo, hi) if info.min <= lo <= hi <= info.max else None


def _of_array(value: Any, aval: Any) -> Range:
  if not _integral(aval):
    return None
  array = np.asarray(value)
  return (int(array.min()), int(array.max())) if array.size else None


def _join(ranges: Sequence[Range]) -> Range:
  if any(r is None for r in ranges):
    return None
  return min(r[0] for r in ranges), max(r[1] for r in ranges)


def _compare(name: str, a: tuple[int, int], b: tuple[int, int]) -> Range:
  (a0, a1), (b0, b1) = a, b
  if name in ("gt", "ge"):
    name, (a0, a1), (b0, b1) = {"gt": "lt", "ge": "le"}[name], (b0, b1), (a0, a1)
  if name == "lt":
    return (1, 1) if a1 < b0 else (0, 0) if a0 >= b1 else (0, 1)
  if name == "le":
    return (1, 1) if a1 <= b0 else (0, 0) if a0 > b1 else (0, 1)
  equal = (1, 1) if a0 == a1 == b0 == b1 else (0, 0) if a1 < b0 or b1 < a0 else (0, 1)
  return equal if name == "eq" else (1 - equal[1], 1 - equal[0])


_SAME_VALUES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                          "transpose", "slice", "dynamic_slice", "copy", "copy_p",
                          "reduce_max", "reduce_min"})


def _range(eqn: Any, ins: list[Range]) -> Range:
  """The range of `eqn`'s single result from its operands' ranges."""
  name, out = eqn.primitive.name, eqn.outvars[0].aval
  if not _integral(out):
    return None
  if name == "iota":
    return (0, eqn.params["shape"][eqn.params["dimension"]] - 1)
  if name == "select_n":
    which, cases = ins[0], ins[1:]
    if which is not None and which[0] == which[1] and which[0] < len(cases):
      return cases[which[0]]
    return _join(cases)
  if any(r is None for r in ins) or not ins:
    return None
  a = ins[0]
  if name in _SAME_VALUES:
    return a
  if name == "convert_element_type":
    if out.dtype == np.bool_:
      return (0, 0) if a == (0, 0) else (1, 1) if a[0] > 0 or a[1] < 0 else (0, 1)
    return _fit(*a, out)
  if name == "neg":
    return _fit(-a[1], -a[0], out)
  if name == "not" and out.dtype == np.bool_:
    return (1 - a[1], 1 - a[0])
  if name == "clamp":   # clamp(low, x, high)
    (l0, l1), (x0, x1), (h0, h1) = ins
    return _fit(min(max(x0, l0), h0), min(max(x1, l1), h1), out)
  if len(ins) != 2:
    return None
  b = ins[1]
  if name in ("lt", "le", "gt", "ge", "eq", "ne"):
    return _compare(name, a, b)
  if name in ("and", "or") and out.dtype == np.bool_:
    pick = min if name == "and" else max
    return (pick(a[0], b[0]), pick(a[1], b[1]))
  if name == "add":
    return _fit(a[0] + b[0], a[1] + b[1], out)
  if name == "sub":
    return _fit(a[0] - b[1], a[1] - b[0], out)
  if name == "mul":
    corners = [x * y for x in a for y in b]
    return _fit(min(corners), max(corners), out)
  if name in ("max", "min"):
    pick = max if name == "max" else min
    return (pick(a[0], b[0]), pick(a[1], b[1]))
  if name == "div" and a[0] >= 0 and b[0] == b[1] > 0:   # truncation = floor here
    return (a[0] // b[0], a[1] // b[0])
  if name == "rem" and a[0] >= 0 and b[0] == b[1] > 0:
    return a if a[1] < b[0] else (0, b[0] - 1)
  return None


def _results(eqn: Any, ins: list[Range]) -> list[Range]:
  """The ranges of `eqn`'s results: a primitive's by `_range`, a call's (jnp's jitted
  helpers) from its body's equations; loops and conds are not followed (unknown)."""
  if eqn.primitive.name in ("scan", "while") or not _nested(eqn):
    return [_range(eqn, ins)] if len(eqn.outvars) == 1 else [None] * len(eqn.outvars)
  call = next(eqn.params[k] for k in _CALL_PARAMS if k in eqn.params)
  jaxpr, consts = getattr(call, "jaxpr", call), getattr(call, "consts", ())
  ranges: dict = {v: _of_array(c, v.aval) for v, c in zip(jaxpr.constvars, consts)}
  ranges.update(zip(jaxpr.invars, ins))
  rng = lambda x: _of_array(x.val, x.aval) if isinstance(x, Literal) else ranges.get(x)
  for inner in jaxpr.eqns:
    ranges.update(zip(inner.outvars, _results(inner, [rng(x) for x in inner.invars])))
  return [rng(x) for x in jaxpr.outvars]


# ------------------------------------------------------------------ loop counters
def _offsets(jaxpr: Any) -> list[tuple[int, int] | None]:
  """For each result of `jaxpr`: (i, c) where it is input i plus the constant c."""
  sym: dict = {v: (i, 0) for i, v in enumerate(jaxpr.invars)}
  for eqn in jaxpr.eqns:
    name, ins = eqn.primitive.name, eqn.invars
    if name in ("add", "sub") and len(ins) == 2:
      x, k = (ins[1], ins[0]) if name == "add" and isinstance(ins[0], Literal) else ins
      if not isinstance(x, Literal) and x in sym and isinstance(k, Literal) and \
          np.ndim(k.val) == 0 and _integral(x.aval) and x.aval == eqn.outvars[0].aval:
        i, c = sym[x]
        sym[eqn.outvars[0]] = (i, c + int(k.val) * (1 if name == "add" else -1))
    elif _nested(eqn) and name not in ("scan", "while") and not eqn.effects:
      inner = _offsets(_nested(eqn)[0])
      for v, off in zip(eqn.outvars, inner):
        x = None if off is None else ins[off[0]]
        if x is not None and not isinstance(x, Literal) and x in sym:
          sym[v] = (sym[x][0], sym[x][1] + off[1])
  return [None if isinstance(v, Literal) else sym.get(v) for v in jaxpr.outvars]


def _scan_ranges(eqn: Any, ranges: list[Range]) -> list[Range]:
  """The ranges of a scan body's inputs: its constants', its counters' over
  `length` steps, its invariant carries', and the scanned elements'."""
  body, _, n_consts, n_carry = internals.scan_layout(eqn.params)
  steps = eqn.params["length"]
  carried = []
  for k, off in enumerate(_offsets(body)[:n_carry]):
    init, aval = ranges[n_consts + k], body.invars[n_consts + k].aval
    if init is None or off is None or off[0] != n_consts + k or steps < 1:
      carried.append(None)
      continue
    total = off[1] * (steps - 1)
    carried.append(_fit(init[0] + min(total, 0), init[1] + max(total, 0), aval))
  return ranges[:n_consts] + carried + ranges[n_consts + n_carry:]


def _while_ranges(eqn: Any, ranges: list[Range]) -> list[Range]:
  """The ranges of a while body's inputs: its constants', its invariant carries',
  and those of a carry that grows by c > 0 while the condition `carry < bound` (or
  `<=`) holds: from its initial value to the bound's largest value less one."""
  params = eqn.params
  n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
  body, cond = params["body_jaxpr"].jaxpr, params["cond_jaxpr"].jaxpr
  consts, inits = ranges[n_cond:n_cond + n_body], ranges[n_cond + n_body:]
  offsets = _offsets(body)
  invariant = [off == (n_body + k, 0) for k, off in enumerate(offsets)]
  carried = [init if keep else None for init, keep in zip(inits, invariant)]
  bound = _loop_bound(cond, n_cond, ranges[:n_cond], carried)
  if bound is not None:
    k, limit = bound
    off, init, aval = offsets[k], inits[k], body.invars[n_body + k].aval
    if init is not None and off is not None and off[0] == n_body + k and off[1] > 0 and \
        _fit(limit + off[1], limit + off[1], aval) is not None:
      carried[k] = _fit(init[0], max(init[0], limit), aval)
  return consts + carried


def _loop_bound(cond: Any, n_consts: int, const_ranges: list[Range],
                carried: list[Range]) -> tuple[int, int] | None:
  """(k, m): the loop runs only while carry k <= m, read off a condition that is
  `carry < bound` or `carry <= bound` (a constant, or a carry that stays the same)."""
  if len(cond.outvars) != 1 or isinstance(cond.outvars[0], Literal):
    return None
  eqn = next((e for e in cond.eqns if cond.outvars[0] in e.outvars), None)
  if eqn is None or eqn.primitive.name not in ("lt", "le", "gt", "ge"):
    return None
  x, y = eqn.invars if eqn.primitive.name in ("lt", "le") else eqn.invars[::-1]
  position = {v: i for i, v in enumerate(cond.invars)}
  if isinstance(x, Literal) or position.get(x, -1) < n_consts:
    return None
  if isinstance(y, Literal):
    limit = (int(y.val), int(y.val))
  else:
    j = position.get(y)
    limit = None if j is None else (const_ranges + carried)[j]
  if limit is None:
    return None
  strict = eqn.primitive.name in ("lt", "gt")
  return position[x] - n_consts, limit[1] - int(strict)


# ------------------------------------------------------------------ rewrite
class _Rewriter:
  """Evaluates a jaxpr (under a trace), reading windows from unpadded refs where
  their ranges allow, and rewriting the bodies of loops that hold such windows.
  `changed` says whether a window was rewritten (decided selects alone are left to
  XLA: the body is then kept as it was)."""

  def __init__(self):
    self.changed = False

  def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
          in_ranges: list[Range]) -> list[Any]:
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    ranges: dict = {v: _of_array(c, v.aval) for v, c in zip(jaxpr.constvars, consts)}
    ranges.update(zip(jaxpr.invars, in_ranges))
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    read = lambda x: x.val if isinstance(x, Literal) else env[x]
    rng = lambda x: (_of_array(x.val, x.aval) if isinstance(x, Literal) else ranges.get(x))
    for eqn in jaxpr.eqns:
      ins = [rng(x) for x in eqn.invars]
      outs = self._equation(eqn, [read(x) for x in eqn.invars], ins, producer, env)
      env.update(zip(eqn.outvars, outs))
      ranges.update(zip(eqn.outvars, _results(eqn, ins)))
    return [read(x) for x in jaxpr.outvars]

  def _equation(self, eqn: Any, args: list, ins: list[Range], producer: dict,
                env: dict) -> list[Any]:
    name = eqn.primitive.name
    if name == "select_n" and ins[0] is not None and ins[0][0] == ins[0][1]:
      case = eqn.invars[1 + ins[0][0]] if ins[0][0] < len(eqn.invars) - 1 else None
      if case is not None and not isinstance(case, Literal) and \
          case.aval == eqn.outvars[0].aval:
        return [args[1 + ins[0][0]]]
    if name == "dynamic_slice":
      window = self._inside(eqn, args, ins, producer, env)
      if window is not None:
        return [window]
    if name in ("scan", "while") and _has_window(_nested(eqn)[0]):
      return self._loop(eqn, args, ins)
    nested = _nested(eqn)
    if nested and not eqn.effects and _has_window(nested[0]):
      call = next(eqn.params[k] for k in _CALL_PARAMS if k in eqn.params)
      return self.run(getattr(call, "jaxpr", call), getattr(call, "consts", ()), args, ins)
    return internals.bind_equation(eqn, args)

  def _inside(self, eqn: Any, args: list, ins: list[Range], producer: dict,
              env: dict) -> Any:
    """The window read from the pad's operand, where every padded dimension's start
    keeps it inside that operand; else None."""
    pad = _padding(eqn.invars[0], producer)
    if pad is None:
      return None
    source = pad.invars[0]
    starts = []
    for d, ((lo, hi, _), size) in enumerate(zip(pad.params["padding_config"],
                                                eqn.params["slice_sizes"])):
      start, known = args[1 + d], ins[1 + d]
      if (lo, hi) == (0, 0):
        starts.append(start)
        continue
      if known is None or known[0] < lo or known[1] + size > lo + source.aval.shape[d]:
        return None
      starts.append(lax.sub(start, np.asarray(lo, eqn.invars[1 + d].aval.dtype)))
    self.changed = True
    value = source.val if isinstance(source, Literal) else env[source]
    return internals.bind_equation(eqn, [value, *starts])[0]

  def _loop(self, eqn: Any, args: list, ins: list[Range]) -> list[Any]:
    if eqn.primitive.name == "scan":
      key, inner = "jaxpr", _scan_ranges(eqn, ins)
    else:
      key, inner = "body_jaxpr", _while_ranges(eqn, ins)
    body = eqn.params[key]
    jaxpr, consts = getattr(body, "jaxpr", body), getattr(body, "consts", ())
    new = internals.trace_jaxpr(lambda *a: self.run(jaxpr, consts, a, inner),
                                [v.aval for v in jaxpr.invars], "window ranges")
    if not hasattr(body, "jaxpr"):
      new = new.jaxpr
    return internals.bind_equation(eqn, args, {**eqn.params, key: new})


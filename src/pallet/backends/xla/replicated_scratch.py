"""Scratch buffers that hold one value per row, carried one element wide.

TPU kernels keep per-row statistics lane-wide: JAX's flash and splash attention
store the running max and sum of the online softmax in `(block_q, 128)` scratch
buffers whose 128 lanes all hold the same number, because a TPU vector register is
128 lanes wide. On the CPU every lane is real work: each grid step rescales,
exponentiates, selects and copies 128 copies of every row's statistics, which in
splash attention cost about a quarter of the kernel's time.

`constant_axes` is an abstract interpretation of a jaxpr: for every value, the axes
along which it is provably the same at every position (a broadcast makes them, an
elementwise op or a reduction over other axes keeps them, anything unknown loses
them). `narrowable_scratch` finds, as a greatest fixed point over one grid step, the
axes along which every scratch buffer stays constant from one step to the next:
scratch starts as zeros, so by induction it is constant along those axes at every
step. The executor then carries such a buffer with size 1 along them, broadcasts it
as the step begins and keeps one slice of it as the step ends; XLA narrows the
arithmetic in between (a broadcast feeding elementwise ops, sliced at the end).
The kernel computes exactly what it did: only copies of equal values are dropped.
"""
from __future__ import annotations

from typing import Any, Sequence

from jax import dtypes, lax
from jax.extend.core import Literal

from pallet import _internals as internals
from pallet.backends.xla import literal_folding
from pallet.backends.xla.widening import ELEMENTWISE, REDUCTIONS

Axes = frozenset

# Primitives that call one jaxpr on exactly their operands.
_CALLS = frozenset(("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint",
                    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
                    "eval_jaxpr"))


def constant_axes(jaxpr: Any, in_axes: Sequence[Axes], memo: dict | None = None) -> list[Axes]:
  """For each output of the open `jaxpr`, the axes (of size > 1) along which it is
  constant, given those of its inputs; its constants count as varying everywhere.
  `memo` keeps the results of nested jaxprs (loops are analysed to a fixed point)."""
  memo = {} if memo is None else memo
  key = (id(jaxpr), tuple(in_axes))
  if key in memo:
    return memo[key]
  env: dict = {v: Axes() for v in jaxpr.constvars}
  env.update((v, _sized(a, v.aval)) for v, a in zip(jaxpr.invars, in_axes))
  read = lambda v: Axes() if isinstance(v, Literal) else env.get(v, Axes())
  for eqn in jaxpr.eqns:
    outs = _rule(eqn, [read(v) for v in eqn.invars], memo)
    env.update((v, _sized(a, v.aval)) for v, a in zip(eqn.outvars, outs))
  memo[key] = result = [read(v) for v in jaxpr.outvars]
  return result


def narrowable_scratch(pure: Any, n_scratch: int) -> list[Axes]:
  """Per scratch buffer, the axes along which it stays constant across grid steps.

  `pure` is the discharged body: its last `n_scratch` inputs and outputs are the
  scratch buffers before and after one grid step; every other input is arbitrary.
  """
  if not n_scratch:
    return []
  jaxpr = pure.jaxpr
  ins = jaxpr.invars
  others = [Axes()] * (len(ins) - n_scratch)
  # typed keys and semaphores are left whole: broadcasting them is not plain arithmetic
  guess = [Axes() if dtypes.issubdtype(v.aval.dtype, dtypes.extended)
           else _sized(Axes(range(v.aval.ndim)), v.aval) for v in ins[len(ins) - n_scratch:]]
  memo: dict = {}
  while any(guess):
    after = constant_axes(jaxpr, others + guess, memo)[len(jaxpr.outvars) - n_scratch:]
    kept = [g & a for g, a in zip(guess, after)]
    if kept == guess:
      break
    guess = kept
  return guess


class Wide:
  """A value constant along `axes`, held in its narrow form (size 1 along them) until
  an equation needs it whole: conds take it narrow, so each branch can stay narrow."""

  def __init__(self, narrow: Any, axes: Axes, shape: Sequence[int]):
    self.narrow, self.axes, self.shape = narrow, axes, tuple(shape)

  def whole(self) -> Any:
    return lax.broadcast_in_dim(self.narrow, self.shape, tuple(range(len(self.shape))))


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  """`jaxpr` on `args`, some of them `Wide`, as `literal_folding.evaluate` runs it;
  results constant along axes (per `constant_axes`) may come back `Wide`."""
  env: dict = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, Literal) else env[v]
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    if eqn.primitive.name == "cond" and any(isinstance(x, Wide) for x in ins[1:]):
      outs = _cond(eqn, ins)
    else:
      outs = literal_folding.evaluate_equation(eqn, [whole(x) for x in ins])
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def whole(x: Any) -> Any:
  return x.whole() if isinstance(x, Wide) else x


def narrow(x: Any, axes: Axes) -> Any:
  """One slice of `x` along each of `axes` (the values there are all equal)."""
  if isinstance(x, Wide) and x.axes == axes:
    return x.narrow
  x = whole(x)
  if not axes:
    return x
  return lax.slice(x, (0,) * x.ndim, narrow_shape(x.shape, axes))


def narrow_shape(shape: Sequence[int], axes: Axes) -> tuple[int, ...]:
  return tuple(1 if a in axes else n for a, n in enumerate(shape))


def _cond(eqn: Any, ins: list[Any]) -> list[Any]:
  """A cond whose operands include `Wide` values: they enter every branch narrow, and
  the results every branch keeps constant along some axes leave it narrow."""
  branches = eqn.params["branches"]
  index, ops = ins[0], ins[1:]
  branch = literal_folding.known_branch(eqn, index)
  if branch is not None:
    return evaluate(branch.jaxpr, branch.consts, ops)
  in_axes = [x.axes if isinstance(x, Wide) else Axes() for x in ops]
  per_branch = [constant_axes(b.jaxpr, in_axes) for b in branches]
  out_axes = [Axes.intersection(*axes) for axes in zip(*per_branch)]

  def run(branch):
    def f(*narrow_ops):
      vals = [Wide(n, x.axes, x.shape) if isinstance(x, Wide) else n
              for n, x in zip(narrow_ops, ops)]
      return [narrow(y, a) for y, a in zip(evaluate(branch.jaxpr, branch.consts, vals), out_axes)]
    return f
  with internals.equation_context(eqn):
    results = lax.switch(index, [run(b) for b in branches],
                         *[x.narrow if isinstance(x, Wide) else x for x in ops])
  return [Wide(r, a, v.aval.shape) if a else r
          for r, a, v in zip(results, out_axes, eqn.outvars)]


# ------------------------------------------------------------------ the rules
def _sized(axes: Axes, aval: Any) -> Axes:
  shape = getattr(aval, "shape", ())
  return Axes(a for a in axes if 0 <= a < len(shape) and shape[a] > 1)


def _ndim(v: Any) -> int:
  return len(getattr(v.aval, "shape", ()))


def _rule(eqn: Any, ins: list[Axes], memo: dict) -> list[Axes]:
  """The constant axes of `eqn`'s outputs; none where the primitive is unknown."""
  name, params, invars = eqn.primitive.name, eqn.params, eqn.invars
  nothing = [Axes()] * len(eqn.outvars)
  if name in ELEMENTWISE:   # operands of size 1 along an axis are broadcast along it
    rank = _ndim(eqn.outvars[0])
    every = Axes(range(rank))
    for a, v in zip(ins, invars):
      if _ndim(v) == rank:
        every &= a | {d for d, n in enumerate(v.aval.shape) if n == 1}
      elif _ndim(v):   # broadcast some other way: not worked out
        return nothing
    return [every] * len(eqn.outvars)
  if name == "broadcast_in_dim":
    dims, shape = params["broadcast_dimensions"], invars[0].aval.shape
    new = set(range(len(params["shape"]))) - set(dims)
    return [Axes(new | {d for i, d in enumerate(dims) if shape[i] == 1 or i in ins[0]})]
  if name == "iota":
    return [Axes(range(len(params["shape"]))) - {params["dimension"]}]
  if name in REDUCTIONS:
    kept = [i for i in range(_ndim(invars[0])) if i not in params["axes"]]
    return [Axes(j for j, i in enumerate(kept) if i in ins[0])]
  if name in ("slice", "dynamic_slice", "rev", "tile"):   # the operand's axes, kept
    return [ins[0]]
  if name == "optimization_barrier":
    return list(ins)
  if name == "squeeze":
    kept = [i for i in range(_ndim(invars[0])) if i not in params["dimensions"]]
    return [Axes(j for j, i in enumerate(kept) if i in ins[0])]
  if name == "transpose":
    return [Axes(j for j, i in enumerate(params["permutation"]) if i in ins[0])]
  if name == "reshape" and params.get("dimensions") is None:
    return [_reshaped(invars[0].aval.shape, eqn.outvars[0].aval.shape, ins[0])]
  if name == "concatenate":
    return [Axes.intersection(*ins) - {params["dimension"]}]
  if name == "pad":
    return [Axes(a for a in ins[0] if tuple(params["padding_config"][a]) == (0, 0, 0))]
  if name == "dynamic_update_slice":
    whole = {a for a, (n, m) in enumerate(zip(invars[0].aval.shape, invars[1].aval.shape))
             if n == m}
    return [ins[0] & ins[1] & Axes(whole)]
  if name == "dot_general":
    return [_dot(eqn, ins[0], ins[1])]
  if name == "cond":
    per_branch = [constant_axes(b.jaxpr, ins[1:], memo) for b in params["branches"]]
    return [Axes.intersection(*outs) for outs in zip(*per_branch)]
  if name == "while":
    return _while(params, ins, memo)
  if name == "scan":
    return _scan(params, ins, len(eqn.outvars), memo)
  if name in _CALLS:
    inner = _called(params, len(invars), len(eqn.outvars))
    return nothing if inner is None else constant_axes(inner, ins, memo)
  return nothing


def _reshaped(before: Sequence[int], after: Sequence[int], axes: Axes) -> Axes:
  """A reshape keeps an axis constant when it maps, alone among axes of size > 1 in
  its group, to one axis of the same size (groups: runs with equal element counts)."""
  out: set = set()
  i = j = 0
  while i < len(before) or j < len(after):
    gi, gj = [i], [j]
    pi = before[i] if i < len(before) else 1
    pj = after[j] if j < len(after) else 1
    i, j = i + 1, j + 1
    while pi != pj:
      if pi < pj and i < len(before):
        pi *= before[i]; gi.append(i); i += 1
      elif j < len(after):
        pj *= after[j]; gj.append(j); j += 1
      else:
        return Axes(out)
    big_i = [a for a in gi if a < len(before) and before[a] > 1]
    big_j = [b for b in gj if b < len(after) and after[b] > 1]
    if len(big_i) == 1 and len(big_j) == 1 and big_i[0] in axes:
      out.add(big_j[0])
  return Axes(out)


def _dot(eqn: Any, lhs: Axes, rhs: Axes) -> Axes:
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  l_free = [i for i in range(_ndim(eqn.invars[0])) if i not in lc and i not in lb]
  r_free = [i for i in range(_ndim(eqn.invars[1])) if i not in rc and i not in rb]
  out = [lb[k] in lhs and rb[k] in rhs for k in range(len(lb))]
  out += [i in lhs for i in l_free] + [i in rhs for i in r_free]
  return Axes(j for j, constant in enumerate(out) if constant)


def _while(params: dict, ins: list[Axes], memo: dict) -> list[Axes]:
  nc, nb = params["cond_nconsts"], params["body_nconsts"]
  consts, carry = ins[nc:nc + nb], list(ins[nc + nb:])
  body = params["body_jaxpr"].jaxpr
  while True:   # loops keep what every iteration keeps
    kept = [c & o for c, o in zip(carry, constant_axes(body, consts + carry, memo))]
    if kept == carry:
      return carry
    carry = kept


def _scan(params: dict, ins: list[Axes], n_out: int, memo: dict) -> list[Axes]:
  body, _, n_consts, n_carry = internals.scan_layout(params)
  consts, carry = ins[:n_consts], list(ins[n_consts:n_consts + n_carry])
  xs = [Axes(a - 1 for a in x if a > 0) for x in ins[n_consts + n_carry:]]
  while True:
    outs = constant_axes(body, consts + carry + xs, memo)
    kept = [c & o for c, o in zip(carry, outs)]
    if kept == carry:
      break
    carry = kept
  ys = [Axes(a + 1 for a in y) for y in outs[n_carry:]]
  return (carry + ys)[:n_out]


def _called(params: dict, n_in: int, n_out: int) -> Any | None:
  """The one jaxpr a call primitive runs on its operands, if it has exactly one."""
  found = []
  for value in params.values():
    inner = getattr(value, "jaxpr", value)
    if hasattr(inner, "eqns") and len(inner.invars) == n_in and len(inner.outvars) == n_out:
      found.append(inner)
  return found[0] if len(found) == 1 else None

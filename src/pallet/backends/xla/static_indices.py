"""Gathers and scatters whose indices are known at trace time, turned into slices.

Triton-style kernels address a block through an index vector:
`plgpu.load(x_ref.at[jnp.arange(n)], mask=...)` discharges to a `gather` (and a
masked store to a `scatter`) whose indices are computed inside the kernel from
iotas and literals only. Run under `vmap` those become batched gathers and
scatters, which XLA's CPU backend runs an order of magnitude slower than the
plain copies they are. This pass re-traces the discharged body once, folding
every value computable from literals alone (small ones: at most
`MAX_FOLDED_ELEMENTS` elements) into a constant, and rewrites a gather/scatter
along one dimension whose folded indices are a contiguous ascending run, with
every index outside the run out of bounds (masked off), as a slice plus padding
with the fill value / a `dynamic_update_slice`. Index computations that depend on
the data or on the grid stay as they were.

Inner jaxprs are inlined where that exposes indices: calls (`jit`, `closed_call`)
and `scan`s of length one (a `fori_loop` over a single column block); `cond`
branches are folded in place. While loops get their read-only carries (refs the
loop only reads, which state discharge threads through the carry) as loop
constants: under vmap a data-dependent trip count batches every carry, which
otherwise copies those operands once per program.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal

from pallet import _internals as internals
from pallet.backends.xla import gather_windows, nested_jaxprs
from pallet.core import array_ops, grid_eval

MAX_FOLDED_ELEMENTS = 1 << 16
# A counted loop of at most this many trips with known bounds is inlined (no copy
# of its body is added: one trip replaces the loop).
MAX_INLINED_TRIPS = 1
_INDEXED = ("gather", "scatter", "while")


def fold_static_indices(closed: ClosedJaxpr, varying: Sequence[bool] | None = None,
                        known: dict[int, int] | None = None) -> ClosedJaxpr:
  """`closed` with static-index gathers/scatters as slices (itself if it has none).

  `varying` marks the inputs that differ between the programs run at once under
  vmap (vectorized grid ids, blocks): a `cond` whose predicate depends on them is
  run as both branches and a select, as vmap would, but without vmap's broadcast
  of every operand to one copy per program. `known` gives inputs whose value is
  the same at every step (the index of a grid axis of size one): indices computed
  from them fold too (a GPU kernel's head-block mask, `arange(block_h) < heads -
  block_h * program_id(0)`, over one head block)."""
  if not _binds(closed.jaxpr, _INDEXED):
    return closed
  n = len(closed.jaxpr.invars)
  if not _may_rewrite(closed.jaxpr, [False] * n, list(varying or [False] * n))[0]:
    return closed     # tracing the body again would change nothing: skip it
  avals = [v.aval for v in closed.jaxpr.invars]
  args = [jax.core.ShapedArray(a.shape, a.dtype) for a in avals]

  folder = _Folder()

  def run(*xs):
    xs = list(xs)
    for k, value in (known or {}).items():
      xs[k] = _Known(np.asarray(value, avals[k].dtype))
    for x, v in zip(xs, varying or ()):
      if v:
        folder.varying.add(id(x))
    return [_value(x) for x in folder.run(closed.jaxpr, closed.consts, xs)]
  folded = internals.trace_jaxpr(run, args, "static-index pass")
  # Folding alone (constants for iotas, inlined calls) is no gain and can cost (XLA
  # fuses an iota better than a literal table): keep the body unless a rewrite fired.
  return folded if folder.changed else closed


def _may_rewrite(jaxpr: Any, known: Sequence[bool], varying: Sequence[bool]
                 ) -> tuple[bool, list[bool], list[bool]]:
  """Whether `_Folder.run` could rewrite anything in `jaxpr` (and which of its outputs
  could be known and which vary), decided on the jaxpr alone, without tracing: it
  follows the folder's walk and over-approximates (a value is taken as known when
  every input of its equation is), so a False is certain."""
  is_known = {v: True for v in jaxpr.constvars}
  is_known.update(zip(jaxpr.invars, known))
  producer = {o: e for e in jaxpr.eqns for o in e.outvars}
  varies = dict(zip(jaxpr.invars, varying))
  k = lambda x: isinstance(x, Literal) or is_known.get(x, False)
  v = lambda x: not isinstance(x, Literal) and varies.get(x, False)
  for eqn in jaxpr.eqns:
    ins_k, ins_v = [k(x) for x in eqn.invars], [v(x) for x in eqn.invars]
    n_out = len(eqn.outvars)
    out_k, out_v = [False] * n_out, [any(ins_v)] * n_out
    name = eqn.primitive.name
    sub = nested_jaxprs.called(eqn)
    if sub is not None:
      changed, out_k, out_v = _may_rewrite(getattr(sub, "jaxpr", sub), ins_k, ins_v)
      if changed:
        return True, [], []
    elif name == "scan" and eqn.params.get("length") == 1 and not eqn.params.get("reverse"):
      body = eqn.params["jaxpr"]
      changed, out_k, out_v = _may_rewrite(getattr(body, "jaxpr", body), ins_k, ins_v)
      if changed:
        return True, [], []
    elif name == "scan":
      if _scan_body_may_rewrite(eqn, ins_k):
        return True, [], []
    elif name == "while":
      if not eqn.effects and _passes_a_carry_through(eqn):
        return True, [], []
    elif name == "cond" and not ins_k[0]:
      if ins_v[0] and not eqn.effects:
        return True, [], []
      for branch in eqn.params["branches"]:
        if _may_rewrite(branch.jaxpr, ins_k[1:], ins_v[1:])[0]:
          return True, [], []
    elif name in ("gather", "scatter") and ins_k[1] and _index_vector_shape(eqn):
      return True, [], []
    elif gather_windows.takes(eqn, producer) and any(
        k(x) for x in producer[eqn.invars[1]].invars):
      return True, [], []
    elif all(ins_k) and not eqn.effects and not _subjaxprs(eqn):
      out_k = [True] * n_out
    for o, ok, ov in zip(eqn.outvars, out_k, out_v):
      is_known[o], varies[o] = ok, ov and not ok
  return False, [k(x) for x in jaxpr.outvars], [v(x) for x in jaxpr.outvars]


def _passes_a_carry_through(eqn: Any) -> bool:
  body = eqn.params["body_jaxpr"].jaxpr
  carry_in = body.invars[eqn.params["body_nconsts"]:]
  producer = {o: e for e in body.eqns for o in e.outvars}
  return any(_passed_through(out, producer) is v for v, out in zip(carry_in, body.outvars))


def _index_vector_shape(eqn: Any) -> bool:
  """Whether a gather/scatter has the one-dimensional index vector the rewrites take."""
  shape = eqn.invars[1].aval.shape
  return len(shape) == 2 and shape[1] == 1


def _binds(jaxpr: Any, names: Sequence[str]) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      return True
    for sub in _subjaxprs(eqn):
      if _binds(sub, names):
        return True
  return False


def _subjaxprs(eqn: Any) -> list[Any]:
  subs = []
  for p in eqn.params.values():
    for x in (p if isinstance(p, (tuple, list)) else (p,)):
      inner = getattr(x, "jaxpr", x)
      if hasattr(inner, "eqns"):
        subs.append(inner)
  return subs


class _Known:
  """A value computed at trace time (a concrete array)."""

  def __init__(self, value: Any):
    self.value = value


class _Folder:
  """Evaluates a jaxpr, keeping values that depend on no input as `_Known`."""

  def __init__(self):
    self.varying: set[int] = set()   # ids of traced values that differ per program
    self.changed = False             # a gather/scatter, loop or cond was rewritten

  def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(x: Any) -> Any:
      return _Known(np.asarray(x.val, x.aval.dtype)) if isinstance(x, Literal) else env[x]

    for v, c in zip(jaxpr.constvars, consts):
      env[v] = c if internals.is_tracer(c) or not _numeric(c) else _Known(np.asarray(c))
    for v, a in zip(jaxpr.invars, args):
      env[v] = a
    producer = {o: e for e in jaxpr.eqns for o in e.outvars}
    for eqn in jaxpr.eqns:
      ins = [read(x) for x in eqn.invars]
      outs = self.eqn(eqn, ins, producer, read)
      if any(id(x) in self.varying for x in ins):
        self.varying.update(id(o) for o in outs if not isinstance(o, _Known))
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
    return [read(x) for x in jaxpr.outvars]

  def eqn(self, eqn: Any, ins: list[Any], producer: dict,
          read: Callable[[Any], Any]) -> list[Any]:
    name = eqn.primitive.name
    sub = nested_jaxprs.called(eqn)
    if sub is not None:
      return self.run(getattr(sub, "jaxpr", sub), getattr(sub, "consts", ()), ins)
    if name == "scan" and eqn.params.get("length") == 1 and not eqn.params.get("reverse"):
      return self.scan_once(eqn, ins)
    if name == "scan" and _scan_body_may_rewrite(eqn, [isinstance(x, _Known) for x in ins]):
      return self.scan_folded(eqn, ins)
    if name == "while":
      inlined = self.counted_loop_inlined(eqn, ins)
      if inlined is not None:
        return inlined
      hoisted = self.while_with_invariants_hoisted(eqn, ins)
      if hoisted is not None:
        return hoisted
    if name == "cond" and not isinstance(ins[0], _Known):
      return self.cond(eqn, ins)
    known = all(isinstance(x, _Known) for x in ins)
    if known and not eqn.effects and not _subjaxprs(eqn) and all(
        _numeric(v.aval) and math.prod(v.aval.shape) <= MAX_FOLDED_ELEMENTS
        for v in eqn.outvars):
      try:   # NumPy first: an eager JAX op compiles a program per primitive and shape
        return [_Known(o) for o in grid_eval.apply_array_equation(eqn, [x.value for x in ins])]
      except grid_eval.Unsupported:
        pass
      # Only integers and booleans can become indices: folding a float value (the
      # `-inf` a softmax starts from) would compile an eager program for nothing.
      if all(grid_eval.exact(v.aval) for v in eqn.outvars):
        with internals.eval_context():
          return [_Known(np.asarray(o)) for o in internals.bind_equation(eqn, [x.value for x in ins], source=False)]
    if name == "gather" and isinstance(ins[1], _Known):
      sliced = _gather_as_slice(eqn, _value(ins[0]), ins[1].value)
      if sliced is not None:
        self.changed = True
        return [sliced]
    if gather_windows.takes(eqn, producer) and not isinstance(ins[1], _Known):
      def known(var):
        x = read(var)
        return x.value if isinstance(x, _Known) else None
      windowed = gather_windows.rewrite(eqn, [_value(x) for x in ins], producer, known,
                                        lambda var: _value(read(var)))
      if windowed is not None:
        self.changed = True
        return windowed
    if name == "scatter" and isinstance(ins[1], _Known):
      updated = _scatter_as_update(eqn, _value(ins[0]), ins[1].value, _value(ins[2]))
      if updated is not None:
        self.changed = True
        return [updated]
    return internals.bind_equation(eqn, [_value(x) for x in ins], source=False)

  def counted_loop_inlined(self, eqn: Any, ins: list[Any]) -> list[Any] | None:
    """A `fori_loop` whose bounds are known here and that runs at most
    `MAX_INLINED_TRIPS` times, as its body inlined that many times (none: its initial
    carry). Loop bounds computed from program ids become known where the grid axis is
    unrolled or has one step (a causal kernel's key range per query block): the body
    then folds with a known counter (its slices static) and XLA gets no while loop."""
    trips = _known_trip_count(eqn, ins)
    if trips is None or trips > MAX_INLINED_TRIPS:
      return None
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    body = p["body_jaxpr"]
    carry = list(ins[nc + nb:])
    for _ in range(trips):
      carry = self.run(body.jaxpr, body.consts, list(ins[nc:nc + nb]) + carry)
    self.changed = True
    return carry

  def while_with_invariants_hoisted(self, eqn: Any, ins: list[Any]) -> list[Any] | None:
    """A while loop whose carries the body passes through unchanged (refs the loop
    only reads: discharge carries every ref) with those as loop constants. Under vmap
    a batched trip count batches every carry, which copied the read-only operands
    (all of paged attention's pages) once per program."""
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    body, cond = p["body_jaxpr"], p["cond_jaxpr"]
    carry_in = body.jaxpr.invars[nb:]
    producer = {o: e for e in body.jaxpr.eqns for o in e.outvars}
    fixed = [k for k, (v, out) in enumerate(zip(carry_in, body.jaxpr.outvars))
             if _passed_through(out, producer) is v]
    if not fixed or eqn.effects:
      return None
    cconsts, bconsts = list(ins[:nc]), list(ins[nc:nc + nb])
    init = list(ins[nc + nb:])
    moving = [k for k in range(len(init)) if k not in fixed]

    def full(carry):
      values = list(init)
      for k, c in zip(moving, carry):
        values[k] = c
      return values

    # The body is folded as the kernel is (its gathers' index columns, conds, inner
    # loops), the loop constants and passed-through carries known where they are.
    def cond_fun(carry):
      return _value(self.run(cond.jaxpr, cond.consts, cconsts + full(carry))[0])

    def body_fun(carry):
      outs = self.run(body.jaxpr, body.consts, bconsts + full(carry))
      return [_value(outs[k]) for k in moving]
    final = lax.while_loop(cond_fun, body_fun, [_value(init[k]) for k in moving])
    self.changed = True
    return full(final)

  def cond(self, eqn: Any, ins: list[Any]) -> list[Any]:
    """A cond whose branches are folded too (their loops and indices); with a
    predicate that differs per program, both branches and a select."""
    branches = [functools.partial(self._branch, b) for b in eqn.params["branches"]]
    operands = [_value(x) for x in ins[1:]]
    if id(ins[0]) not in self.varying or eqn.effects:
      return list(lax.switch(_value(ins[0]), branches, *operands))
    index = jnp.clip(ins[0], 0, len(branches) - 1).astype(jnp.int32)
    results = [branch(*operands) for branch in branches]
    self.changed = True
    return [lax.select_n(index, *outs) if len(outs) > 1 else outs[0]
            for outs in zip(*results)]

  def _branch(self, closed: Any, *args: Any) -> list[Any]:
    return [_value(x) for x in self.run(closed.jaxpr, closed.consts, args)]

  def scan_folded(self, eqn: Any, ins: list[Any]) -> list[Any]:
    """A scan whose body is folded as the kernel is, its constants known where they
    are (a row gather through an index array inside a static `fori_loop`)."""
    p = eqn.params
    body, consts, n_consts, n_carry = internals.scan_layout(p)
    consts_in = list(ins[:n_consts])

    def step(carry, xs):
      outs = self.run(body, consts, consts_in + list(carry) + list(xs))
      return [_value(o) for o in outs[:n_carry]], [_value(o) for o in outs[n_carry:]]
    carry, ys = lax.scan(step, [_value(x) for x in ins[n_consts:n_consts + n_carry]],
                         [_value(x) for x in ins[n_consts + n_carry:]], length=p["length"],
                         reverse=p["reverse"], unroll=p.get("unroll", 1))
    self.changed = True
    return list(carry) + list(ys)

  def scan_once(self, eqn: Any, ins: list[Any]) -> list[Any]:
    body, consts, n_consts, n_carry = internals.scan_layout(eqn.params)
    xs = [_Known(x.value[0]) if isinstance(x, _Known) else x[0]
          for x in ins[n_consts + n_carry:]]
    outs = self.run(body, consts, list(ins[:n_consts + n_carry]) + xs)
    carry, ys = outs[:n_carry], outs[n_carry:]
    return carry + [_Known(y.value[None]) if isinstance(y, _Known) else jnp.expand_dims(y, 0)
                    for y in ys]


def _scan_body_may_rewrite(eqn: Any, known: Sequence[bool]) -> bool:
  """Whether folding a scan's body could rewrite one of its gathers, scatters or
  loops (a `fori_loop` with static bounds is a scan); `known` marks the scan's
  operands known at trace time (only its constants stay known inside the body)."""
  if eqn.effects:
    return False
  body, _, n_consts, _ = internals.scan_layout(eqn.params)
  inner = list(known[:n_consts]) + [False] * (len(body.invars) - n_consts)
  return _may_rewrite(body, inner, [False] * len(body.invars))[0]


def _known_trip_count(eqn: Any, ins: list[Any]) -> int | None:
  """The trip count of a `fori_loop`-shaped while loop (its condition `counter < upper`
  on two of its carries, its body adding 1 to the counter and passing `upper` through;
  state discharge puts the refs' carries before them) when both are known; None for
  any other loop or unknown bounds."""
  if eqn.effects:
    return None
  p = eqn.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
  carry = ins[nc + nb:]
  if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt" or (
      cond.outvars != cond.eqns[0].outvars):
    return None
  carries = cond.invars[nc:]
  try:
    a, b = (carries.index(x) for x in cond.eqns[0].invars)
  except ValueError:     # a literal or a constant in the condition
    return None
  if not all(isinstance(carry[k], _Known) and np.ndim(carry[k].value) == 0 for k in (a, b)):
    return None
  b_carries = body.invars[nb:]
  producer = {o: e for e in body.eqns for o in e.outvars}
  step = producer.get(body.outvars[a])
  if (body.outvars[b] is not b_carries[b] or step is None or step.primitive.name != "add"
      or step.invars[0] is not b_carries[a] or not isinstance(step.invars[1], Literal)
      or step.invars[1].val != 1):
    return None
  return max(0, int(carry[b].value) - int(carry[a].value))


def _passed_through(var: Any, producer: dict) -> Any:
  """The variable `var` is, seen through calls that return one of their inputs."""
  while not isinstance(var, Literal) and var in producer:
    eqn = producer[var]
    sub = nested_jaxprs.called(eqn)
    if sub is None:
      return var
    inner = getattr(sub, "jaxpr", sub)
    out = inner.outvars[eqn.outvars.index(var)]
    if out not in inner.invars:
      return var
    var = eqn.invars[inner.invars.index(out)]
  return var


def _numeric(x: Any) -> bool:
  """Whether `x` (a value or an aval) has a NumPy dtype and a shape (not a PRNG key)."""
  return hasattr(x, "shape") and isinstance(getattr(x, "dtype", None), np.dtype)


def _value(x: Any) -> Any:
  return x.value if isinstance(x, _Known) else x


# ------------------------------------------------------------------ index patterns
def _contiguous_run(idx: np.ndarray, size: int, mode: Any
                    ) -> tuple[int, int, int, str, str] | None:
  """(a, b, start, left, right) when idx[a:b] == start + arange(b - a) lies inside
  [0, size) and the indices before a / from b on are either all out of bounds
  (`left`/`right` "fill": filled or dropped) or all repeat the run's end ("edge":
  a clamped index, as masked loads make them); None otherwise."""
  name = getattr(mode, "name", str(mode))
  if "CLIP" in name:
    idx = np.clip(idx, 0, size - 1)
  valid = (idx >= 0) & (idx < size)
  if "FILL_OR_DROP" not in name and not valid.all():
    return None
  if not valid.any():
    return 0, 0, 0, "fill", "fill"
  a = int(np.argmax(valid))
  run = (idx[a:] - idx[a] == np.arange(idx.size - a)) & valid[a:]
  b = a + (int(np.argmin(run)) if not run.all() else run.size)

  def side(rest: np.ndarray, edge: int) -> str | None:
    if rest.size == 0 or not ((rest >= 0) & (rest < size)).any():
      return "fill"
    return "edge" if np.all(rest == edge) else None
  left, right = side(idx[:a], idx[a]), side(idx[b:], idx[b - 1])
  if left is None or right is None:
    return None
  return a, b, int(idx[a]), left, right


def _single_dim(dnums: Any, indices: np.ndarray, starts_field: str,
                collapsed_field: str) -> int | None:
  """The operand dimension of a one-dimensional index vector `indices[n, 1]`."""
  if getattr(dnums, "operand_batching_dims", ()) or (
      getattr(dnums, "start_indices_batching_dims", ())
      or getattr(dnums, "scatter_indices_batching_dims", ())):
    return None
  starts = tuple(getattr(dnums, starts_field))
  if len(starts) != 1 or tuple(getattr(dnums, collapsed_field)) != starts:
    return None
  if indices.ndim != 2 or indices.shape[1] != 1:
    return None
  return starts[0]


def _fill_value(fill: Any, dtype: Any) -> Any:
  """The gather's fill for out-of-bounds rows (jax's default when not given)."""
  if fill is not None:
    return fill
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return np.nan
  if jnp.issubdtype(dtype, jnp.signedinteger):
    return jnp.iinfo(dtype).min
  if jnp.issubdtype(dtype, jnp.unsignedinteger):
    return jnp.iinfo(dtype).max
  return True


def _gather_as_slice(eqn: Any, operand: Any, indices: np.ndarray) -> Any | None:
  p = eqn.params
  dn = p["dimension_numbers"]
  d = _single_dim(dn, indices, "start_index_map", "collapsed_slice_dims")
  if d is None:
    return None
  shape = operand.shape
  sizes = tuple(p["slice_sizes"])
  if sizes[d] != 1 or any(sizes[k] != shape[k] for k in range(len(shape)) if k != d):
    return None
  run = _contiguous_run(indices[:, 0], shape[d], p["mode"])
  if run is None:
    return None
  a, b, start, left, right = run
  n = indices.shape[0]
  if a == b:
    fill = jnp.asarray(_fill_value(p.get("fill_value"), operand.dtype), operand.dtype)
    taken = jnp.full(shape[:d] + (n,) + shape[d + 1:], fill, operand.dtype)
  else:
    taken = lax.slice_in_dim(operand, start, start + (b - a), axis=d)
    taken = _extend(taken, d, a, left, 0, p.get("fill_value"))
    taken = _extend(taken, d, n - b, right, -1, p.get("fill_value"))
  out_rank = len(shape)   # the collapsed dimension's place is taken by the batch one
  batch_pos = next(k for k in range(out_rank) if k not in tuple(dn.offset_dims))
  return array_ops.moveaxis(taken, [d], [batch_pos])


def _extend(x: Any, d: int, count: int, kind: str, end: int, fill: Any) -> Any:
  """`x` with `count` more entries along `d` before (end 0) or after (end -1) it:
  the gather's fill value, or copies of the edge entry."""
  if count == 0:
    return x
  # A pad and a select, which XLA fuses into the consumers; a concatenation is a
  # copy of the whole block of its own (a third of the time of JAX's GPU norms).
  config = [(0, 0, 0)] * x.ndim
  config[d] = (count, 0, 0) if end == 0 else (0, count, 0)
  if kind == "fill":
    return lax.pad(x, jnp.asarray(_fill_value(fill, x.dtype), x.dtype), config)
  n = x.shape[d]
  edge = lax.slice_in_dim(x, 0, 1, axis=d) if end == 0 else lax.slice_in_dim(x, n - 1, n, axis=d)
  padded = lax.pad(x, jnp.zeros((), x.dtype), config)
  shape = padded.shape
  pos = lax.broadcasted_iota(jnp.int32, shape, d)
  outside = pos < count if end == 0 else pos >= n
  return lax.select(outside, jnp.broadcast_to(edge, shape), padded)


def _scatter_as_update(eqn: Any, operand: Any, indices: np.ndarray, updates: Any) -> Any | None:
  p = eqn.params
  dn = p["dimension_numbers"]
  d = _single_dim(dn, indices, "scatter_dims_to_operand_dims", "inserted_window_dims")
  if d is None:
    return None
  shape = operand.shape
  window = tuple(dn.update_window_dims)
  batch_pos = next(k for k in range(updates.ndim) if k not in window)
  moved = array_ops.moveaxis(updates, [batch_pos], [d])
  if moved.shape[:d] + moved.shape[d + 1:] != shape[:d] + shape[d + 1:]:
    return None
  run = _contiguous_run(indices[:, 0], shape[d], p["mode"])
  if run is None:
    return None
  a, b, start, left, right = run
  if (a > 0 and left != "fill") or (b < indices.shape[0] and right != "fill"):
    return None   # clamped indices would write one element several times
  if a == b:
    return operand
  part = lax.slice_in_dim(moved, a, b, axis=d).astype(operand.dtype)
  # (a concatenation: dynamic_update_slice becomes a scatter under vmap)
  pieces = [lax.slice_in_dim(operand, 0, start, axis=d), part,
            lax.slice_in_dim(operand, start + (b - a), shape[d], axis=d)]
  return jnp.concatenate([x for x in pieces if x.shape[d]], axis=d)

"""Updates of an array with values read from elsewhere in it, written as a select.

A store whose value reads the same ref somewhere else (`o[1:] = o[:-1]`, a flip, a
roll or a transpose of the block written into part of it, a DMA between two pages
of one cache) discharges to `dynamic_update_slice(T, u, i)` with `u` computed from
`T`. XLA:CPU (jaxlib 0.10 and 0.12) may run such an update in place while computing
`u` inside the same loop, reading elements it has already overwritten: a silent
wrong result, found where a reshape or a vectorized grid sits between the array and
the update (openxla/xla#49176; plain JAX under `jit` gets the same wrong numbers,
and right ones op by op). An optimization barrier on `u` avoids it on jaxlib 0.12
but not on 0.10.

`guard` rewrites every such update as `select(window, dynamic_update_slice(0, u, i),
T)`, elementwise over `T`, which XLA runs reading each element before writing it.
The updates left alone are those whose value reads `T` only at the positions it
writes, through elementwise operations (`acc[h] = acc[h] * a + b`, the accumulators
of every attention and matmul kernel): an in-place update reads each element before
it writes it. Reading through `reshape`, `transpose`, a slice at another window, a
reduction or a loop counts as reading elsewhere. Only such updates change; a kernel
without one keeps its program.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal
from jax.extend.core.primitives import closed_call_p

from pallet import _internals as internals
from pallet.backends.xla import nested_jaxprs

# Same-shape operations that pair element k of each operand with element k of the
# result (scalars broadcast).
_ELEMENTWISE = frozenset("""
    abs add and atan2 cbrt ceil clamp convert_element_type copy copy_p cos cosh div eq
    erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma log
    log1p logistic lt max min mul ne neg nextafter not or population_count pow real
    reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square sub tan tanh xor clz conj complex
    """.split())
# Operations that keep the row-major order of the elements.
_REORDERS_NOTHING = frozenset({"reshape", "squeeze", "expand_dims"})
# Operations whose result XLA may keep in its operand's buffer (a layout change makes a
# transpose a bitcast; copies are elided).
_SAME_BUFFER = frozenset({"reshape", "squeeze", "expand_dims", "bitcast_convert_type",
                          "transpose", "copy", "copy_p"})


def guard(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` with every update whose value reads its array elsewhere written as a
  select (itself if there is none)."""
  jaxpr = _guard(closed.jaxpr)
  return closed if jaxpr is closed.jaxpr else ClosedJaxpr(jaxpr, closed.consts)


def _guard(jaxpr: Any) -> Any:
  producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  numbering = _ValueNumbers(producers)
  eqns, changed = [], False
  for eqn in jaxpr.eqns:
    params = nested_jaxprs.rewrite_params(eqn, _guard_closed)
    if params is not eqn.params:
      eqn, changed = eqn.replace(params=params), True
    if eqn.primitive.name == "dynamic_update_slice" and _reads_elsewhere(
        eqn, producers, numbering):
      eqn, changed = _as_select(eqn), True
    eqns.append(eqn)
  return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _guard_closed(x: Any) -> Any:
  if isinstance(x, ClosedJaxpr):
    return guard(x)
  return _guard(x) if hasattr(x, "eqns") else x


def _reads_elsewhere(update: Any, producers: dict, numbering: "_ValueNumbers") -> bool:
  """Whether the update's value depends on its operand's buffer other than through
  reads of the window it writes, paired element by element."""
  operand, value, *starts = update.invars
  if isinstance(operand, Literal):
    return False
  roots: dict = {}
  buffer = _root(operand, producers, roots)
  whole = value.aval.shape == operand.aval.shape
  seen: set = set()
  stack = [(value, False)]
  while stack:
    var, shuffled = stack.pop()
    if isinstance(var, Literal) or (var, shuffled) in seen:
      continue
    seen.add((var, shuffled))
    if _root(var, producers, roots) is buffer:
      if shuffled or var is not operand or not whole:
        return True
      continue   # the whole operand, element by element
    eqn = producers.get(var)
    if eqn is None:
      continue
    if _reads_window(eqn, operand, starts, value.aval.shape, numbering):
      if shuffled:
        return True
      continue
    keeps = not shuffled and _pairs_elements(eqn, var)
    stack.extend((v, not keeps) for v in eqn.invars)
  return False


def _root(var: Any, producers: dict, roots: dict) -> Any:
  """The array `var` is a view of to XLA: back through reshapes, transposes, bitcasts
  and copies (which XLA may turn into bitcasts of one buffer)."""
  path = []
  while var not in roots:
    eqn = producers.get(var)
    if eqn is None or eqn.primitive.name not in _SAME_BUFFER or isinstance(eqn.invars[0], Literal):
      roots[var] = var
      break
    path.append(var)
    var = eqn.invars[0]
  root = roots[var]
  for v in path:
    roots[v] = root
  return root


def _pairs_elements(eqn: Any, out: Any) -> bool:
  """Whether element k (in row-major order) of `out` comes from element k of each
  operand (or from a scalar): elementwise operations and reshapes."""
  name = eqn.primitive.name
  if name in _REORDERS_NOTHING:
    return True
  if name not in _ELEMENTWISE:
    return name == "broadcast_in_dim" and eqn.invars[0].aval.shape == ()
  shape = out.aval.shape
  return all(getattr(v.aval, "shape", ()) in ((), shape) for v in eqn.invars)


def _reads_window(eqn: Any, operand: Any, starts: list, shape: tuple,
                  numbering: "_ValueNumbers") -> bool:
  """Whether `eqn` reads exactly the window of `operand` the update writes."""
  if not eqn.invars or eqn.invars[0] is not operand:
    return False
  name = eqn.primitive.name
  if name == "dynamic_slice":
    return (tuple(eqn.params["slice_sizes"]) == tuple(shape)
            and len(eqn.invars) - 1 == len(starts)
            and all(numbering.same(a, b) for a, b in zip(eqn.invars[1:], starts)))
  if name == "slice":
    strides = eqn.params.get("strides")
    if strides is not None and any(s != 1 for s in strides):
      return False
    first = eqn.params["start_indices"]
    sizes = tuple(hi - lo for lo, hi in zip(first, eqn.params["limit_indices"]))
    return sizes == tuple(shape) and all(
        numbering.constant(s) == lo for s, lo in zip(starts, first))
  return False


class _ValueNumbers:
  """Whether two scalar index atoms are computed the same way (discharge computes a
  window's start once for the read and once for the write)."""

  def __init__(self, producers: dict):
    self.producers = producers
    self.keys: dict = {}

  def same(self, a: Any, b: Any) -> bool:
    return a is b or self.key(a) == self.key(b)

  def constant(self, a: Any) -> int | None:
    key = self.key(a)
    return key[1] if key[0] == "literal" else None

  def key(self, a: Any) -> tuple:
    if isinstance(a, Literal):
      return ("literal", int(np.asarray(a.val)))
    if a in self.keys:
      return self.keys[a]
    eqn = self.producers.get(a)
    if eqn is None or eqn.effects or len(eqn.outvars) != 1:
      key: tuple = ("var", id(a))
    else:   # a call's jaxpr by identity (JAX reuses the trace of `jnp.where` and kin)
      nested = nested_jaxprs.NESTED.get(eqn.primitive.name, ())
      params = tuple(sorted((k, id(v) if k in nested else repr(v))
                            for k, v in eqn.params.items()))
      key = (eqn.primitive.name, params, tuple(self.key(v) for v in eqn.invars))
    self.keys[a] = key
    return key


def _as_select(update: Any) -> Any:
  """The update equation as a call of `select(window, update of zeros, operand)`."""
  operand, value, *starts = update.invars

  def selected(x, v, *idx):
    spread = lax.dynamic_update_slice(lax.full_like(x, 0), v, idx)
    window = lax.dynamic_update_slice(lax.full(x.shape, False), lax.full(v.shape, True), idx)
    return [lax.select(window, spread, x)]

  avals = [operand.aval, value.aval, *(s.aval for s in starts)]
  call = internals.trace_jaxpr(selected, avals, "an update reading its own array")
  return update.replace(primitive=closed_call_p, params={"call_jaxpr": call})

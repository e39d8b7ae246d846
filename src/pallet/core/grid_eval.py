"""Scalar functions of the grid indices evaluated over the whole grid with NumPy.

Trace-time analyses (index maps, reset predicates, grid-only branch conditions)
evaluate small functions of `program_id` at every grid point. Doing that with JAX
ops dispatches each primitive eagerly, and every new primitive/shape pair compiles a
small XLA program: about half a second of a kernel's first call each. They are
almost always a handful of integer scalar operations, which NumPy evaluates for all
grid points at once in microseconds. `evaluate` handles jaxprs whose every value is
a scalar per grid point and whose primitives are in `_UNARY`/`_BINARY`/the few below,
with XLA's results (division by zero, out-of-range shifts and conversions excepted:
those raise `Unsupported`); anything else raises `Unsupported` and the caller takes
its JAX path.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from jax.extend.core import Literal


class Unsupported(Exception):
  """The jaxpr needs more than scalar NumPy arithmetic."""


def _integer(*xs: np.ndarray) -> bool:
  return np.issubdtype(np.result_type(*xs), np.integer)


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  if _integer(a, b):
    _nonzero(b)
    q = np.floor_divide(a, b)
    return np.where((np.remainder(a, b) != 0) & ((a < 0) != (b < 0)), q + 1, q)  # toward 0
  return np.true_divide(a, b)


def _rem(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  if _integer(a, b):
    _nonzero(b)
  return np.fmod(a, b)


def _nonzero(b: np.ndarray) -> None:
  if np.any(b == 0):   # XLA defines integer x/0 and x%0; NumPy differs
    raise Unsupported("an integer division by zero")


def _shift(op: Any) -> Any:
  def shift(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.any((b < 0) | (b >= 8 * np.result_type(a, b).itemsize)):
      raise Unsupported("a shift by more than the bit width")   # XLA saturates, NumPy not
    return op(a, b)
  return shift


_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": _int_div,
    "rem": _rem, "max": np.maximum, "min": np.minimum, "eq": np.equal, "ne": np.not_equal,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
    "shift_left": _shift(np.left_shift), "shift_right_arithmetic": _shift(np.right_shift),
}
_UNARY = {"neg": np.negative, "abs": np.abs, "sign": np.sign, "not": np.invert,
          "floor": np.floor, "ceil": np.ceil}
_CALLS = ("pjit", "jit", "closed_call", "core_call")
_SCALAR_SHAPES = ("broadcast_in_dim", "reshape", "squeeze", "copy", "copy_p")


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[np.ndarray]:
  """`jaxpr` applied to `args` (arrays of one value per grid point, or scalars)."""
  env: dict = {}
  for v, c in zip(jaxpr.constvars, consts):
    if np.ndim(c):
      raise Unsupported("a non-scalar constant")
    env[v] = np.asarray(c)
  env.update(zip(jaxpr.invars, args))

  def read(x: Any) -> Any:
    if isinstance(x, Literal):
      return np.asarray(x.val, getattr(x.aval, "dtype", None))
    return env[x]

  for eqn in jaxpr.eqns:
    for v, o in zip(eqn.outvars, apply_equation(eqn, [read(x) for x in eqn.invars])):
      env[v] = o
  return [read(x) for x in jaxpr.outvars]


def apply_equation(eqn: Any, ins: Sequence[Any]) -> list[np.ndarray]:
  """One equation on NumPy values (one per grid point); raises Unsupported."""
  if any(getattr(v.aval, "shape", None) != () for v in (*eqn.invars, *eqn.outvars)):
    raise Unsupported("a non-scalar value")
  name = eqn.primitive.name
  if name in _CALLS and "jaxpr" in eqn.params:
    inner = eqn.params["jaxpr"]
    outs = evaluate(inner.jaxpr, inner.consts, ins)
  else:
    outs = [_apply(name, [np.asarray(x) for x in ins], eqn.params)]
  return [np.asarray(o).astype(v.aval.dtype, copy=False) for v, o in zip(eqn.outvars, outs)]


def apply_array_equation(eqn: Any, ins: Sequence[Any]) -> list[np.ndarray]:
  """One equation on whole arrays (trace-time constant folding of index
  computations): arithmetic on integers and booleans, moves of any dtype, exact in
  NumPy as in XLA (float arithmetic is not: XLA may flush denormals); raises
  Unsupported."""
  name, params = eqn.primitive.name, eqn.params
  avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
  moves = name in _MOVES or (name == "convert_element_type"
                             and avals[0].dtype == avals[-1].dtype)
  if len(eqn.outvars) != 1 or not all(exact(a) or (moves and _plain(a)) for a in avals):
    raise Unsupported("arithmetic on values that are not integers or booleans")
  out_aval = eqn.outvars[0].aval
  xs = [np.asarray(x) for x in ins]
  if name == "iota":
    shape, dim = tuple(params["shape"]), params["dimension"]
    line = np.arange(shape[dim]).reshape([-1 if d == dim else 1 for d in range(len(shape))])
    out = np.broadcast_to(line, shape)
  elif name == "broadcast_in_dim":
    shape, dims = tuple(params["shape"]), tuple(params["broadcast_dimensions"])
    out = np.broadcast_to(xs[0].reshape(
        [xs[0].shape[dims.index(d)] if d in dims else 1 for d in range(len(shape))]), shape)
  elif name == "reshape" and params.get("dimensions") is None:
    out = xs[0].reshape(tuple(params["new_sizes"]))
  elif name == "squeeze":
    out = np.squeeze(xs[0], axis=tuple(params["dimensions"]))
  elif name == "transpose":
    out = np.transpose(xs[0], tuple(params["permutation"]))
  elif name in ("copy", "copy_p"):
    out = xs[0]
  elif name == "concatenate":
    out = np.concatenate(xs, axis=params["dimension"])
  elif name == "gather":
    out = _pointwise_gather(xs[0], xs[1], params)
  elif name in _CALLS or name in _SCALAR_SHAPES:
    raise Unsupported(name)
  else:
    out = _apply(name, xs, params)
  # a fresh C-ordered copy: a zero stride (a broadcast's) would lower differently
  out = np.array(out, dtype=out_aval.dtype, order="C", copy=True)
  if out.shape != tuple(out_aval.shape):
    raise Unsupported(f"{name} gave shape {out.shape}")
  return [out]


def _pointwise_gather(operand: np.ndarray, indices: np.ndarray, params: dict) -> np.ndarray:
  """`operand[indices[..., 0], indices[..., 1], ...]`, the gather `x[i]` with array
  indices becomes, with XLA's out-of-bounds rule (clamp, or the fill value)."""
  dn, rank = params["dimension_numbers"], operand.ndim
  if (tuple(dn.offset_dims) or tuple(dn.collapsed_slice_dims) != tuple(range(rank))
      or tuple(dn.start_index_map) != tuple(range(rank))
      or tuple(getattr(dn, "operand_batching_dims", ()))
      or tuple(params["slice_sizes"]) != (1,) * rank or indices.shape[-1:] != (rank,)):
    raise Unsupported("a gather of slices")
  mode = getattr(params["mode"], "name", str(params["mode"]))
  if mode not in ("CLIP", "PROMISE_IN_BOUNDS", "FILL_OR_DROP") or (
      mode == "FILL_OR_DROP" and params.get("fill_value") is None):
    raise Unsupported(f"a gather in mode {mode}")
  idx = np.moveaxis(indices.astype(np.int64), -1, 0)
  size = np.array(operand.shape).reshape((rank,) + (1,) * (idx.ndim - 1))
  out = operand[tuple(np.clip(idx, 0, size - 1))]
  if mode == "FILL_OR_DROP":
    inside = np.all((idx >= 0) & (idx < size), axis=0)
    out = np.where(inside, out, np.asarray(params["fill_value"]).astype(operand.dtype))
  return out


# Equations that only move values (exact for every dtype, floats included).
_MOVES = ("iota", "broadcast_in_dim", "reshape", "squeeze", "transpose", "copy", "copy_p",
          "concatenate")


def _plain(aval: Any) -> bool:
  """A dtype NumPy holds as is (not one of JAX's extended dtypes)."""
  dtype = getattr(aval, "dtype", None)
  return isinstance(dtype, np.dtype)


def exact(aval: Any) -> bool:
  """Whether NumPy computes on values of `aval` exactly as XLA (integers, booleans)."""
  dtype = getattr(aval, "dtype", None)
  try:
    return dtype is not None and (dtype == np.bool_ or np.issubdtype(dtype, np.integer))
  except TypeError:   # JAX's extended dtypes (PRNG keys)
    return False


def _apply(name: str, ins: list, params: dict) -> Any:
  with np.errstate(all="ignore"):   # int32 wraps as in XLA
    if name in _BINARY:
      return _BINARY[name](*ins)
    if name in _UNARY:
      return _UNARY[name](ins[0])
    if name == "convert_element_type":
      return _convert(ins[0], np.dtype(params["new_dtype"]))
    if name in _SCALAR_SHAPES:
      return ins[0]
    if name == "select_n":
      which, cases = ins[0], np.broadcast_arrays(*ins[1:])
      return np.choose(which.astype(np.int32), cases) if len(cases) > 2 else \
          np.where(which, cases[1], cases[0])
    if name == "integer_pow":
      if params["y"] < 0 and _integer(ins[0]):
        raise Unsupported("an integer to a negative power")
      return ins[0] ** params["y"]
    if name == "clamp":
      return np.clip(ins[1], ins[0], ins[2])
  raise Unsupported(name)


def _convert(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
  if np.issubdtype(dtype, np.integer) and not _integer(x) and x.dtype != bool:
    info = np.iinfo(dtype)
    if not np.all(np.isfinite(x) & (x >= info.min) & (x <= info.max)):
      raise Unsupported("a float outside the integer range")   # XLA saturates
  return x.astype(dtype)


def over_grid(jaxpr: Any, consts: Sequence[Any], grid: tuple[int, ...],
              extra: Sequence[Any] = ()) -> list[np.ndarray]:
  """`jaxpr(*grid ids, *extra)` at every grid point: arrays of shape `grid`."""
  n = int(np.prod(grid, dtype=np.int64))
  coords = list(np.indices(grid, dtype=np.int32).reshape(len(grid), n)) if grid else []
  outs = evaluate(jaxpr, consts, coords + list(extra))
  return [np.broadcast_to(o, (n,)).reshape(grid) for o in outs]


def value_over_grid(jaxpr: Any, consts: Sequence[Any], var: Any,
                    grid: tuple[int, ...]) -> np.ndarray | None:
  """`var` of `jaxpr` (whose first inputs are the grid ids) at every grid point,
  running only the equations it needs; None if it depends on other inputs or needs
  more than scalar arithmetic."""
  values = values_over_grid(jaxpr, consts, [var], grid)
  return None if values is None else values[0]


def values_over_grid(jaxpr: Any, consts: Sequence[Any], variables: Sequence[Any],
                     grid: tuple[int, ...]) -> list[np.ndarray] | None:
  """`value_over_grid` of several variables at once (sharing their equations)."""
  needed, eqns = {v for v in variables if not isinstance(v, Literal)}, []
  for eqn in reversed(jaxpr.eqns):
    if any(v in needed for v in eqn.outvars):
      eqns.append(eqn)
      needed.update(x for x in eqn.invars if not isinstance(x, Literal))
  ids = jaxpr.invars[:len(grid)]
  if any(v in needed for v in jaxpr.invars[len(grid):]):
    return None
  n = int(np.prod(grid, dtype=np.int64))
  env = dict(zip(ids, np.indices(grid, dtype=np.int32).reshape(len(grid), n)))
  for v, c in zip(jaxpr.constvars, consts):
    env[v] = np.asarray(c)
  read = lambda x: np.asarray(x.val) if isinstance(x, Literal) else env[x]
  try:
    for eqn in reversed(eqns):
      ins = [np.asarray(x.val, x.aval.dtype) if isinstance(x, Literal) else env[x]
             for x in eqn.invars]
      for v, o in zip(eqn.outvars, apply_equation(eqn, ins)):
        env[v] = o
  except Unsupported:
    return None
  return [np.broadcast_to(read(v), (n,)).reshape(grid) for v in variables]

"""Elementwise kernel bodies as data: an expression over the blocks a kernel loads.

  ("in", i)                 the block of input i
  ("pid", a) / ("npg", a)   pl.program_id(a) / pl.num_programs(a), as the value dtype
  ("const", c)              a Python scalar
  ("un", name, e)           a NumPy/jax.numpy ufunc of one argument
  ("bin", name, e1, e2)     a ufunc of two arguments
  ("where", a, b, c, d)     where(a > b, c, d)

`evaluate` runs one with jax.numpy in a kernel or NumPy in a model.
"""
from __future__ import annotations

import random
from typing import Any, Callable, Sequence

import numpy as np

Expr = tuple

FLOAT_BINARY = ["add", "subtract", "multiply", "maximum", "minimum"]
INT_BINARY = FLOAT_BINARY + ["bitwise_and", "bitwise_or", "bitwise_xor"]
FLOAT_UNARY = ["negative", "abs", "tanh", "sin"]
INT_UNARY = ["negative", "abs"]
# Analytic operations only: the derivative model uses complex steps.
SMOOTH_BINARY = ["add", "subtract", "multiply"]
SMOOTH_UNARY = ["negative", "tanh", "sin", "square"]


def random_expr(rng: random.Random, n_inputs: int, grid_rank: int, integer: bool,
                depth: int, *, smooth: bool = False, uses_all: bool = True) -> Expr:
  """A random expression reading inputs 0..n_inputs-1 (each at least once if
  `uses_all`)."""
  binary = SMOOTH_BINARY if smooth else INT_BINARY if integer else FLOAT_BINARY
  unary = SMOOTH_UNARY if smooth else INT_UNARY if integer else FLOAT_UNARY

  def leaf() -> Expr:
    r = rng.random()
    if grid_rank and r < 0.15:
      return (rng.choice(["pid", "pid", "npg"]), rng.randrange(grid_rank))
    if r < 0.25:
      return ("const", rng.randint(-3, 3) if integer else rng.choice([0.5, -1.5, 2.0, 3.0]))
    return ("in", rng.randrange(n_inputs))

  def grow(d: int) -> Expr:
    if d == 0 or rng.random() < 0.25:
      return leaf()
    r = rng.random()
    if r < 0.25:
      return ("un", rng.choice(unary), grow(d - 1))
    if r < 0.35 and not smooth:
      return ("where", grow(d - 1), grow(d - 1), grow(d - 1), grow(d - 1))
    return ("bin", rng.choice(binary), grow(d - 1), grow(d - 1))

  expr = grow(depth)
  if uses_all:
    for i in range(n_inputs):
      if ("in", i) not in list(leaves(expr)):
        expr = ("bin", rng.choice(SMOOTH_BINARY), expr, ("in", i))
  return expr


def leaves(expr: Expr):
  if expr[0] in ("in", "pid", "npg", "const"):
    yield expr
  else:
    for sub in expr[1:]:
      if isinstance(sub, tuple):
        yield from leaves(sub)


def inputs_used(expr: Expr) -> set[int]:
  return {leaf[1] for leaf in leaves(expr) if leaf[0] == "in"}


def evaluate(expr: Expr, blocks: Sequence[Any], xp: Any,
             grid_value: Callable[[str, int], Any]) -> Any:
  """`expr` with `xp` (jax.numpy or numpy) over `blocks`; `grid_value(kind, axis)` gives
  program ids and grid sizes in the right dtype."""
  kind = expr[0]
  if kind == "in":
    return blocks[expr[1]]
  if kind in ("pid", "npg"):
    return grid_value(kind, expr[1])
  if kind == "const":
    return expr[1]
  if kind == "un":
    return getattr(xp, expr[1])(evaluate(expr[2], blocks, xp, grid_value))
  if kind == "bin":
    return getattr(xp, expr[1])(evaluate(expr[2], blocks, xp, grid_value),
                                evaluate(expr[3], blocks, xp, grid_value))
  if kind == "where":
    a, b, c, d = (evaluate(e, blocks, xp, grid_value) for e in expr[1:])
    return xp.where(xp.greater(a, b), c, d)
  raise ValueError(f"unknown expression {expr!r}")


def show(expr: Expr) -> str:
  """A readable form of an expression (for failure reports)."""
  kind = expr[0]
  if kind == "in":
    return f"x{expr[1]}"
  if kind == "pid":
    return f"program_id({expr[1]})"
  if kind == "npg":
    return f"num_programs({expr[1]})"
  if kind == "const":
    return repr(expr[1])
  if kind == "un":
    return f"{expr[1]}({show(expr[2])})"
  if kind == "bin":
    return f"{expr[1]}({show(expr[2])}, {show(expr[3])})"
  a, b, c, d = (show(e) for e in expr[1:])
  return f"where({a} > {b}, {c}, {d})"


def kernel_grid_value(pl: Any, dtype: Any) -> Callable[[str, int], Any]:
  """program_id / num_programs inside a kernel, cast to the value dtype."""
  import jax.numpy as jnp

  def value(kind: str, axis: int) -> Any:
    v = pl.program_id(axis) if kind == "pid" else pl.num_programs(axis)
    return jnp.asarray(v).astype(dtype)
  return value


def model_grid_value(ids: Sequence[int], grid: Sequence[int], dtype: Any
                     ) -> Callable[[str, int], Any]:
  def value(kind: str, axis: int) -> Any:
    return np.asarray(ids[axis] if kind == "pid" else grid[axis], dtype)
  return value


def model_dtype(dtype: Any) -> np.dtype:
  """The dtype a model computes in: float64 for floats, the dtype itself otherwise."""
  dtype = np.dtype(dtype)
  return np.dtype(np.float64) if dtype.kind == "f" or dtype.name == "bfloat16" else dtype

"""Indexing and control flow inside a kernel: 1-4 statements per program, each writing
(part of) the output block from the input block: whole writes, writes under
`pl.when` on a program id, row loops with `pl.ds` (forwards and reversed), strided
`pl.ds`, integer-array gathers and scatters, `.at[]` views, `lax.cond` with ref writes
in both branches, a `while_loop` counting to a program id, masked `plgpu.load` /
`plgpu.store`, a row picked by the program id, static column slices, `+=` into
the output, and a `fori_loop` summing masked `plgpu.load`s of row windows at run-time
starts, inside the block or partly past either end (the mask zeroes those rows; JAX's
interpreter clamps such a start, so it is no oracle for those cases). Gather and scatter rows come in as an int32 input. The output is aliased to a poisoned buffer, so what no statement writes
must stay poisoned; the model applies the statements to NumPy blocks in order.
"""
from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..case import Case, poison, random_array
from ..layout import covering_layout, grid_points, read_block, write_block

KINDS = ["whole", "when", "rows", "reverse_rows", "strided", "gather", "scatter", "at_view",
         "cond", "while", "masked", "dynamic_row", "col_slice", "accumulate", "window_loop"]


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  rank = rng.randint(1, 2)
  grid = tuple(rng.randint(1, 3) for _ in range(rank))
  R, C = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 4, 8])
  layout = covering_layout(rng, grid, (R, C), edges=False)
  statements = [_statement(rng, rank, R, C) for _ in range(rng.randint(1, 4))]
  dtype = rng.choice(["float32", "int32"])
  d = dict(grid=grid, R=R, C=C, layout=layout, statements=statements, dtype=dtype)
  x = random_array(data, layout.shape, dtype)
  # Gather/scatter rows, one row per statement, passed as an input (as kernels do).
  rows = np.array([s[1] if s[0] in ("gather", "scatter") else tuple(range(R))
                   for s in statements], np.int32)
  past = any(s[0] == "window_loop" and not _windows_inside(s, R) for s in statements)
  return Case(family="control", seed=-1,
              description=dict(grid=grid, block=(R, C), dtype=dtype, layout=layout.describe(),
                               statements=[_show(s) for s in statements]),
              inputs=(x, rows, poison(layout.shape, dtype)), run=lambda api, *a: _run(api, d, a),
              model=lambda *a: _model(d, a),
              jax_oracle="a masked window past the block (JAX's interpreter clamps its start)"
              if past else None)


def _window_starts(s: tuple) -> list[int]:
  _, n, steps, stride, shift = s
  return [r * stride + shift for r in range(steps)]


def _windows_inside(s: tuple, R: int) -> bool:
  return all(0 <= start and start + s[1] <= R for start in _window_starts(s))


def _statement(rng: random.Random, rank: int, R: int, C: int) -> tuple:
  kind = rng.choice(KINDS)
  a = rng.randrange(rank)
  if kind == "when":
    m = rng.randint(1, 3)
    return ("when", a, m, rng.randrange(m))
  if kind == "strided" and R >= 2:
    n = rng.randint(1, (R + 1) // 2)
    return ("strided", rng.randint(0, R - 2 * (n - 1) - 1), rng.randint(0, R - 2 * (n - 1) - 1), n)
  if kind == "gather":
    return ("gather", tuple(rng.randrange(R) for _ in range(R)))
  if kind == "scatter":
    perm = list(range(R))
    rng.shuffle(perm)
    return ("scatter", tuple(perm))
  if kind == "at_view":
    n = rng.randint(1, R)
    return ("at_view", rng.randint(0, R - n), rng.randint(0, R - n), n)
  if kind in ("cond", "while", "dynamic_row"):
    return (kind, a)
  if kind == "col_slice":
    return ("col_slice", rng.randint(1, C))
  if kind == "window_loop":   # (n, steps, stride, shift): windows of n rows
    n = rng.randint(1, R)
    return ("window_loop", n, rng.randint(1, 3), rng.choice([1, n]), rng.randint(-n, R))
  if kind == "strided":
    return ("whole",)
  return (kind,)


def _show(s: tuple) -> str:
  return f"{s[0]}{s[1:] if len(s) > 1 else ''}"


def _apply(s: tuple, o: np.ndarray, x: np.ndarray, ids: tuple[int, ...]) -> np.ndarray:
  """The model of one statement: the new output block."""
  o = o.copy()
  R = o.shape[0]
  kind = s[0]
  if kind == "whole":
    o[...] = x * 2
  elif kind == "when":
    _, a, m, r = s
    if ids[a] % m == r:
      o[...] = -x
  elif kind == "rows":
    for r in range(R):
      o[r] = x[r] * (r + 1)
  elif kind == "reverse_rows":
    for r in range(R):
      o[R - 1 - r] = x[r]
  elif kind == "strided":
    _, so, sx, n = s
    o[so:so + 2 * n:2][:n] = x[sx:sx + 2 * n:2][:n] + 1
  elif kind == "gather":
    o[...] = x[list(s[1])]
  elif kind == "scatter":
    o[list(s[1])] = x
  elif kind == "at_view":
    _, a0, b0, n = s
    o[a0:a0 + n] = x[b0:b0 + n] * 3
  elif kind == "cond":
    o[...] = x + 10 if ids[s[1]] % 2 == 0 else x - 10
  elif kind == "while":
    o[...] = x * (ids[s[1]] + 1)
  elif kind == "masked":
    v = np.where(x > 0, x, np.zeros_like(x))
    cols = np.arange(o.shape[1]) % 2 == 0
    o[...] = np.where(cols[None, :], v * 2, o)
  elif kind == "dynamic_row":
    r = ids[s[1]] % R
    o[r] = x[r] * 5
  elif kind == "col_slice":
    k = s[1]
    C = o.shape[1]
    o[:, :k] = x[:, C - k:]
  elif kind == "accumulate":
    o[...] = o + x
  elif kind == "window_loop":
    n = s[1]
    acc = np.zeros((n, o.shape[1]), o.dtype)
    for r, start in enumerate(_window_starts(s)):
      for k in range(n):
        if 0 <= start + k < R:
          acc[k] += x[start + k] * (r + 1)
    o[:n] = acc
  return o


def _model(d: dict[str, Any], args: tuple[np.ndarray, ...]) -> np.ndarray:
  x, out = args[0], args[2].copy()
  grid, layout = d["grid"], d["layout"]
  for ids in grid_points(grid):
    window = layout.window(ids, grid)
    xb, ob = read_block(x, window)[0], read_block(out, window)[0]
    with np.errstate(all="ignore"):
      for s in d["statements"]:
        ob = _apply(s, ob, xb, ids)
    write_block(out, window, ob)
  return out


def _run(api: Any, d: dict[str, Any], args: tuple[Any, ...]) -> Any:
  pl, plgpu, grid = api.pl, api.plgpu, d["grid"]
  R, C = d["R"], d["C"]
  dtype = jnp.dtype(d["dtype"])

  def statement(s, x_ref, o_ref, rows):
    kind = s[0]
    if kind == "whole":
      o_ref[...] = x_ref[...] * 2
    elif kind == "when":
      _, a, m, r = s

      @pl.when(pl.program_id(a) % m == r)
      def _():
        o_ref[...] = -x_ref[...]
    elif kind == "rows":
      def row(r, carry):
        o_ref[pl.ds(r, 1), :] = x_ref[pl.ds(r, 1), :] * (r + 1).astype(dtype)
        return carry
      lax.fori_loop(0, R, row, 0)
    elif kind == "reverse_rows":
      def row(r, carry):
        o_ref[pl.ds(R - 1 - r, 1), :] = x_ref[pl.ds(r, 1), :]
        return carry
      lax.fori_loop(0, R, row, 0)
    elif kind == "strided":
      _, so, sx, n = s
      o_ref[pl.ds(so, n, stride=2), :] = x_ref[pl.ds(sx, n, stride=2), :] + 1
    elif kind == "gather":
      o_ref[...] = x_ref[rows, :]
    elif kind == "scatter":
      o_ref[rows, :] = x_ref[...]
    elif kind == "at_view":
      _, a0, b0, n = s
      o_ref.at[pl.ds(a0, n)][...] = x_ref.at[pl.ds(b0, n)][...] * 3
    elif kind == "cond":
      def even():
        o_ref[...] = x_ref[...] + 10

      def odd():
        o_ref[...] = x_ref[...] - 10
      lax.cond(pl.program_id(s[1]) % 2 == 0, even, odd)
    elif kind == "while":
      target = pl.program_id(s[1]) + 1
      count = lax.while_loop(lambda c: c < target, lambda c: c + 1, jnp.int32(0))
      o_ref[...] = x_ref[...] * count.astype(dtype)
    elif kind == "masked":
      x = x_ref[...]
      v = plgpu.load(x_ref.at[:, :], mask=x > 0, other=0)
      cols = lax.broadcasted_iota(jnp.int32, (R, C), 1) % 2 == 0
      plgpu.store(o_ref.at[:, :], v * 2, mask=cols)
    elif kind == "dynamic_row":
      r = pl.program_id(s[1]) % R
      o_ref[pl.ds(r, 1), :] = x_ref[pl.ds(r, 1), :] * 5
    elif kind == "col_slice":
      k = s[1]
      o_ref[:, 0:k] = x_ref[:, C - k:C]
    elif kind == "accumulate":
      o_ref[...] += x_ref[...]
    elif kind == "window_loop":
      _, n, steps, stride, shift = s
      offsets = jnp.arange(n)

      def window(r, acc):
        start = r * stride + shift
        inside = (start + offsets >= 0) & (start + offsets < R)
        mask = jnp.broadcast_to(inside[:, None], (n, C))
        v = plgpu.load(x_ref.at[pl.ds(start, n), :], mask=mask, other=0)
        return acc + v * (r + 1).astype(dtype)
      o_ref[pl.ds(0, n), :] = lax.fori_loop(0, steps, window, jnp.zeros((n, C), dtype))

  def kernel(x_ref, rows_ref, buf_ref, o_ref):
    for k, s in enumerate(d["statements"]):
      statement(s, x_ref, o_ref, rows_ref[k])

  spec = d["layout"].spec(pl, grid)
  n = len(d["statements"])
  rows_spec = pl.BlockSpec((n, R), lambda *ids: (0, 0))
  call = api.pallas_call(kernel, jax.ShapeDtypeStruct(d["layout"].shape, dtype), grid=grid,
                         in_specs=[spec, rows_spec, spec], out_specs=spec,
                         input_output_aliases={2: 0})
  return call(*args)

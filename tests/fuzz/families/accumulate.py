"""Revisited outputs: a fold over a reduction grid axis placed anywhere in the grid (so
an output block is revisited on consecutive steps, or comes back after other blocks),
visited forwards or in reverse, with an optional in-block reduction (kept or squeezed
dimension), edge blocks along the other dimensions, and a second output counting steps.

Folds: sum (zeroed on the first step), first-block initialisation, running max,
order-sensitive decay (o = o / 2 + x), sum then a rescale on the last step. The model is
the row-major loop over the grid with the output as memory.
"""
from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..case import Case, poison, random_array
from ..layout import (Dim, Layout, grid_points, index_values, random_block_index, read_block,
                      write_block)

FOLDS = ["sum", "first", "max", "decay", "rescale"]


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  d = _draw(rng)
  written = _written(d)
  d["alias"] = [bool(not w.all() or rng.random() < 0.3) for w in written]
  x = random_array(data, d["x"].shape, d["dtype"])
  buffers = [poison(L.shape, dt) for L, dt, a in zip(d["outs"], _out_dtypes(d), d["alias"]) if a]
  return Case(family="accumulate", seed=-1, description=_describe(d),
              inputs=(x, *buffers), run=lambda api, *args: _run(api, d, args),
              model=lambda *args: _model(d, args),
              tolerance_scale=float(d["grid"][d["r"]]))


def _out_dtypes(d: dict[str, Any]) -> list[np.dtype]:
  return [np.dtype(d["dtype"]), np.dtype(np.int32)][:len(d["outs"])]


def _draw(rng: random.Random) -> dict[str, Any]:
  rank = rng.randint(1, 3)
  grid = tuple(rng.randint(1, 4) for _ in range(rank))
  r = rng.randrange(rank)
  grid = grid[:r] + (rng.randint(2, 4),) + grid[r + 1:]
  dtype = rng.choice(["float32", "float32", "int32"])
  fold = rng.choice([f for f in FOLDS if dtype == "float32" or f != "decay"])
  vis = [rng.choice([1, 2, 3, 4, 8]) for _ in range(rng.randint(1, 3))]
  k = rng.randrange(len(vis))                       # the dimension r walks
  others = [a for a in range(rank) if a != r]
  x_dims, o_dims, shape, o_shape = [], [], [], []
  for j, n in enumerate(vis):
    if j == k:
      expr = ("rev", r, rng.random() < 0.5) if rng.random() < 0.4 else ("lin", r, 1, 0)
      x_dims.append(Dim("blocked", n, expr))
      shape.append(grid[r] * n)
      o_dims.append(Dim("blocked", n, ("const", 0)))
      o_shape.append(n)
      continue
    expr = random_block_index(rng, [g if a in others else 1 for a, g in enumerate(grid)])
    if expr[0] not in ("const",) and (expr[1] == r or (expr[0] == "add" and expr[2] == r)):
      expr = ("const", 0)
    top = max(index_values(expr, grid))
    size = (top + 1) * n - (rng.randint(1, n - 1) if n > 1 and rng.random() < 0.4 else 0)
    x_dims.append(Dim("blocked", n, expr))
    o_dims.append(Dim("blocked", n, expr))
    shape.append(size)
    o_shape.append(size)
  inner = rng.choice(["none", "none", "keep", "squeeze"])
  inner_axis = None
  if inner != "none":
    inner_axis = rng.choice([j for j in range(len(vis)) if j == k or
                             shape[j] % vis[j] == 0])
    if shape[inner_axis] % vis[inner_axis]:
      inner = "none"
    elif inner == "keep":
      o_dims[inner_axis] = Dim("blocked", 1, o_dims[inner_axis].index)
      o_shape[inner_axis] = shape[inner_axis] // vis[inner_axis] if inner_axis != k else 1
    else:
      o_dims[inner_axis] = Dim("squeezed", 1, o_dims[inner_axis].index, "None")
      o_shape[inner_axis] = shape[inner_axis] // vis[inner_axis] if inner_axis != k else 1
  x = Layout(tuple(shape), tuple(x_dims))
  out = Layout(tuple(o_shape), tuple(o_dims))
  outs = [out]
  if rng.random() < 0.3:
    outs.append(out)                                # a step counter beside the fold
  return dict(grid=grid, r=r, dtype=dtype, fold=fold, x=x, outs=outs, inner=inner,
              inner_axis=inner_axis)


def _reduce(d: dict[str, Any], x: Any, xp: Any) -> Any:
  if d["inner"] == "none":
    return x
  return xp.sum(x, axis=d["inner_axis"], keepdims=d["inner"] == "keep")


def _written(d: dict[str, Any]) -> list[np.ndarray]:
  grid = d["grid"]
  written = [np.zeros(L.shape, bool) for L in d["outs"]]
  for ids in grid_points(grid):
    for w, L in zip(written, d["outs"]):
      write_block(w, L.window(ids, grid), True)
  return written


def _lowest(dtype: Any) -> Any:
  return -np.inf if np.dtype(dtype).kind == "f" else np.iinfo(dtype).min


def _fold(d: dict[str, Any], o: Any, x: Any, first: Any, last: Any, xp: Any) -> Any:
  """One step of the fold, for the model (NumPy, Python bools)."""
  fold = d["fold"]
  if fold == "sum" or fold == "rescale":
    o = (xp.zeros_like(x) if first else o) + x
    if fold == "rescale" and last:
      o = o * 2 - 1
    return o
  if fold == "first":
    return x if first else o + x
  if fold == "max":
    return xp.maximum(xp.full_like(x, _lowest(x.dtype)) if first else o, x)
  if fold == "decay":
    return (xp.zeros_like(x) if first else o) * 0.5 + x
  raise ValueError(fold)


def _model(d: dict[str, Any], args: tuple[np.ndarray, ...]) -> list[np.ndarray]:
  grid, r = d["grid"], d["r"]
  x = args[0].astype(np.float64 if d["dtype"] == "float32" else np.int32)
  dtypes = _out_dtypes(d)
  outs = [(poison(L.shape, dt).astype(x.dtype if j == 0 else dt) if a
           else np.zeros(L.shape, x.dtype if j == 0 else dt))
          for j, (L, dt, a) in enumerate(zip(d["outs"], dtypes, d["alias"]))]
  for ids in grid_points(grid):
    first, last = ids[r] == 0, ids[r] == grid[r] - 1
    xb = _reduce(d, read_block(x, d["x"].window(ids, grid))[0], np)
    window = d["outs"][0].window(ids, grid)
    ob = read_block(outs[0], window)[0]
    write_block(outs[0], window, _fold(d, ob, xb, first, last, np))
    if len(outs) > 1:
      cb = read_block(outs[1], window)[0]
      write_block(outs[1], window, (np.zeros_like(cb) if first else cb) + 1)
  return [o.astype(dt) for o, dt in zip(outs, dtypes)]


def _run(api: Any, d: dict[str, Any], args: tuple[Any, ...]) -> list[Any]:
  pl, grid, r, fold = api.pl, d["grid"], d["r"], d["fold"]
  n_out, n_buffers = len(d["outs"]), sum(d["alias"])

  def kernel(x_ref, *refs):
    o_ref, *count = refs[n_buffers:]
    step, steps = pl.program_id(r), pl.num_programs(r)
    x = _reduce(d, x_ref[...], jnp)
    if fold in ("sum", "rescale", "decay"):
      @pl.when(step == 0)
      def _():
        o_ref[...] = jnp.zeros_like(o_ref)
      o_ref[...] = (o_ref[...] * 0.5 if fold == "decay" else o_ref[...]) + x
      if fold == "rescale":
        @pl.when(step == steps - 1)
        def _():
          o_ref[...] = o_ref[...] * 2 - 1
    elif fold == "first":
      @pl.when(step == 0)
      def _():
        o_ref[...] = x

      @pl.when(step != 0)
      def _():
        o_ref[...] += x
    elif fold == "max":
      @pl.when(step == 0)
      def _():
        o_ref[...] = jnp.full(o_ref.shape, _lowest(o_ref.dtype), o_ref.dtype)
      o_ref[...] = jnp.maximum(o_ref[...], x)
    for c_ref in count:
      @pl.when(step == 0)
      def _():
        c_ref[...] = jnp.zeros_like(c_ref)
      c_ref[...] += 1

  in_specs = [d["x"].spec(pl, grid)]
  in_specs += [L.spec(pl, grid) for L, a in zip(d["outs"], d["alias"]) if a]
  out_specs = [L.spec(pl, grid) for L in d["outs"]]
  aliased = [j for j, a in enumerate(d["alias"]) if a]
  out_shape = [jax.ShapeDtypeStruct(L.shape, dt) for L, dt in zip(d["outs"], _out_dtypes(d))]
  call = api.pallas_call(kernel, out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
                         input_output_aliases={1 + k: j for k, j in enumerate(aliased)})
  return list(call(*args))


def _describe(d: dict[str, Any]) -> dict[str, Any]:
  return {"grid": d["grid"], "reduction_axis": d["r"], "dtype": d["dtype"], "fold": d["fold"],
          "in_block_reduction": (d["inner"], d["inner_axis"]), "x": d["x"].describe(),
          "outputs": [dict(L.describe(), aliased_to_poison=a)
                      for L, a in zip(d["outs"], d["alias"])]}

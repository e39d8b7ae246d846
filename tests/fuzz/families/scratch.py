"""Scratch carries under every `dimension_semantics`: a value carried in VMEM/SMEM
scratch along a carry axis (anywhere in the grid; axes after it get one scratch slot
per index), with the axes before it declared "parallel" or "arbitrary" (as strings in
either case, or pltpu's constants), all "arbitrary", or nothing declared.

Carries: a running prefix sum written every step; a total written on the last step
into a resident output; an SMEM step counter scaling the input; a ping-pong pair of
slots giving x[c] + x[c-1]. The model runs the row-major loop with the scratch as
Python state.
"""
from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..case import Case, random_array
from ..layout import Dim, Layout, grid_points, read_block, write_block

CARRIES = ["prefix", "total", "counter", "pingpong"]


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  d = _draw(rng)
  x = random_array(data, d["x"].shape, d["dtype"])
  return Case(family="scratch", seed=-1, description=_describe(d), inputs=(x,),
              run=lambda api, *args: _run(api, d, args), model=lambda x: _model(d, x),
              tolerance_scale=float(d["grid"][d["c"]]))


def _draw(rng: random.Random) -> dict[str, Any]:
  rank = rng.randint(1, 3)
  grid = [rng.randint(1, 3) for _ in range(rank)]
  c = rng.randrange(rank)
  grid[c] = rng.randint(2, 4)
  grid = tuple(grid)
  carry = rng.choice(CARRIES)
  dtype = rng.choice(["float32", "float32", "int32"])
  vis = [rng.choice([1, 2, 4, 8]) for _ in range(rng.randint(1, 2))]
  k = rng.randrange(len(vis))
  dims, shape = [], []
  axes = [a for a in range(rank) if a != c]
  rng.shuffle(axes)
  for j, n in enumerate(vis):
    if j == k:
      expr = ("rev", c, rng.random() < 0.5) if rng.random() < 0.3 else ("lin", c, 1, 0)
      dims.append(Dim("blocked", n, expr))
      shape.append(grid[c] * n)
    else:
      a = axes.pop() if axes else None
      expr = ("lin", a, 1, 0) if a is not None else ("const", 0)
      blocks = grid[a] if a is not None else 1
      edge = rng.randint(1, n - 1) if n > 1 and rng.random() < 0.3 else 0
      dims.append(Dim("blocked", n, expr))
      shape.append(blocks * n - edge)
  for a in axes:                                   # axes no dimension follows: squeezed
    dims.append(Dim("squeezed", 1, ("lin", a, 1, 0), rng.choice(["None", "Squeezed"])))
    shape.append(grid[a])
  x = Layout(tuple(shape), tuple(dims))
  if carry == "total":
    o_dims = tuple(Dim(dm.kind, dm.block, ("const", 0), dm.spelling) if j == k else dm
                   for j, dm in enumerate(dims))
    o_shape = tuple(vis[k] if j == k else s for j, s in enumerate(shape))
    out = Layout(o_shape, o_dims)
  else:
    out = x
  semantics = rng.choice(["none", "arbitrary", "parallel", "parallel", "mixed"])
  if semantics == "none":
    declared = None
  else:
    declared = []
    for a in range(rank):
      if a < c and semantics != "arbitrary":
        kind = "parallel" if semantics == "parallel" else rng.choice(["parallel", "arbitrary"])
      else:
        kind = "arbitrary"
      declared.append((kind, rng.choice(["lower", "upper", "constant"])))
  memory = "SMEM" if carry == "counter" else rng.choice(["VMEM", "VMEM", "SMEM"])
  slots = int(np.prod(grid[c + 1:]))
  whole = slots == 1 and carry in ("prefix", "total") and rng.random() < 0.6
  return dict(grid=grid, c=c, carry=carry, dtype=dtype, x=x, out=out, semantics=declared,
              memory=memory, slots=slots, whole=whole)


def _slot(ids: Any, grid: tuple[int, ...], c: int) -> Any:
  """The scratch slot of the axes after the carry axis (row-major)."""
  s = 0
  for a in range(c + 1, len(grid)):
    s = s * grid[a] + ids[a]
  return s


def _model(d: dict[str, Any], x: np.ndarray) -> np.ndarray:
  grid, c, carry = d["grid"], d["c"], d["carry"]
  compute = np.float64 if d["dtype"] == "float32" else np.int32
  x = x.astype(compute)
  out = np.zeros(d["out"].shape, compute)
  state: dict[Any, Any] = {}
  for ids in grid_points(grid):
    slot, step = _slot(ids, grid, c), ids[c]
    xb = read_block(x, d["x"].window(ids, grid))[0]
    window = d["out"].window(ids, grid)
    if carry in ("prefix", "total"):
      acc = (np.zeros_like(xb) if step == 0 else state[slot]) + xb
      state[slot] = acc
      if carry == "prefix" or step == grid[c] - 1:
        write_block(out, window, acc)
    elif carry == "counter":
      count = (0 if step == 0 else state[slot]) + 1
      state[slot] = count
      write_block(out, window, xb * count)
    else:
      previous = np.zeros_like(xb) if step == 0 else state[slot]
      state[slot] = xb
      write_block(out, window, xb + previous)
  return out.astype(d["dtype"])


def _semantics(api: Any, declared: list[tuple[str, str]] | None) -> dict[str, Any]:
  if declared is None:
    return {}
  spelled = []
  for kind, spelling in declared:
    if spelling == "constant":
      spelled.append(api.pltpu.PARALLEL if kind == "parallel" else api.pltpu.ARBITRARY)
    else:
      spelled.append(kind.upper() if spelling == "upper" else kind)
  return dict(compiler_params=api.pltpu.CompilerParams(dimension_semantics=tuple(spelled)))


def _run(api: Any, d: dict[str, Any], args: tuple[Any, ...]) -> Any:
  pl, pltpu = api.pl, api.pltpu
  grid, c, carry, slots = d["grid"], d["c"], d["carry"], d["slots"]
  dtype = jnp.dtype(d["dtype"])
  block = d["x"].visible_shape
  space = pltpu.SMEM if d["memory"] == "SMEM" else pltpu.VMEM

  def kernel(x_ref, o_ref, acc_ref):
    step = pl.program_id(c)
    # The scratch slot; one slot may be the whole buffer (acc_ref[...]).
    slot = ... if d["whole"] else _slot([pl.program_id(a) for a in range(len(grid))], grid, c)
    x = x_ref[...]
    if carry in ("prefix", "total"):
      @pl.when(step == 0)
      def _():
        acc_ref[slot] = jnp.zeros(block, dtype)
      acc_ref[slot] += x
      if carry == "prefix":
        o_ref[...] = acc_ref[slot]
      else:
        @pl.when(step == pl.num_programs(c) - 1)
        def _():
          o_ref[...] = acc_ref[slot]
    elif carry == "counter":
      @pl.when(step == 0)
      def _():
        acc_ref[slot] = 0
      acc_ref[slot] += 1
      o_ref[...] = x * acc_ref[slot].astype(dtype)
    else:
      mine, other = (slot * 2 + step % 2), (slot * 2 + (step + 1) % 2)

      @pl.when(step == 0)
      def _():
        acc_ref[other] = jnp.zeros(block, dtype)
      o_ref[...] = x + acc_ref[other]
      acc_ref[mine] = x

  if carry == "counter":
    scratch = space((slots,), jnp.int32)
  elif carry == "pingpong":
    scratch = space((2 * slots, *block), dtype)
  elif d["whole"]:
    scratch = space(block, dtype)
  else:
    scratch = space((slots, *block), dtype)
  call = api.pallas_call(
      kernel, jax.ShapeDtypeStruct(d["out"].shape, dtype), grid=grid,
      in_specs=[d["x"].spec(pl, grid)], out_specs=d["out"].spec(pl, grid),
      scratch_shapes=[scratch], **_semantics(api, d["semantics"]))
  return call(*args)


def _describe(d: dict[str, Any]) -> dict[str, Any]:
  return {"grid": d["grid"], "carry_axis": d["c"], "carry": d["carry"], "dtype": d["dtype"],
          "scratch": d["memory"], "whole_scratch": d["whole"], "dimension_semantics": d["semantics"],
          "x": d["x"].describe(), "out": d["out"].describe()}

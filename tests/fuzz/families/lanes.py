"""Per-row statistics kept lane-wide in scratch, as TPU kernels keep them (flash and
splash attention's running max and sum): the scratch holds the block with its carry
dimension replaced by L lanes; every step adds the block's sum along that dimension
to the lanes (all of them, or lane 0 only), and the output is the block plus the sum
over the lanes. Grids, layouts, semantics and scratch slots are drawn as the scratch
family draws them. On the XLA backend the all-lanes form is carried one lane wide
(replicated_scratch); the lane-0 form must not be. The model runs the row-major loop.
"""
from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..case import Case, random_array
from ..layout import grid_points, read_block, write_block
from . import scratch

LANES = [2, 8, 128]
WRITES = ["all lanes", "all lanes", "lane 0"]


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  d = scratch._draw(rng)
  d.update(out=d["x"], lanes=rng.choice(LANES), write=rng.choice(WRITES),
           k=_carry_dim(d), whole=d["slots"] == 1 and rng.random() < 0.6)
  x = random_array(data, d["x"].shape, d["dtype"])
  return Case(family="lanes", seed=-1, description=_describe(d), inputs=(x,),
              run=lambda api, *args: _run(api, d, args), model=lambda x: _model(d, x),
              tolerance_scale=float(d["grid"][d["c"]] * d["lanes"]))


def _carry_dim(d: dict[str, Any]) -> int:
  """The block dimension that moves with the carry axis (never at an array edge)."""
  return next(j for j, dim in enumerate(d["x"].dims)
              if dim.kind == "blocked" and dim.index[0] in ("lin", "rev") and dim.index[1] == d["c"])


def _lanes_shape(d: dict[str, Any]) -> tuple[int, ...]:
  block = d["x"].visible_shape
  return tuple(d["lanes"] if j == d["k"] else n for j, n in enumerate(block))


def _model(d: dict[str, Any], x: np.ndarray) -> np.ndarray:
  grid, c, k = d["grid"], d["c"], d["k"]
  compute = np.float64 if d["dtype"] == "float32" else np.int64
  x = x.astype(compute)
  out = np.zeros(d["out"].shape, compute)
  state: dict[Any, np.ndarray] = {}
  lane0 = tuple(slice(0, 1) if j == k else slice(None) for j in range(len(_lanes_shape(d))))
  for ids in grid_points(grid):
    slot, step = scratch._slot(ids, grid, c), ids[c]
    xb = read_block(x, d["x"].window(ids, grid))[0]
    lanes = np.zeros(_lanes_shape(d), compute) if step == 0 else state[slot]
    new = lanes + xb.sum(axis=k, keepdims=True)
    if d["write"] == "lane 0":
      lanes = lanes.copy()
      lanes[lane0] = new[lane0]
    else:
      lanes = new
    state[slot] = lanes
    write_block(out, d["out"].window(ids, grid), xb + lanes.sum(axis=k, keepdims=True))
  return out.astype(d["dtype"])


def _run(api: Any, d: dict[str, Any], args: tuple[Any, ...]) -> Any:
  pl, pltpu = api.pl, api.pltpu
  grid, c, k, slots = d["grid"], d["c"], d["k"], d["slots"]
  dtype = jnp.dtype(d["dtype"])
  shape = _lanes_shape(d)
  space = pltpu.SMEM if d["memory"] == "SMEM" else pltpu.VMEM
  lane0 = tuple(slice(0, 1) if j == k else slice(None) for j in range(len(shape)))

  def kernel(x_ref, o_ref, acc_ref):
    step = pl.program_id(c)
    slot = () if d["whole"] else (
        scratch._slot([pl.program_id(a) for a in range(len(grid))], grid, c),)
    x = x_ref[...]

    @pl.when(step == 0)
    def _():
      acc_ref[slot + (...,)] = jnp.zeros(shape, dtype)
    new = acc_ref[slot + (...,)] + jnp.broadcast_to(x.sum(axis=k, keepdims=True), shape)
    if d["write"] == "lane 0":
      acc_ref[slot + lane0] = new[lane0]
    else:
      acc_ref[slot + (...,)] = new
    o_ref[...] = x + acc_ref[slot + (...,)].sum(axis=k, keepdims=True)

  buffer = space(shape if d["whole"] else (slots, *shape), dtype)
  call = api.pallas_call(
      kernel, jax.ShapeDtypeStruct(d["out"].shape, dtype), grid=grid,
      in_specs=[d["x"].spec(pl, grid)], out_specs=d["out"].spec(pl, grid),
      scratch_shapes=[buffer], **scratch._semantics(api, d["semantics"]))
  return call(*args)


def _describe(d: dict[str, Any]) -> dict[str, Any]:
  return {"grid": d["grid"], "carry_axis": d["c"], "lanes": d["lanes"], "write": d["write"],
          "dtype": d["dtype"], "scratch": d["memory"], "whole_scratch": d["whole"],
          "dimension_semantics": d["semantics"], "x": d["x"].describe()}

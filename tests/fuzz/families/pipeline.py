"""emit_pipeline (TPU style; not on the Triton backend): a pipeline over `pl.ANY`
operands inside a `pallas_call`, run once, or once per step of an outer grid of 1-3
steps on `.at[pl.ds(...)]` row windows (forwards or reversed), or nested inside an
outer `emit_pipeline` whose block specs are VMEM blocks or `memory_space=pl.ANY`
windows. The inner pipeline either maps blocks (index maps forwards, reversed with
`pl.num_programs` or literal sizes) computing `2 x + program_id(0)`, or reduces over
its last axis into a revisited output block (zeroed when `pl.program_id(1) == 0`).

The model simulates the inner grid on each window with NumPy. JAX's TPU interpreter
refuses `pl.ANY` block specs in `emit_pipeline`: there pallet must match the model, or
refuse too (the runner counts a case both refuse as skipped).
"""
from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..case import Case, random_array
from ..layout import Dim, Layout, grid_points, read_block, write_block


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  kind = rng.choice(["map", "map", "reduce"])
  rank = 1 if kind == "map" and rng.random() < 0.3 else 2
  grid = tuple(rng.randint(1, 3) for _ in range(rank))
  if kind == "reduce":
    grid = (grid[0], rng.randint(2, 3))
  block = (rng.choice([1, 2, 8]), rng.choice([1, 4, 128]))

  def walk(axis: int) -> tuple:
    r = rng.random()
    if r < 0.4:
      return ("rev", axis, rng.random() < 0.7)
    return ("lin", axis, 1, 0)

  if kind == "map":
    col_expr = walk(1) if rank == 2 else ("const", 0)
    in_layout = Layout((grid[0] * block[0], (grid[1] if rank == 2 else 1) * block[1]),
                       (Dim("blocked", block[0], walk(0)), Dim("blocked", block[1], col_expr)))
    out_cols = col_expr if rng.random() < 0.5 else (("lin", 1, 1, 0) if rank == 2 else ("const", 0))
    out_layout = Layout(in_layout.shape, (Dim("blocked", block[0], ("lin", 0, 1, 0)),
                                          Dim("blocked", block[1], out_cols)))
  else:
    in_layout = Layout((grid[0] * block[0], grid[1] * block[1]),
                       (Dim("blocked", block[0], walk(0)), Dim("blocked", block[1], walk(1))))
    out_layout = Layout((grid[0] * block[0], block[1]),
                        (Dim("blocked", block[0], ("lin", 0, 1, 0)),
                         Dim("blocked", block[1], ("const", 0))))
  outer = rng.choice(["none", "window", "grid", "grid", "nested"])
  steps = rng.randint(1, 3) if outer in ("grid", "nested") else 1
  d = dict(kind=kind, grid=grid, block=block, ins=in_layout, outs=out_layout, outer=outer,
           steps=steps, reverse_outer=outer == "grid" and rng.random() < 0.4,
           nested_space=rng.choice(["VMEM", "ANY"]) if outer == "nested" else None,
           dtype=rng.choice(["float32", "int32"]))
  rows_in, cols_in = in_layout.shape
  x = random_array(data, (steps * rows_in, cols_in), d["dtype"])
  description = dict(kind=kind, inner_grid=grid, block=block, inner_in=in_layout.describe(),
                     inner_out=out_layout.describe(), outer=outer, outer_steps=steps,
                     reverse_outer=d["reverse_outer"], nested_space=d["nested_space"],
                     dtype=d["dtype"])
  return Case(family="pipeline", seed=-1, description=description, inputs=(x,),
              run=lambda api, x: _run(api, d, x), model=lambda x: _model(d, x),
              tpu_interpreter=True,
              may_refuse=("an emit_pipeline block spec in pl.ANY" if d["nested_space"] == "ANY"
                          else None),
              triton="emit_pipeline is TPU memory movement (a lowering error on Triton)",
              tolerance_scale=float(grid[-1]))


def _inner_model(d: dict[str, Any], x: np.ndarray, out: np.ndarray) -> None:
  grid = d["grid"]
  for ids in grid_points(grid):
    xb = read_block(x, d["ins"].window(ids, grid))[0]
    window = d["outs"].window(ids, grid)
    if d["kind"] == "map":
      write_block(out, window, xb * 2 + ids[0])
    else:
      current = read_block(out, window)[0]
      write_block(out, window, (0 if ids[1] == 0 else current) + xb)


def _model(d: dict[str, Any], x: np.ndarray) -> np.ndarray:
  rows_in, rows_out = d["ins"].shape[0], d["outs"].shape[0]
  compute = np.float64 if d["dtype"] == "float32" else np.int32
  x = x.astype(compute)
  out = np.zeros((d["steps"] * rows_out, d["outs"].shape[1]), compute)
  for p in range(d["steps"]):
    w = d["steps"] - 1 - p if d["reverse_outer"] else p
    window = out[w * rows_out:(w + 1) * rows_out]
    _inner_model(d, x[w * rows_in:(w + 1) * rows_in], window)
  return out.astype(d["dtype"])


def _run(api: Any, d: dict[str, Any], x: Any) -> Any:
  pl, pltpu, grid = api.pl, api.pltpu, d["grid"]
  dtype = jnp.dtype(d["dtype"])
  rows_in, rows_out = d["ins"].shape[0], d["outs"].shape[0]
  kind, steps = d["kind"], d["steps"]

  def body(x_blk, o_blk):
    if kind == "map":
      o_blk[...] = x_blk[...] * 2 + pl.program_id(0).astype(dtype)
    else:
      @pl.when(pl.program_id(1) == 0)
      def _():
        o_blk[...] = jnp.zeros_like(o_blk)
      o_blk[...] += x_blk[...]

  inner = pltpu.emit_pipeline(body, grid=grid, in_specs=[d["ins"].spec(pl, grid)],
                              out_specs=[d["outs"].spec(pl, grid)])

  def windows(x_ref, o_ref, w):
    return (x_ref.at[pl.ds(w * rows_in, rows_in)], o_ref.at[pl.ds(w * rows_out, rows_out)])

  def kernel(x_ref, o_ref):
    outer = d["outer"]
    if outer == "none":
      inner(x_ref, o_ref)
    elif outer == "window":
      inner(*windows(x_ref, o_ref, 0))
    elif outer == "grid":
      p = pl.program_id(0)
      inner(*windows(x_ref, o_ref, steps - 1 - p if d["reverse_outer"] else p))
    else:
      space = {"memory_space": pl.ANY} if d["nested_space"] == "ANY" else {}
      in_cols, out_cols = d["ins"].shape[1], d["outs"].shape[1]
      outer_pipeline = pltpu.emit_pipeline(
          lambda xb, ob: inner(xb, ob), grid=(steps,),
          in_specs=[pl.BlockSpec((rows_in, in_cols), lambda s: (s, 0), **space)],
          out_specs=[pl.BlockSpec((rows_out, out_cols), lambda s: (s, 0), **space)])
      outer_pipeline(x_ref, o_ref)

  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  options = dict(in_specs=[any_spec], out_specs=any_spec)
  if d["outer"] == "grid":
    options["grid"] = (steps,)
  out_shape = jax.ShapeDtypeStruct((steps * rows_out, d["outs"].shape[1]), dtype)
  return api.pallas_call(kernel, out_shape, **options)(x)

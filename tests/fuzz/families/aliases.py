"""input_output_aliases: 1-2 outputs, each aliased to its own input (at a random
position among the operands, after scalar-prefetch operands when there are some),
updated in place on a subset of their blocks (strided or offset index maps, so most
blocks are never visited and must keep the input's values), with another input read
alongside; the aliased input is read through the same blocks, or not read at all (its
spec a block spec or `pl.ANY`); sometimes under `jax.jit` with the aliased arguments
donated. The model copies the aliased inputs and applies the block updates.
"""
from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..case import Case, random_array
from ..exprs import evaluate, kernel_grid_value, model_grid_value, random_expr, show
from ..layout import (Dim, Layout, grid_points, index_values, random_layout, read_block,
                      write_block)


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  d = _draw(rng)
  arrays = []
  for kind, index in d["operands"]:
    if kind == "table":
      arrays.append(np.arange(8, dtype=np.int32))
    elif kind == "aliased":
      arrays.append(random_array(data, d["targets"][index].shape, d["dtype"]))
    else:
      arrays.append(random_array(data, d["other"].shape, d["dtype"]))
  return Case(family="aliases", seed=-1, description=_describe(d), inputs=tuple(arrays),
              run=lambda api, *args: _run(api, d, args), model=lambda *args: _model(d, args))


def _draw(rng: random.Random) -> dict[str, Any]:
  rank = rng.randint(1, 2)
  grid = tuple(rng.randint(1, 3) for _ in range(rank))
  dtype = rng.choice(["float32", "int32"])
  visible = tuple(rng.choice([1, 2, 4, 8]) for _ in range(rng.randint(1, 2)))
  n_out = rng.choice([1, 1, 2])
  targets = []
  for _ in range(n_out):
    dims = []
    axes = list(range(rank))
    rng.shuffle(axes)
    for n in visible:                       # injective: every visit is a new block
      a = axes.pop() if axes else None
      expr = (("const", rng.randint(0, 1)) if a is None
              else ("lin", a, rng.randint(1, 2), rng.randint(0, 2)))
      dims.append(Dim("blocked", n, expr))
    for a in axes:
      dims.insert(rng.randint(0, len(dims)), Dim("squeezed", 1, ("lin", a, 1, 0), "None"))
    shape = [dm.start(max(index_values(dm.index, grid))) + (1 + rng.randint(0, 2)) * dm.block
             for dm in dims]
    targets.append(Layout(tuple(shape), tuple(dims)))
  other = random_layout(rng, grid, visible, edges=False)
  reads = [rng.random() < 0.7 for _ in range(n_out)]
  spaces = [("block" if r else rng.choice(["block", "ANY"])) for r in reads]
  operands: list[tuple[str, int]] = [("other", 0)] + [("aliased", j) for j in range(n_out)]
  rng.shuffle(operands)
  prefetch = rng.random() < 0.25
  if prefetch:
    operands.insert(0, ("table", 0))
  exprs = [random_expr(rng, 2 if reads[j] else 1, rank, dtype == "int32", rng.randint(0, 2))
           for j in range(n_out)]
  return dict(grid=grid, dtype=dtype, targets=targets, other=other, reads=reads,
              spaces=spaces, operands=operands, prefetch=prefetch, exprs=exprs,
              jit=rng.choice(["none", "jit", "donate"]))


def _model(d: dict[str, Any], args: tuple[np.ndarray, ...]) -> list[np.ndarray]:
  grid = d["grid"]
  compute = np.float64 if d["dtype"] == "float32" else np.int32
  by_kind = {(k, i): a.astype(compute) for (k, i), a in zip(d["operands"], args)}
  other = by_kind[("other", 0)]
  outs = [by_kind[("aliased", j)].copy() for j in range(len(d["targets"]))]
  for ids in grid_points(grid):
    y = read_block(other, d["other"].window(ids, grid))[0]
    for j, (L, expr) in enumerate(zip(d["targets"], d["exprs"])):
      window = L.window(ids, grid)
      blocks = [y, read_block(by_kind[("aliased", j)], window)[0]]
      value = evaluate(expr, blocks, np, model_grid_value(ids, grid, compute))
      write_block(outs[j], window, np.asarray(value, compute))
  return [o.astype(d["dtype"]) for o in outs]


def _run(api: Any, d: dict[str, Any], args: tuple[Any, ...]) -> list[Any]:
  pl, grid = api.pl, d["grid"]
  dtype = jnp.dtype(d["dtype"])
  operands = [op for op in d["operands"] if op[0] != "table"]
  n_prefetch = 1 if d["prefetch"] else 0
  position = {op: n_prefetch + k for k, op in enumerate(operands)}

  def kernel(*refs):
    refs = refs[n_prefetch:]
    ins, outs = refs[:len(operands)], refs[len(operands):]
    y = ins[operands.index(("other", 0))][...]
    for j, (o_ref, expr) in enumerate(zip(outs, d["exprs"])):
      blocks = [y] + ([ins[operands.index(("aliased", j))][...]] if d["reads"][j] else [])
      value = evaluate(expr, blocks, jnp, kernel_grid_value(pl, dtype))
      o_ref[...] = jnp.broadcast_to(jnp.asarray(value).astype(o_ref.dtype), o_ref.shape)

  in_specs = []
  for kind, j in operands:
    if kind == "other":
      in_specs.append(d["other"].spec(pl, grid))
    elif d["spaces"][j] == "ANY":
      in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    else:
      in_specs.append(d["targets"][j].spec(pl, grid))
  out_specs = [L.spec(pl, grid) for L in d["targets"]]
  out_shape = [jax.ShapeDtypeStruct(L.shape, dtype) for L in d["targets"]]
  aliases = {position[("aliased", j)]: j for j in range(len(d["targets"]))}
  if d["prefetch"]:   # index maps get the (unused) table after the grid indices
    options = dict(grid_spec=api.pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=out_specs))
  else:
    options = dict(grid=grid, in_specs=in_specs, out_specs=out_specs)
  call = api.pallas_call(kernel, out_shape, input_output_aliases=aliases, **options)
  if d["jit"] == "jit":
    call = jax.jit(call)
  elif d["jit"] == "donate":
    call = jax.jit(call, donate_argnums=tuple(aliases))
  return list(call(*args))


def _describe(d: dict[str, Any]) -> dict[str, Any]:
  return {"grid": d["grid"], "dtype": d["dtype"], "operands": d["operands"],
          "jit": d["jit"], "other": d["other"].describe(),
          "outputs": [dict(L.describe(), reads_aliased_input=r, aliased_spec=s,
                           value=show(e).replace("x0", "other").replace("x1", "aliased"))
                      for L, r, s, e in zip(d["targets"], d["reads"], d["spaces"], d["exprs"])]}

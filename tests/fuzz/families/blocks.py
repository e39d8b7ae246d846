"""Grids and blocks: random grids (rank 0-3), block shapes with edge blocks, revisits
(clamped, modulo, divided, summed, reversed index maps), `pl.Element` windows and
squeezed dimensions (`None`, `pl.Squeezed()`, `pl.squeezed`), 1-3 inputs and 1-2
outputs computing an elementwise expression (with program ids) of the input blocks.

The model walks the grid in row-major order, reading each input's window (elements
outside the array are marked unspecified) and writing each output's window. A draw is
kept only if no program stores a value computed from an unspecified element into an
in-range output element, even one a later program overwrites (the checking mode,
`PALLET_CHECKS=1`, reports such a store where it happens); outputs not covered wholly
are aliased to a poisoned input (NaN / INT_MIN), so what the kernel leaves unwritten is
compared too.
"""
from __future__ import annotations

import random
from typing import Any

import jax
import numpy as np

from ..case import Case, poison, random_array
from ..exprs import (evaluate, inputs_used, kernel_grid_value, model_dtype, model_grid_value,
                     random_expr, show)
from ..layout import grid_points, random_layout, read_block, write_block

DTYPES = ["float32"] * 5 + ["int32"] * 3 + ["bfloat16", "float16"]


def generate(rng: random.Random, data: np.random.Generator, *, prefetch: bool = False) -> Case:
  for _ in range(100):
    d = _draw(rng, prefetch)
    written, padded = _coverage(d)
    if not any(p.any() for p in padded):
      break
  else:
    raise AssertionError("blocks: no valid draw in 100 tries")
  d["alias"] = [bool(not w.all() or rng.random() < 0.3) for w in written]
  dtype = np.dtype(jax.numpy.dtype(d["dtype"]))
  inputs = [random_array(data, L.shape, dtype) for L in d["ins"]]
  buffers = [poison(L.shape, dtype) for L, a in zip(d["outs"], d["alias"]) if a]
  low_precision = dtype.name in ("bfloat16", "float16")
  return Case(
      family="blocks", seed=-1, description=_describe(d),
      inputs=tuple(d["tables"] + inputs + buffers),
      run=lambda api, *args: _run(api, d, args),
      model=lambda *args: _model(d, args),
      triton=None, tolerance_scale=4.0 if low_precision else 1.0)


def _draw(rng: random.Random, prefetch: bool) -> dict[str, Any]:
  rank = rng.choice([1, 1, 2, 2, 3] if prefetch else [0, 1, 1, 2, 2, 2, 3])
  grid = tuple(rng.randint(1, 4) for _ in range(rank))
  tables = []
  if prefetch:       # block indices and values read from scalar-prefetch operands
    for _ in range(rng.randint(1, 2)):
      length, top = rng.randint(4, 6), rng.randint(1, 4)
      tables.append(np.array([rng.randrange(top) for _ in range(length)], np.int32))
  dtype = rng.choice(DTYPES)
  visible = tuple(rng.choice([1, 2, 3, 4, 5, 8]) for _ in range(rng.randint(1, 3)))
  n_in, n_out = rng.randint(1, 3), rng.choice([1, 1, 2])
  low = dtype in ("bfloat16", "float16")
  ins = [random_layout(rng, grid, visible, tables=tables) for _ in range(n_in)]
  outs = [random_layout(rng, grid, visible, tables=tables) for _ in range(n_out)]
  # A value read from a table in the body: table t at program_id(a).
  term = (rng.randrange(len(tables)), rng.randrange(rank)) if tables else None
  exprs = [random_expr(rng, n_in, rank, dtype == "int32", rng.randint(0, 1 if low else 3),
                       uses_all=(j == 0)) for j in range(n_out)]
  return dict(grid=grid, dtype=dtype, ins=ins, outs=outs, exprs=exprs, tables=tables,
              term=term, grid_spelling=rng.choice(
                  ["tuple", "int" if rank == 1 else "tuple", "GridSpec"]))


def _coverage(d: dict[str, Any]) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Per output: which elements some program writes, and which some program writes
  with a value computed from elements outside an input (unspecified). The second is
  every such store, not only the last one at each element: a store a later program
  overwrites still puts unspecified values where the array holds data."""
  grid = d["grid"]
  written = [np.zeros(L.shape, bool) for L in d["outs"]]
  padded = [np.zeros(L.shape, bool) for L in d["outs"]]
  tables = d["tables"]
  for ids in grid_points(grid):
    outside = [read_block(np.zeros(L.shape, np.int8), L.window(ids, grid, tables))[1]
               for L in d["ins"]]
    for j, (L, expr) in enumerate(zip(d["outs"], d["exprs"])):
      bad = np.zeros(L.visible_shape, bool)
      for i in inputs_used(expr):
        bad = bad | outside[i]
      stored = np.zeros(L.shape, bool)
      write_block(written[j], L.window(ids, grid, tables), True, (stored, bad))
      padded[j] |= stored
  return written, padded


def _model(d: dict[str, Any], args: tuple[np.ndarray, ...]) -> list[np.ndarray]:
  grid, dtype = d["grid"], np.dtype(jax.numpy.dtype(d["dtype"]))
  compute = model_dtype(dtype)
  tables = list(args[:len(d["tables"])])
  inputs = [x.astype(compute) for x in args[len(tables):len(tables) + len(d["ins"])]]
  outs = [(poison(L.shape, compute) if a else np.zeros(L.shape, compute))
          for L, a in zip(d["outs"], d["alias"])]
  for ids in grid_points(grid):
    blocks = [read_block(x, L.window(ids, grid, tables))[0] for x, L in zip(inputs, d["ins"])]
    for j, (L, expr) in enumerate(zip(d["outs"], d["exprs"])):
      value = evaluate(expr, blocks, np, model_grid_value(ids, grid, compute))
      if d["term"] is not None:
        t, a = d["term"]
        value = value + np.asarray(tables[t][ids[a]], compute)
      write_block(outs[j], L.window(ids, grid, tables), np.asarray(value, compute))
  return [o.astype(dtype) for o in outs]


def _run(api: Any, d: dict[str, Any], args: tuple[Any, ...]) -> list[Any]:
  pl, grid = api.pl, d["grid"]
  dtype = jax.numpy.dtype(d["dtype"])
  n_tables, n_in, n_out = len(d["tables"]), len(d["ins"]), len(d["outs"])
  n_buffers = sum(d["alias"])

  def kernel(*refs):
    table_refs, refs = refs[:n_tables], refs[n_tables:]
    in_refs, out_refs = refs[:n_in], refs[n_in + n_buffers:]
    blocks = [r[...] for r in in_refs]
    for o_ref, expr in zip(out_refs, d["exprs"]):
      value = evaluate(expr, blocks, jax.numpy, kernel_grid_value(pl, dtype))
      if d["term"] is not None:
        t, a = d["term"]
        value = value + table_refs[t][pl.program_id(a)].astype(dtype)
      o_ref[...] = jax.numpy.broadcast_to(jax.numpy.asarray(value).astype(o_ref.dtype),
                                          o_ref.shape)

  in_specs = [L.spec(pl, grid) for L in d["ins"]]
  in_specs += [L.spec(pl, grid) for L, a in zip(d["outs"], d["alias"]) if a]
  out_specs = [L.spec(pl, grid) for L in d["outs"]]
  aliased = [j for j, a in enumerate(d["alias"]) if a]
  aliases = {n_tables + n_in + k: j for k, j in enumerate(aliased)}
  out_shape = [jax.ShapeDtypeStruct(L.shape, dtype) for L in d["outs"]]
  if n_tables:
    options = dict(grid_spec=api.pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=n_tables, grid=grid, in_specs=in_specs, out_specs=out_specs))
  elif d["grid_spelling"] == "GridSpec":
    options = dict(grid_spec=pl.GridSpec(grid=grid, in_specs=in_specs, out_specs=out_specs))
  else:
    options = dict(grid=grid[0] if d["grid_spelling"] == "int" else grid,
                   in_specs=in_specs, out_specs=out_specs)
  call = api.pallas_call(kernel, out_shape, input_output_aliases=aliases, **options)
  return list(call(*args))


def _describe(d: dict[str, Any]) -> dict[str, Any]:
  return {"grid": d["grid"], "grid_spelling": d["grid_spelling"], "dtype": d["dtype"],
          "prefetch_tables": [t.tolist() for t in d["tables"]],
          "body_adds_table_at_program_id": d["term"],
          "inputs": [L.describe() for L in d["ins"]],
          "outputs": [dict(L.describe(), value=show(e), aliased_to_poison=a)
                      for L, e, a in zip(d["outs"], d["exprs"], d["alias"])]}

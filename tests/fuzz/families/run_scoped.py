"""pl.run_scoped: a chain of 1-3 stages, each transforming the block value through
refs that `run_scoped` allocates (VMEM, SMEM): staging through a scoped buffer,
returning a value from the scope, nested scopes, named (keyword) scoped refs, a scope
inside a `fori_loop` body, row-by-row writes through dynamic `pl.ds`, scopes in both
branches of a `lax.cond` on the program id, an SMEM scalar. Each stage's meaning is a
NumPy function the model chains.
"""
from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..case import Case, random_array
from ..layout import covering_layout, grid_points, read_block, write_block

STAGES = ["stage", "return", "nested", "named", "loop", "rows", "cond", "smem"]


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  rank = rng.randint(0, 2)
  grid = tuple(rng.randint(1, 3) for _ in range(rank))
  visible = tuple(rng.choice([1, 2, 3, 4, 8]) for _ in range(rng.randint(1, 2)))
  layout = covering_layout(rng, grid, visible)
  stages = [rng.choice([s for s in STAGES if grid or s != "cond"])
            for _ in range(rng.randint(1, 3))]
  d = dict(grid=grid, layout=layout, stages=stages, dtype=rng.choice(["float32", "int32"]),
           loops=rng.randint(1, 3), axis=rng.randrange(rank) if rank else None)
  x = random_array(data, layout.shape, d["dtype"])
  return Case(family="run_scoped", seed=-1,
              description=dict(grid=grid, dtype=d["dtype"], stages=stages, loop_trips=d["loops"],
                               cond_axis=d["axis"], layout=layout.describe()),
              inputs=(x,), run=lambda api, x: _run(api, d, x), model=lambda x: _model(d, x),
              # interpret=True loses the grid in a run_scoped body (pl.program_id there
              # fails); JAX's TPU interpreter keeps it.
              tpu_interpreter="smem" in stages)


def _stage_model(d: dict[str, Any], stage: str, v: np.ndarray, ids: tuple[int, ...]) -> np.ndarray:
  if stage == "stage":
    return v * 2 + 1
  if stage == "return":
    return (v + 1) * 3
  if stage == "nested":
    return v + v * 2
  if stage == "named":
    return v * (v + 1) if v.dtype.kind == "f" else v - (v + 1) * 2
  if stage == "loop":
    for i in range(d["loops"]):
      v = v * 2 - i
    return v
  if stage == "rows":
    rows = np.arange(v.shape[0]).reshape((-1,) + (1,) * (v.ndim - 1))
    return v * (rows + 1)
  if stage == "cond":
    return v + 5 if ids[d["axis"]] % 2 == 0 else v * 3
  if stage == "smem":
    return v * (sum(ids) + 1)
  raise ValueError(stage)


def _model(d: dict[str, Any], x: np.ndarray) -> np.ndarray:
  grid, layout = d["grid"], d["layout"]
  compute = np.float64 if d["dtype"] == "float32" else np.int32
  x = x.astype(compute)
  out = np.zeros(layout.shape, compute)
  for ids in grid_points(grid):
    window = layout.window(ids, grid)
    v = read_block(x, window)[0]
    for stage in d["stages"]:
      v = _stage_model(d, stage, v, ids)
    write_block(out, window, v)
  return out.astype(d["dtype"])


def _run(api: Any, d: dict[str, Any], x: Any) -> Any:
  pl, pltpu, grid = api.pl, api.pltpu, d["grid"]
  dtype = jnp.dtype(d["dtype"])
  shape = d["layout"].visible_shape
  vmem = pltpu.VMEM(shape, dtype)

  def stage(kind: str, v: Any) -> Any:
    if kind == "stage":
      def body(t):
        t[...] = v
        t[...] = t[...] * 2 + 1
        return t[...]
      return pl.run_scoped(body, vmem)
    if kind == "return":
      def body(t):
        t[...] = v + 1
        return t[...] * 3
      return pl.run_scoped(body, vmem)
    if kind == "nested":
      def outer(a):
        a[...] = v

        def inner(b):
          b[...] = a[...] * 2
          a[...] += b[...]
        pl.run_scoped(inner, vmem)
        return a[...]
      return pl.run_scoped(outer, vmem)
    if kind == "named":
      def body(p, q):
        p[...] = v
        q[...] = v + 1
        return p[...] * q[...] if dtype == jnp.float32 else p[...] - q[...] * 2
      return pl.run_scoped(body, p=vmem, q=vmem)
    if kind == "loop":
      def step(i, carry):
        def body(t):
          t[...] = carry * 2
          t[...] -= i.astype(dtype)
          return t[...]
        return pl.run_scoped(body, vmem)
      return lax.fori_loop(0, d["loops"], step, v)
    if kind == "rows":
      def body(t):
        def row(r, _):
          t[pl.ds(r, 1)] = v_ref_rows(r) * (r + 1).astype(dtype)
          return 0
        lax.fori_loop(0, shape[0], row, 0)
        return t[...]

      def v_ref_rows(r):
        return lax.dynamic_slice_in_dim(v, r, 1, axis=0)
      return pl.run_scoped(body, vmem)
    if kind == "cond":
      def even():
        def body(t):
          t[...] = v + 5
          return t[...]
        return pl.run_scoped(body, vmem)

      def odd():
        def body(t):
          t[...] = v * 3
          return t[...]
        return pl.run_scoped(body, vmem)
      return lax.cond(pl.program_id(d["axis"]) % 2 == 0, even, odd)
    if kind == "smem":
      def body(s):
        s[0] = sum((pl.program_id(a) for a in range(len(grid))), jnp.int32(0)) + 1
        return v * s[0].astype(dtype)
      return pl.run_scoped(body, pltpu.SMEM((1,), jnp.int32))
    raise ValueError(kind)

  def kernel(x_ref, o_ref):
    v = x_ref[...]
    for kind in d["stages"]:
      v = stage(kind, v)
    o_ref[...] = v

  spec = d["layout"].spec(pl, grid)
  return api.pallas_call(kernel, jax.ShapeDtypeStruct(d["layout"].shape, dtype), grid=grid,
                         in_specs=[spec], out_specs=spec)(x)

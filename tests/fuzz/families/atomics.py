"""GPU-style atomics with repeated indices: every program of a 1-2 axis grid applies
`plgpu.atomic_add/max/min/and/or/xor` to a shared output (aliased to random initial
values, its block the whole array), through integer-array indices (1-D, or row and
column arrays into a 2-D output) that repeat within a call and across programs,
overlapping `pl.ds` windows, a scalar index, or a row; with an optional mask. Where
every index is hit once in the whole grid, `atomic_xchg` and scalar `atomic_cas` join,
and the returned previous values are compared as a second output.

The model applies every lane's update in row-major program order. JAX's interpreter
is an oracle only where it is right: its discharge applies each repeated index of one
call once, has no masks, and only knows add, max and min.
"""
from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..case import Case, random_array

COMMUTATIVE = {"add": np.add, "max": np.maximum, "min": np.minimum,
               "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  rank = rng.randint(1, 2)
  grid = tuple(rng.randint(1, 4) for _ in range(rank))
  programs = int(np.prod(grid))
  dtype = rng.choice(["float32", "int32", "int32"])
  form = rng.choice(["array", "array", "array2d", "slice", "scalar", "row"])
  unique = form in ("array", "array2d") and rng.random() < 0.3
  ops = [o for o in COMMUTATIVE if dtype == "int32" or o in ("add", "max", "min")]
  if unique:
    ops += ["xchg", "xchg", "cas", "cas"]
  op = rng.choice(ops)
  if op == "cas":
    form = "scalar_unique"
  lanes = rng.choice([1, 2, 3, 4, 8])
  masked = op not in ("cas",) and rng.random() < 0.3
  if form == "array":
    size = programs * lanes + rng.randint(0, 3) if unique else rng.randint(1, 2 * lanes + 1)
    target = (size,)
  elif form == "array2d":
    target = ((programs * lanes) // 2 + 1, 2) if unique else (rng.randint(1, 4), rng.randint(1, 4))
  elif form == "slice":
    target = (lanes + rng.randint(0, 4),)
  elif form == "row":
    target = (rng.randint(1, 3), lanes + rng.randint(0, 2))
  elif form == "scalar_unique":
    target, lanes = (programs + rng.randint(0, 2),), 1
  else:
    target = (rng.randint(1, 3),)
  d = dict(grid=grid, programs=programs, dtype=dtype, form=form, unique=unique, op=op,
           lanes=lanes, masked=masked, target=target,
           spec=rng.choice(["full", "no_block_spec", "empty"]),
           parallel=rng.random() < 0.3, returns=unique or form == "scalar_unique")
  values = random_array(data, (programs, lanes), dtype)
  if op == "cas":
    values = random_array(data, (programs, 2), dtype)       # (cmp, new) per program
  init = random_array(data, target, dtype)
  index = _indices(d, data, rng)
  if op == "cas":        # half of the programs compare against the value they find
    for p in range(programs):
      if rng.random() < 0.5:
        values[p, 0] = init[int(index[p, 0])]
  d["index"] = index
  repeats = _repeats_within_a_call(d)
  jax_reason = None
  if op not in ("add", "max", "min"):
    jax_reason = f"JAX's interpreter has no discharge for atomic_{op}"
  elif masked:
    jax_reason = "JAX's interpreter has no masked atomics (NotImplementedError)"
  elif repeats:
    jax_reason = ("JAX's interpreter applies an index repeated within one atomic call "
                  "once (known JAX error; the model decides)")
  return Case(family="atomics", seed=-1, description=_describe(d),
              inputs=(values, index, init), run=lambda api, *a: _run(api, d, a),
              model=lambda *a: _model(d, a), jax_oracle=jax_reason,
              tolerance_scale=float(programs * lanes))


def _indices(d: dict[str, Any], data: np.random.Generator, rng: random.Random) -> np.ndarray:
  programs, lanes, target, form = d["programs"], d["lanes"], d["target"], d["form"]
  if form == "array":
    if d["unique"]:
      return data.permutation(target[0])[:programs * lanes].reshape(programs, lanes).astype(np.int32)
    return data.integers(0, target[0], (programs, lanes)).astype(np.int32)
  if form == "array2d":
    cells = target[0] * target[1]
    if d["unique"]:
      flat = data.permutation(cells)[:programs * lanes]
    else:
      flat = data.integers(0, cells, programs * lanes)
    return np.stack([flat // target[1], flat % target[1]]).reshape(2, programs, lanes).astype(np.int32)
  if form == "slice":
    return data.integers(0, target[0] - lanes + 1, (programs, 1)).astype(np.int32)
  if form == "row":
    return data.integers(0, target[0], (programs, 1)).astype(np.int32)
  if form == "scalar_unique":
    return data.permutation(target[0])[:programs].reshape(programs, 1).astype(np.int32)
  return data.integers(0, target[0], (programs, 1)).astype(np.int32)


def _repeats_within_a_call(d: dict[str, Any]) -> bool:
  index = d["index"]
  if d["form"] == "array":
    return any(len(set(row.tolist())) < len(row) for row in index)
  if d["form"] == "array2d":
    return any(len(set(zip(r.tolist(), c.tolist()))) < len(r) for r, c in zip(index[0], index[1]))
  return False


def _lane_targets(d: dict[str, Any], p: int) -> list[tuple[int, ...]]:
  """The element each lane of program p updates."""
  index, form, lanes = d["index"], d["form"], d["lanes"]
  if form == "array":
    return [(int(i),) for i in index[p]]
  if form == "array2d":
    return [(int(r), int(c)) for r, c in zip(index[0, p], index[1, p])]
  if form == "slice":
    return [(int(index[p, 0]) + k,) for k in range(lanes)]
  if form == "row":
    return [(int(index[p, 0]), k) for k in range(lanes)]
  return [(int(index[p, 0]),)]


def _model(d: dict[str, Any], args: tuple[np.ndarray, ...]) -> Any:
  values, _, init = args
  out = init.copy()
  old = np.zeros((d["programs"], d["lanes"]), init.dtype)
  for p in range(d["programs"]):
    if d["op"] == "cas":
      (k,) = _lane_targets(d, p)
      cmp, new = values[p]
      old[p, 0] = out[k]
      if out[k] == cmp:
        out[k] = new
      continue
    lane_values = [values[p].sum(dtype=values.dtype)] if d["form"] == "scalar" else values[p]
    for lane, (k, v) in enumerate(zip(_lane_targets(d, p), lane_values)):
      if d["masked"] and not v > 0:
        continue
      old[p, lane] = out[k]
      out[k] = v if d["op"] == "xchg" else COMMUTATIVE[d["op"]](out[k], v)
  return [out, old] if d["returns"] else [out]


def _run(api: Any, d: dict[str, Any], args: tuple[Any, ...]) -> Any:
  pl, plgpu, grid = api.pl, api.plgpu, d["grid"]
  form, op, lanes, rank = d["form"], d["op"], d["lanes"], len(d["grid"])
  dtype = jnp.dtype(d["dtype"])

  def flat_id(*ids):
    p = 0
    for a, i in enumerate(ids):
      p = p * grid[a] + i
    return p

  def kernel(v_ref, i_ref, init_ref, o_ref, *old_ref):
    p = flat_id(*(pl.program_id(a) for a in range(rank)))
    v = v_ref[...]
    mask = (v > 0) if d["masked"] else None
    if op == "cas":
      k = i_ref[0]
      previous = plgpu.atomic_cas(o_ref.at[k], v[0], v[1])
      old_ref[0][...] = jnp.broadcast_to(previous, (1,))
      return
    atomic = getattr(plgpu, f"atomic_{op}")
    if form == "array":
      previous = atomic(o_ref, (i_ref[...],), v, mask=mask)
    elif form == "array2d":
      previous = atomic(o_ref, (i_ref[0], i_ref[1]), v, mask=mask)
    elif form == "slice":
      previous = atomic(o_ref, (pl.ds(i_ref[0], lanes),), v, mask=mask)
    elif form == "row":
      previous = atomic(o_ref, (i_ref[0], pl.ds(0, lanes)), v, mask=mask)
    else:
      total = jnp.sum(v)
      previous = atomic(o_ref, (i_ref[0],), total, mask=(total > 0) if d["masked"] else None)
    if old_ref:
      if mask is not None:
        previous = jnp.where(mask, previous, jnp.zeros_like(previous))
      old_ref[0][...] = previous

  values_cols = 2 if op == "cas" else lanes
  index = d["index"]
  if form == "array2d":
    i_spec = pl.BlockSpec((2, None, lanes), lambda *ids: (0, flat_id(*ids), 0))
  else:
    i_spec = pl.BlockSpec((None, index.shape[1]), lambda *ids: (flat_id(*ids), 0))
  v_spec = pl.BlockSpec((None, values_cols), lambda *ids: (flat_id(*ids), 0))
  zeros = (0,) * len(d["target"])
  full = {"full": lambda: pl.BlockSpec(d["target"], lambda *ids: zeros),
          "no_block_spec": lambda: pl.no_block_spec, "empty": pl.BlockSpec}[d["spec"]]()
  out_shape = [jax.ShapeDtypeStruct(d["target"], dtype)]
  out_specs = [full]
  if d["returns"]:
    out_shape.append(jax.ShapeDtypeStruct((d["programs"], lanes), dtype))
    out_specs.append(pl.BlockSpec((None, lanes), lambda *ids: (flat_id(*ids), 0)))
  options = {}
  if d["parallel"]:
    options["compiler_params"] = api.pltpu.CompilerParams(
        dimension_semantics=("parallel",) * rank)
  call = api.pallas_call(kernel, out_shape, grid=grid, in_specs=[v_spec, i_spec, full],
                         out_specs=out_specs, input_output_aliases={2: 0}, **options)
  return list(call(*args))


def _describe(d: dict[str, Any]) -> dict[str, Any]:
  keys = ("grid", "dtype", "op", "form", "lanes", "masked", "unique", "target", "spec",
          "parallel", "returns")
  return {**{k: d[k] for k in keys}, "index": d["index"].tolist()}

"""Blocked matrix products as people write them: the k-loop matmul in its many spellings.

pallet's XLA backend rewrites the common forms (a reduction grid axis accumulating into
the output or into scratch) into one contraction; this family draws the forms around
them, so a rewrite that fires where it should not, or computes the wrong contraction,
shows. Drawn:

* where the reduction runs: a grid axis `k` (placed last, or between `i` and `j` so an
  output block comes back after others; visited forwards or reversed), or a loop in the
  body over whole-K blocks (`fori_loop` with static or `pl.num_programs`-derived bounds);
* the grid's order (`i, j` or `j, i`), an optional leading batch axis (squeezed or kept);
* operand layouts: `x` as (M, K) or (K, M), `y` as (K, N) or (N, K);
* the product's spelling: `jnp.dot` on transposed blocks, `@`, `lax.dot_general` with the
  layouts' dimension numbers, `jnp.einsum`;
* dtypes: float32, bfloat16 operands with float32 accumulation (output float32 or
  bfloat16), int8 operands with int32 accumulation;
* where the sum lives: the output itself or a VMEM scratch copied out (on the last step
  or every step);
* the fold: zeroed on the first step, set to the first product, started from a bias
  row, or an order-sensitive decay (`acc * 0.5 + p`); an epilogue on the last step
  (ReLU, `2x - 1`) or none.

M and N may end in partial blocks (not where a scratch sum carries from one output block
into the next: the padding would reach data); K is always whole (padding along a contraction is
unspecified in Pallas). The model runs the grid row-major in float64 (int64), the body
literally: scratch persists across steps, outputs are memory.
"""
from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..case import Case, random_array
from ..layout import grid_points

FOLDS = ["zero", "zero", "first", "bias", "decay"]
EPILOGUES = ["none", "none", "relu", "affine"]
SPELLINGS = ["dot", "matmul", "dot_general", "einsum"]


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  d = _draw(rng)
  in_dtype = {"float32": np.float32, "bfloat16": jnp.bfloat16, "int8": np.int8}[d["dtype"]]
  x = random_array(data, d["x_shape"], np.float32 if in_dtype is jnp.bfloat16 else in_dtype)
  y = random_array(data, d["y_shape"], np.float32 if in_dtype is jnp.bfloat16 else in_dtype)
  bias = random_array(data, (1, d["N"]), np.int32 if d["dtype"] == "int8" else np.float32)
  x, y = x.astype(in_dtype), y.astype(in_dtype)
  triton = None if min(d["bm"], d["bn"], d["bk"]) >= 16 else "tl.dot needs blocks of 16 or more"
  return Case(family="matmul", seed=-1, description=_describe(d), inputs=(x, y, bias),
              run=lambda api, *args: _run(api, d, args),
              model=lambda *args: _model(d, args), triton=triton,
              tolerance_scale=max(1.0, d["K"] / 16))


def _draw(rng: random.Random) -> dict[str, Any]:
  bm, bn, bk = (rng.choice([8, 16, 32]) for _ in range(3))
  gm, gn, gk = rng.randint(1, 3), rng.randint(1, 3), rng.randint(2, 4)
  M = gm * bm - (rng.randint(1, bm - 1) if rng.random() < 0.3 else 0)
  N = gn * bn - (rng.randint(1, bn - 1) if rng.random() < 0.3 else 0)
  K = gk * bk
  dtype = rng.choice(["float32", "float32", "bfloat16", "int8"])
  fold = rng.choice([f for f in FOLDS if dtype != "int8" or f != "decay"])
  where = rng.choice(["out", "scratch"])
  out_dtype = {"float32": "float32", "int8": "int32",
               "bfloat16": rng.choice(["float32", "bfloat16"])}[dtype]
  if out_dtype == "bfloat16":
    where = "scratch"                        # a bfloat16 output cannot hold the sum
  d = dict(bm=bm, bn=bn, bk=bk, M=M, N=N, K=K, gk=gk, dtype=dtype, out_dtype=out_dtype,
           fold=fold, where=where, epilogue=rng.choice(EPILOGUES),
           copy_every_step=where == "scratch" and rng.random() < 0.3,
           reduction=rng.choice(["grid", "grid", "grid", "loop"]),
           k_position=rng.choice(["last", "last", "middle"]), k_reversed=rng.random() < 0.3,
           loop_bound=rng.choice(["static", "traced"]),
           ij_order=rng.choice(["ij", "ij", "ji"]),
           batch=rng.choice([0, 0, 1, 2]), batch_squeezed=rng.random() < 0.7,
           x_layout=rng.choice(["mk", "mk", "km"]), y_layout=rng.choice(["kn", "kn", "nk"]),
           spelling=rng.choice(SPELLINGS))
  if dtype == "int8" and d["epilogue"] == "affine":
    d["epilogue"] = "relu"
  if where == "scratch" and d["reduction"] == "grid" and d["k_position"] == "middle":
    # One scratch then carries sums from one output block into the next: an edge
    # block's padding (unspecified) would reach elements that hold data.
    d["M"], d["N"] = M, N = gm * bm, gn * bn
  B = d["batch"]
  d["x_shape"] = ((B,) if B else ()) + ((M, K) if d["x_layout"] == "mk" else (K, M))
  d["y_shape"] = ((B,) if B else ()) + ((K, N) if d["y_layout"] == "kn" else (N, K))
  d["o_shape"] = ((B,) if B else ()) + (M, N)
  d["grid"], d["axes"] = _grid(d, gm, gn)
  return d


def _grid(d: dict[str, Any], gm: int, gn: int) -> tuple[tuple[int, ...], dict[str, int]]:
  """The grid and the position of each named axis in it ('b', 'i', 'j', 'k')."""
  names = ["i", "j"] if d["ij_order"] == "ij" else ["j", "i"]
  if d["reduction"] == "grid":
    names = names + ["k"] if d["k_position"] == "last" else [names[0], "k", names[1]]
  if d["batch"]:
    names = ["b"] + names
  sizes = {"b": d["batch"], "i": gm, "j": gn, "k": d["gk"]}
  return tuple(sizes[n] for n in names), {n: a for a, n in enumerate(names)}


# ------------------------------------------------------------------ the kernel
def _specs(pl: Any, d: dict[str, Any]) -> tuple[list[Any], Any]:
  """Block specs of x, y, bias and the output, from the draw."""
  ax, grid_k = d["axes"], d["reduction"] == "grid"
  bm, bn, bk, K = d["bm"], d["bn"], d["bk"], d["K"]

  def k_block(ids: tuple) -> Any:
    if not grid_k:
      return 0
    k = ids[ax["k"]]
    return pl.num_programs(ax["k"]) - 1 - k if d["k_reversed"] else k

  def lead(ids: tuple) -> tuple:
    return (ids[ax["b"]],) if d["batch"] else ()

  lead_block = ((None if d["batch_squeezed"] else 1),) if d["batch"] else ()
  kb = bk if grid_k else K
  x_block = (bm, kb) if d["x_layout"] == "mk" else (kb, bm)
  y_block = (kb, bn) if d["y_layout"] == "kn" else (bn, kb)

  def x_map(*ids):
    i, k = ids[ax["i"]], k_block(ids)
    return lead(ids) + ((i, k) if d["x_layout"] == "mk" else (k, i))

  def y_map(*ids):
    j, k = ids[ax["j"]], k_block(ids)
    return lead(ids) + ((k, j) if d["y_layout"] == "kn" else (j, k))

  def o_map(*ids):
    return lead(ids) + (ids[ax["i"]], ids[ax["j"]])

  in_specs = [pl.BlockSpec(lead_block + x_block, x_map),
              pl.BlockSpec(lead_block + y_block, y_map),
              pl.BlockSpec((1, bn), lambda *ids: (0, ids[ax["j"]]))]
  return in_specs, pl.BlockSpec(lead_block + (bm, bn), o_map)


def _product(d: dict[str, Any], x: Any, y: Any, acc_dtype: Any) -> Any:
  """x's block times y's block in the drawn spelling; (bm, bn) in acc_dtype."""
  pref = dict(preferred_element_type=acc_dtype)
  if d["spelling"] == "dot_general":
    cx = 1 if d["x_layout"] == "mk" else 0
    cy = 0 if d["y_layout"] == "kn" else 1
    return lax.dot_general(x, y, (((cx,), (cy,)), ((), ())), **pref)  # (M, N) either way
  if d["spelling"] == "einsum":
    xs = "mk" if d["x_layout"] == "mk" else "km"
    ys = "kn" if d["y_layout"] == "kn" else "nk"
    return jnp.einsum(f"{xs},{ys}->mn", x, y, **pref)
  x = x if d["x_layout"] == "mk" else x.T
  y = y if d["y_layout"] == "kn" else y.T
  if d["spelling"] == "matmul" and d["dtype"] == "float32":
    return x @ y
  return jnp.dot(x, y, **pref)


def _epilogue(d: dict[str, Any], v: Any, xp: Any) -> Any:
  if d["epilogue"] == "relu":
    return xp.maximum(v, 0)
  if d["epilogue"] == "affine":
    return v * 2 - 1
  return v


def _run(api: Any, d: dict[str, Any], args: tuple[Any, ...]) -> Any:
  pl, pltpu = api.pl, api.pltpu
  ax, grid = d["axes"], d["grid"]
  acc_dtype = jnp.int32 if d["dtype"] == "int8" else jnp.float32
  out_dtype = jnp.dtype(d["out_dtype"])
  bk, fold = d["bk"], d["fold"]

  def block(ref: Any) -> Any:
    return ref[0] if (d["batch"] and not d["batch_squeezed"]) else ref[...]

  def put(ref: Any, v: Any) -> None:
    if d["batch"] and not d["batch_squeezed"]:
      ref[0] = v
    else:
      ref[...] = v

  def whole_k_product(x_ref: Any, y_ref: Any) -> Any:
    """The loop form: a fori_loop over bk-wide slices of whole-K blocks."""
    x, y = block(x_ref), block(y_ref)
    steps = d["gk"] if d["loop_bound"] == "static" else (
        pl.num_programs(0) * 0 + d["gk"])

    def body(t, acc):
      s = pl.ds(pl.multiple_of(t * bk, bk), bk)
      xs = x[:, s] if d["x_layout"] == "mk" else x[s, :]
      ys = y[s, :] if d["y_layout"] == "kn" else y[:, s]
      p = _product(d, xs, ys, acc_dtype)
      if fold == "decay":
        return acc * 0.5 + p
      return acc + p
    init = jnp.zeros((d["bm"], d["bn"]), acc_dtype)
    return lax.fori_loop(0, steps, body, init)

  def kernel(x_ref, y_ref, b_ref, o_ref, *scratch):
    acc_ref = scratch[0] if scratch else o_ref
    read = (lambda: acc_ref[...]) if scratch else (lambda: block(o_ref))
    write = (lambda v: acc_ref.__setitem__(Ellipsis, v)) if scratch else (lambda v: put(o_ref, v))
    bias = b_ref[...].astype(acc_dtype)
    if d["reduction"] == "loop":
      total = whole_k_product(x_ref, y_ref)
      start = {"zero": 0, "first": 0, "decay": 0, "bias": None}[fold]
      total = total + bias if start is None else total
      put(o_ref, _epilogue(d, total, jnp).astype(out_dtype))
      return
    k = pl.program_id(ax["k"])
    last = pl.num_programs(ax["k"]) - 1
    p = _product(d, block(x_ref), block(y_ref), acc_dtype)
    if fold == "first":
      @pl.when(k == 0)
      def _():
        write(p)

      @pl.when(k != 0)
      def _():
        write(read() + p)
    else:
      @pl.when(k == 0)
      def _():
        write(jnp.broadcast_to(bias, (d["bm"], d["bn"])) if fold == "bias"
              else jnp.zeros((d["bm"], d["bn"]), acc_dtype))
      write(read() * 0.5 + p if fold == "decay" else read() + p)
    if scratch:
      def copy_out():
        put(o_ref, _epilogue(d, acc_ref[...], jnp).astype(out_dtype))
      if d["copy_every_step"] and d["epilogue"] == "none":
        copy_out()
      else:
        pl.when(k == last)(copy_out)
    elif d["epilogue"] != "none":
      @pl.when(k == last)
      def _():
        put(o_ref, _epilogue(d, block(o_ref), jnp))

  in_specs, out_spec = _specs(pl, d)
  scratch_shapes = ([pltpu.VMEM((d["bm"], d["bn"]), acc_dtype)]
                    if d["where"] == "scratch" and d["reduction"] == "grid" else [])
  call = api.pallas_call(kernel, jax.ShapeDtypeStruct(d["o_shape"], out_dtype), grid=grid,
                         in_specs=in_specs, out_specs=out_spec, scratch_shapes=scratch_shapes)
  return call(*args)


# ------------------------------------------------------------------ the model
def _model(d: dict[str, Any], args: tuple[np.ndarray, ...]) -> np.ndarray:
  wide = np.int64 if d["dtype"] == "int8" else np.float64
  x, y, bias = (np.asarray(a).astype(wide) for a in args)
  if not d["batch"]:
    x, y = x[None], y[None]
  if d["x_layout"] == "km":
    x = np.swapaxes(x, 1, 2)
  if d["y_layout"] == "nk":
    y = np.swapaxes(y, 1, 2)
  bm, bn, bk, gk = d["bm"], d["bn"], d["bk"], d["gk"]
  B = max(d["batch"], 1)
  # Padded operands: rows of x past M and columns of y past N read as zeros (they only
  # reach output elements past the array, which are dropped).
  Mp, Np = -(-d["M"] // bm) * bm, -(-d["N"] // bn) * bn
  xp = np.zeros((B, Mp, d["K"]), wide)
  xp[:, :d["M"]] = x
  yp = np.zeros((B, d["K"], Np), wide)
  yp[:, :, :d["N"]] = y
  bp = np.zeros((1, Np), wide)
  bp[:, :d["N"]] = bias
  out = np.zeros((B, Mp, Np), wide)
  acc = np.zeros((bm, bn), wide)                   # the scratch buffer, one for the grid
  ax, grid = d["axes"], d["grid"]
  for ids in grid_points(grid):
    b = ids[ax["b"]] if d["batch"] else 0
    i, j = ids[ax["i"]], ids[ax["j"]]
    rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
    bias_block = np.broadcast_to(bp[:, cols], (bm, bn))
    if d["reduction"] == "loop":
      total = np.zeros((bm, bn), wide)
      for t in range(gk):
        p = xp[b, rows, t * bk:(t + 1) * bk] @ yp[b, t * bk:(t + 1) * bk, cols]
        total = total * 0.5 + p if d["fold"] == "decay" else total + p
      if d["fold"] == "bias":
        total = total + bias_block
      out[b, rows, cols] = _epilogue(d, total, np)
      continue
    k = ids[ax["k"]]
    kb = gk - 1 - k if d["k_reversed"] else k
    p = xp[b, rows, kb * bk:(kb + 1) * bk] @ yp[b, kb * bk:(kb + 1) * bk, cols]
    cur = acc if d["where"] == "scratch" else out[b, rows, cols]
    if d["fold"] == "first":
      new = p if k == 0 else cur + p
    else:
      start = (bias_block if d["fold"] == "bias" else np.zeros((bm, bn), wide)) if k == 0 else cur
      new = start * 0.5 + p if d["fold"] == "decay" else start + p
    if d["where"] == "scratch":
      acc = new
      if (d["copy_every_step"] and d["epilogue"] == "none") or k == gk - 1:
        out[b, rows, cols] = _round(d, _epilogue(d, acc, np))
    else:
      out[b, rows, cols] = _epilogue(d, new, np) if k == gk - 1 else new
  out = out[:, :d["M"], :d["N"]]
  return (out if d["batch"] else out[0]).astype(jnp.dtype(d["out_dtype"]))


def _round(d: dict[str, Any], v: np.ndarray) -> np.ndarray:
  """The stored value, as the kernel's output dtype holds it (later read back as is)."""
  return v.astype(jnp.dtype(d["out_dtype"])).astype(v.dtype)


def _describe(d: dict[str, Any]) -> dict[str, Any]:
  keys = ["grid", "axes", "M", "N", "K", "bm", "bn", "bk", "dtype", "out_dtype", "reduction",
          "k_position", "k_reversed", "loop_bound", "ij_order", "batch", "batch_squeezed",
          "x_layout", "y_layout", "spelling", "where", "copy_every_step", "fold", "epilogue"]
  return {k: d[k] for k in keys}

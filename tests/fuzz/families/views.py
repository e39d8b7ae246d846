"""Loads and stores through ref views other than plain indexing: `ref.reshape(...)`,
`ref.bitcast(dtype)` and `.at[...]` chained in any order.

Every buffer of a case holds one block's bytes: the input `x` and the output `o`
(blocks of (R, C) 32-bit or (2R, C) 16-bit elements, R in 8/16, C in 128/256, moving
with the program id, reversed, or one whole-array block that every program revisits),
an optional VMEM scratch `s` (2-D or 3-D, written whole by every program or by the
first only, so it carries) and an optional `pl.run_scoped` buffer `t`. A program runs
1-3 statements (and maybe a run_scoped stage of two) that each read a source buffer
through one view chain and write a destination buffer through another:

* view chains of 0-4 steps: `.at[...]` (leading and column windows; static slices,
  `pl.ds` with static or program-id-derived starts, static or traced integer indices
  that drop a dimension), `.reshape(...)` to another power-of-two shape (rank 1-3) and
  `.bitcast(dtype)` among float32/int32/bfloat16/float16/int16: same width, or 16-bit
  rows packed in pairs into 32-bit rows (row 2k the low half) and back;
* the source view is conformed to the destination's shape and dtype through more
  view steps (a bitcast and a reshape of the source ref), never by value conversion;
* the write: whole-view or windowed stores, `+=` read-modify-writes, and row loops
  (`fori_loop` forwards or reversed, rows picked by `r` or `pl.ds(r, 1)`); the last
  `.at` spelled as `view[idx]` or `view.at[idx][...]`; sources and destinations may be
  the same buffer, read back through another view than the one written;
* the values: bit-exact ops (xor, wrapping add, add of the program id for integers;
  negation, doubling for floats), plus `+=` (integers add a value masked to 6 bits, so
  a sum of bit patterns stays a float in other views; floats round once, as the model).
  A draw where a float op of the model would meet or make an infinity, a NaN or a
  subnormal is drawn again (exact comparison cannot hold them; NaN payloads vary).

Data are bfloat16 bit patterns of normal numbers in every 16-bit unit, so every view of
them (float32, either half, float16, integers) is finite and normal, and outputs
compare exactly (tolerance 0). The output is aliased to a poisoned buffer whose 16-bit
units are 0xC2B7 (finite in every view). The model keeps each buffer as bytes and each
view as an array of byte offsets into it (NumPy slicing, reshape, and for a width
change the row-pair interleave of the TPU packing), reading and writing through those.
"""
from __future__ import annotations

import math
import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..case import Case

DTYPES = {32: ["float32", "int32"], 16: ["bfloat16", "float16", "int16"]}
ALL_DTYPES = DTYPES[32] + DTYPES[16]
POISON_UNIT = 0xC2B7
MIN_COUNT = 8


def _width(dtype: str) -> int:
  return 32 if dtype in DTYPES[32] else 16


def _np_dtype(dtype: str) -> np.dtype:
  return np.dtype(jnp.dtype(dtype))


def _is_int(dtype: str) -> bool:
  return dtype.startswith("int")


# ------------------------------------------------------------------ drawing views
class _Drawer:
  """Draws view chains; each chain is a list of steps:
  ("at", entries)   entries per leading dimension:
      ("all",) | ("slice", start, size, spelled_as_ds) | ("ds", a, b, m, size)
      | ("int", k) | ("intd", a, b, m)        with traced start (a * pid + b) % m
  ("reshape", shape) | ("bitcast", dtype)"""

  def __init__(self, rng: random.Random):
    self.rng = rng

  def entry(self, L: int, partial: bool, drop_ok: bool) -> tuple[tuple, int | None]:
    """An index entry for a dimension of size L: (entry, kept size or None if dropped)."""
    rng = self.rng
    if not partial:
      k = rng.choice(["all", "slice", "ds"])
      if k == "all":
        return ("all",), L
      if k == "slice":
        return ("slice", 0, L, rng.random() < 0.5), L
      return ("ds", rng.randint(1, 3), rng.randint(0, 3), 1, L), L
    k = rng.choice(["all", "slice", "ds", "ds", "int", "intd"])
    if k in ("int", "intd") and not drop_ok:
      k = "ds"
    if k == "all":
      return ("all",), L
    if k == "int":
      return ("int", rng.randrange(L)), None
    if k == "intd":
      return ("intd", rng.randint(1, 3), rng.randint(0, 3), L), None
    sizes = [1 << e for e in range(int(math.log2(L)) + 1)]
    n = rng.choice(sizes[-4:])
    if k == "slice":
      return ("slice", rng.randint(0, L - n), n, rng.random() < 0.5), n
    return ("ds", rng.randint(1, 3), rng.randint(0, 3), L - n + 1, n), n

  def at(self, shape: tuple[int, ...], partial: bool) -> tuple[tuple, tuple[int, ...]]:
    entries, new = [], []
    e, n = self.entry(shape[0], partial, drop_ok=len(shape) >= 2)
    entries.append(e)
    if n is not None:
      new.append(n)
    rest = list(shape[1:])
    if len(shape) >= 2 and self.rng.random() < 0.25:
      e, n = self.entry(shape[1], partial, drop_ok=False)
      entries.append(e)
      new.append(n)
      rest = rest[1:]
    return ("at", tuple(entries)), tuple(new + rest)

  def shape_of(self, count: int) -> tuple[int, ...]:
    exp = int(math.log2(count))
    rank = self.rng.choice([1, 2, 2, 3, 3])
    cuts = sorted(self.rng.randint(0, exp) for _ in range(rank - 1))
    parts = [b - a for a, b in zip([0] + cuts, cuts + [exp])]
    return tuple(1 << p for p in parts)

  def chain(self, shape: tuple[int, ...], dtype: str, partial: bool,
            steps: int | None = None) -> tuple[list, tuple[int, ...], str]:
    rng = self.rng
    chain: list = []
    for _ in range(rng.randint(0, 4) if steps is None else steps):
      kind = rng.choice(["at", "at", "reshape", "bitcast", "bitcast"])
      if kind == "at":
        step, new = self.at(shape, partial)
        if math.prod(new) < MIN_COUNT or not new:
          continue
        chain.append(step)
        shape = new
      elif kind == "reshape":
        new = self.shape_of(math.prod(shape))
        chain.append(("reshape", new))
        shape = new
      else:
        if len(shape) < 2:
          continue
        to = rng.choice([d for d in ALL_DTYPES if d != dtype])
        wf, wt = _width(dtype), _width(to)
        if wf < wt and shape[-2] % 2:
          continue
        chain.append(("bitcast", to))
        shape = shape[:-2] + (shape[-2] * wf // wt,) + shape[-1:]
        dtype = to
    return chain, shape, dtype


def _conform(chain: list, shape: tuple, dtype: str, want_shape: tuple, want_dtype: str) -> list:
  """`chain` continued by view steps to `want_shape` / `want_dtype` (same width, same count)."""
  chain = list(chain)
  if dtype != want_dtype:
    if len(shape) < 2:
      shape = want_shape if len(want_shape) >= 2 else (2, math.prod(shape) // 2)
      chain.append(("reshape", shape))
    chain.append(("bitcast", want_dtype))
  if shape != want_shape:
    chain.append(("reshape", want_shape))
  return chain


def _chain_out(chain: list, shape: tuple, dtype: str) -> tuple[tuple, str]:
  """The shape and dtype a chain gives (for checks)."""
  for step in chain:
    if step[0] == "at":
      new, dims = [], list(shape)
      for i, e in enumerate(step[1]):
        if e[0] == "all":
          new.append(dims[i])
        elif e[0] in ("slice", "ds"):
          new.append(e[2] if e[0] == "slice" else e[4])
      shape = tuple(new + dims[len(step[1]):])
    elif step[0] == "reshape":
      shape = step[1]
    else:
      wf, wt = _width(dtype), _width(step[1])
      shape = shape[:-2] + (shape[-2] * wf // wt,) + shape[-1:]
      dtype = step[1]
  return shape, dtype


def _source(dr: _Drawer, base: tuple, base_dtype: str, want_shape: tuple,
            want_dtype: str) -> list:
  """A chain on a source buffer ending at `want_shape` / `want_dtype`."""
  count = math.prod(want_shape)
  if dr.rng.random() < 0.75:
    for _ in range(60):
      chain, shape, dtype = dr.chain(base, base_dtype, partial=True)
      if math.prod(shape) == count and _width(dtype) == _width(want_dtype):
        return _conform(chain, shape, dtype, want_shape, want_dtype)
  # View the (bitcast) buffer as q blocks of the wanted shape and pick one.
  chain, shape = [], base
  if base_dtype != want_dtype:
    chain.append(("bitcast", want_dtype))
    shape = base[:-2] + (base[-2] * _width(base_dtype) // _width(want_dtype),) + base[-1:]
  q = math.prod(shape) // count
  if q == 1:
    return _conform(chain, shape, want_dtype, want_shape, want_dtype)
  chain.append(("reshape", (q,) + want_shape))
  e = ("int", dr.rng.randrange(q)) if dr.rng.random() < 0.5 else (
      "intd", dr.rng.randint(1, 3), dr.rng.randint(0, 3), q)
  chain.append(("at", (e,)))
  return chain


OPS_INT = [("none",), ("xor", 0), ("add", 0), ("add_pid", 0)]
OPS_FLOAT = [("none",), ("neg",), ("double",)]


def _op(rng: random.Random, dtype: str) -> tuple:
  op = rng.choice(OPS_INT if _is_int(dtype) else OPS_FLOAT)
  return (op[0], rng.randint(1, 31)) if len(op) > 1 else op


def _statement(dr: _Drawer, bufs: dict, src_names: list[str], dst: str, *,
               full: bool = False, kinds=("store", "store", "rmw", "rows")) -> dict:
  rng = dr.rng
  for _ in range(100):
    dbase, ddtype = bufs[dst]
    dchain, dshape, dd = dr.chain(dbase, ddtype, partial=not full)
    if math.prod(dshape) >= MIN_COUNT and dshape:
      break
  else:
    dchain, dshape, dd = [], dbase, ddtype
  src = rng.choice(src_names)
  schain = _source(dr, bufs[src][0], bufs[src][1], dshape, dd)
  kind = rng.choice(kinds)
  if kind == "rows" and not (len(dshape) >= 2 and dshape[0] <= 32):
    kind = "store"
  return dict(kind=kind, src=src, src_chain=schain, dst=dst, dst_chain=dchain,
              op=_op(rng, dd), direct=rng.random() < 0.5, reverse=rng.random() < 0.5,
              row_ds=rng.random() < 0.5, dtype=dd)


class _Unclean(Exception):
  """A float op of the model met or made a value that is not finite and normal."""


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  # Draws again (at most 30 times) where a float op would see or make an infinity, a
  # NaN or a subnormal (doublings, sums): those do not compare exactly, and NaN
  # payloads are not the model's to predict.
  for _ in range(30):
    d, x, poisoned = _draw(rng, data)
    try:
      _model(d, (x, poisoned), strict=True)
      break
    except _Unclean:
      continue
  return _case(d, x, poisoned)


def _draw(rng: random.Random, data: np.random.Generator) -> tuple[dict, np.ndarray, np.ndarray]:
  dr = _Drawer(rng)
  G = rng.randint(1, 4)
  R, C = rng.choice([8, 16]), rng.choice([128, 256])

  def block(dtype: str) -> tuple[int, int]:
    return (R if _width(dtype) == 32 else 2 * R, C)

  x_dtype, o_dtype = rng.choice(ALL_DTYPES), rng.choice(ALL_DTYPES)
  maps = {"x": rng.choice(["blocked", "blocked", "reversed", "whole"]),
          "o": rng.choice(["blocked", "blocked", "reversed", "whole"])}
  bufs = {"x": (block(x_dtype), x_dtype), "o": (block(o_dtype), o_dtype)}
  scratch = None
  if rng.random() < 0.5:
    s_dtype = rng.choice(ALL_DTYPES)
    r, c = block(s_dtype)
    scratch = rng.choice([(r, c), (2, r // 2, c), (r * c // 128, 128), (r // 2, 2, c)])
    bufs["s"] = (scratch, s_dtype)
  statements = []
  init_once = False
  if scratch is not None:
    init_once = G > 1 and rng.random() < 0.3
    statements.append(_statement(dr, bufs, ["x"], "s", full=True, kinds=("store", "rows")))
  readable = ["x", "o"] + (["s"] if scratch else [])
  writable = ["o", "o"] + (["s"] if scratch else [])
  for _ in range(rng.randint(1, 3)):
    statements.append(_statement(dr, bufs, readable, rng.choice(writable)))
  scoped = None
  if rng.random() < 0.35:
    t_dtype = rng.choice(ALL_DTYPES)
    r, c = block(t_dtype)
    t_shape = rng.choice([(r, c), (2, r // 2, c), (r * c // 128, 128)])
    bufs["t"] = (t_shape, t_dtype)
    first = _statement(dr, bufs, [n for n in readable if n != "o"] or ["x"], "t", full=True,
                       kinds=("store", "rows"))
    second = _statement(dr, bufs, ["t"], "o")
    scoped = dict(shape=t_shape, dtype=t_dtype, statements=[first, second])
  if all(s["dst"] != "o" for s in statements) and scoped is None:
    statements.append(_statement(dr, bufs, readable, "o"))

  d = dict(G=G, R=R, C=C, x_dtype=x_dtype, o_dtype=o_dtype, maps=maps, bufs=bufs,
           scratch=scratch, init_once=init_once, statements=statements, scoped=scoped)
  x = _normal_bits(data, _rows("x", d, block(x_dtype)), x_dtype)
  poisoned = _poison(_rows("o", d, block(o_dtype)), o_dtype)
  return d, x, poisoned


def _case(d: dict, x: np.ndarray, poisoned: np.ndarray) -> Case:
  statements, scoped = d["statements"], d["scoped"]
  every = statements + (scoped["statements"] if scoped else [])
  moved = any(st[0] in ("reshape", "bitcast") for s in every
              for st in s["src_chain"] + s["dst_chain"])
  written = any(st[0] in ("reshape", "bitcast") for s in every for st in s["dst_chain"])
  jax_reason = None
  if written and tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 11):
    jax_reason = ("JAX 0.10's interpreter cannot write through reshape/bitcast views "
                  "(Unsupported transform: ReshapeTransform / BitcastTransform)")
  triton = "the Triton backend refuses reshape/bitcast ref views" if moved else None
  return Case(family="views", seed=-1, description=_describe(d), inputs=(x, poisoned),
              run=lambda api, *a: _run(api, d, a), model=lambda *a: _model(d, a),
              jax_oracle=jax_reason, triton=triton, tolerance_scale=0.0)


def _rows(name: str, d: dict, blk: tuple[int, int]) -> tuple[int, int]:
  return (blk[0] * (1 if d["maps"][name] == "whole" else d["G"]), blk[1])


def _normal_bits(data: np.random.Generator, shape: tuple, dtype: str) -> np.ndarray:
  """Random values whose every 16-bit unit is a normal bfloat16 (so every view of
  them is finite and normal)."""
  units = math.prod(shape) * _width(dtype) // 16
  v = data.standard_normal(units)
  v = np.sign(v + (v == 0)) * np.clip(np.abs(v), 2.0 ** -10, 2.0 ** 10)
  bits = v.astype(jnp.bfloat16).view(np.uint16)
  return bits.view(_np_dtype(dtype)).reshape(shape)


def _poison(shape: tuple, dtype: str) -> np.ndarray:
  units = math.prod(shape) * _width(dtype) // 16
  return np.full(units, POISON_UNIT, np.uint16).view(_np_dtype(dtype)).reshape(shape)


# ------------------------------------------------------------------ the kernel
def _traced(pid: Any, a: int, b: int, m: int) -> Any:
  return (pid * a + b) % m


def _index(pl: Any, entries: tuple, pid: Any) -> tuple:
  out = []
  for e in entries:
    if e[0] == "all":
      out.append(slice(None))
    elif e[0] == "slice":
      _, s, n, as_ds = e
      out.append(pl.ds(s, n) if as_ds else slice(s, s + n))
    elif e[0] == "ds":
      _, a, b, m, n = e
      out.append(pl.ds(_traced(pid, a, b, m), n))
    elif e[0] == "int":
      out.append(e[1])
    else:
      out.append(_traced(pid, *e[1:]))
  return tuple(out)


def _view(pl: Any, ref: Any, chain: list, pid: Any) -> Any:
  for step in chain:
    if step[0] == "at":
      ref = ref.at[_index(pl, step[1], pid)]
    elif step[0] == "reshape":
      ref = ref.reshape(*step[1])
    else:
      ref = ref.bitcast(jnp.dtype(step[1]))
  return ref


def _apply_op(op: tuple, v: Any, dtype: Any, pid: Any, xp: Any) -> Any:
  kind = op[0]
  if kind == "xor":
    return v ^ xp.asarray(op[1], dtype)
  if kind == "add":
    return v + xp.asarray(op[1], dtype)
  if kind == "add_pid":
    return v + (xp.asarray(pid + op[1])).astype(dtype)
  if kind == "neg":
    return -v
  if kind == "double":
    return v * xp.asarray(2, dtype)
  return v


def _run_statement(pl: Any, s: dict, refs: dict, pid: Any) -> None:
  dtype = jnp.dtype(s["dtype"])
  src = _view(pl, refs[s["src"]], s["src_chain"], pid)
  dchain = s["dst_chain"]
  if s["kind"] == "rows":
    dst = _view(pl, refs[s["dst"]], dchain, pid)
    L = dst.shape[0]

    def row(r, carry):
      r = L - 1 - r if s["reverse"] else r
      i = pl.ds(r, 1) if s["row_ds"] else r
      dst[i] = _apply_op(s["op"], src[i], dtype, pid, jnp)
      return carry
    lax.fori_loop(0, L, row, 0)
    return
  schain = s["src_chain"]
  if s["direct"] and schain and schain[-1][0] == "at":
    read = _view(pl, refs[s["src"]], schain[:-1], pid)[_index(pl, schain[-1][1], pid)]
  else:
    read = src[...]
  v = _apply_op(s["op"], read, dtype, pid, jnp)
  if s["kind"] == "rmw" and jnp.issubdtype(dtype, jnp.integer):
    v = v & jnp.asarray(63, dtype)          # small: a sum of bit patterns stays a float
  if s["direct"] and dchain and dchain[-1][0] == "at":
    base, idx = _view(pl, refs[s["dst"]], dchain[:-1], pid), _index(pl, dchain[-1][1], pid)
  else:
    base, idx = _view(pl, refs[s["dst"]], dchain, pid), ...
  if s["kind"] == "rmw":
    base[idx] += v
  else:
    base[idx] = v


def _run(api: Any, d: dict, args: tuple) -> Any:
  pl, pltpu, G = api.pl, api.pltpu, d["G"]

  def kernel(x_ref, poisoned_ref, o_ref, *scratch):
    pid = pl.program_id(0)
    refs = {"x": x_ref, "o": o_ref}
    if scratch:
      refs["s"] = scratch[0]
    statements = d["statements"]
    if d["scratch"] is not None:
      init = lambda: _run_statement(pl, statements[0], refs, pid)  # noqa: E731
      if d["init_once"]:
        pl.when(pid == 0)(init)
      else:
        init()
      statements = statements[1:]
    for s in statements:
      _run_statement(pl, s, refs, pid)
    if d["scoped"] is not None:
      def stage(t_ref):
        inner = dict(refs, t=t_ref)
        for s in d["scoped"]["statements"]:
          _run_statement(pl, s, inner, pid)
      pl.run_scoped(stage, pltpu.VMEM(d["scoped"]["shape"], jnp.dtype(d["scoped"]["dtype"])))

  def spec(name: str) -> Any:
    blk = d["bufs"][name][0]
    kind = d["maps"][name]
    if kind == "blocked":
      return pl.BlockSpec(blk, lambda i: (i, 0))
    if kind == "reversed":
      return pl.BlockSpec(blk, lambda i: (G - 1 - i, 0))
    return pl.BlockSpec(blk, lambda i: (0, 0))

  scratch_shapes = ([pltpu.VMEM(d["scratch"], jnp.dtype(d["bufs"]["s"][1]))]
                    if d["scratch"] is not None else [])
  out_shape = jax.ShapeDtypeStruct(args[1].shape, args[1].dtype)
  call = api.pallas_call(kernel, out_shape, grid=(G,), in_specs=[spec("x"), spec("o")],
                         out_specs=spec("o"), scratch_shapes=scratch_shapes,
                         input_output_aliases={1: 0})
  return call(*args)


# ------------------------------------------------------------------ the model
def _offsets(shape: tuple, dtype: str) -> np.ndarray:
  """A buffer's byte offsets: shape + (bytes per element,)."""
  nb = _width(dtype) // 8
  return np.arange(math.prod(shape) * nb).reshape(tuple(shape) + (nb,))


def _model_index(entries: tuple, pid: int, row: Any = None) -> tuple:
  out = []
  for e in entries:
    if e[0] == "all":
      out.append(slice(None))
    elif e[0] == "slice":
      out.append(slice(e[1], e[1] + e[2]))
    elif e[0] == "ds":
      _, a, b, m, n = e
      start = (pid * a + b) % m
      out.append(slice(start, start + n))
    elif e[0] == "int":
      out.append(e[1])
    else:
      _, a, b, m = e
      out.append((pid * a + b) % m)
  return tuple(out)


def _model_view(off: np.ndarray, dtype: str, chain: list, pid: int) -> tuple[np.ndarray, str]:
  """The byte offsets (view shape + (bytes,)) a view chain reaches, and its dtype."""
  for step in chain:
    if step[0] == "at":
      off = off[_model_index(step[1], pid)]
    elif step[0] == "reshape":
      off = off.reshape(tuple(step[1]) + off.shape[-1:])
    else:
      to = step[1]
      wf, wt = _width(dtype), _width(to)
      lead = off.shape[:-3]
      r, c, nb = off.shape[-3:]
      if wf < wt:      # rows 2k (low half) and 2k + 1 (high half) make row k
        off = off.reshape(lead + (r // 2, 2, c, nb))
        off = np.moveaxis(off, -3, -2).reshape(lead + (r // 2, c, 2 * nb))
      elif wf > wt:    # row k splits into rows 2k (low half) and 2k + 1 (high half)
        off = off.reshape(lead + (r, c, 2, nb // 2))
        off = np.moveaxis(off, -2, -3).reshape(lead + (2 * r, c, nb // 2))
      dtype = to
  return off, dtype


def _load(mem: np.ndarray, off: np.ndarray, dtype: str) -> np.ndarray:
  raw = np.ascontiguousarray(mem[off])
  return raw.view(_np_dtype(dtype)).reshape(off.shape[:-1])


def _store(mem: np.ndarray, off: np.ndarray, value: np.ndarray, dtype: str) -> None:
  v = np.ascontiguousarray(np.asarray(value, _np_dtype(dtype)).reshape(off.shape[:-1]))
  mem[off] = v.view(np.uint8).reshape(off.shape)


def _clean(v: np.ndarray, strict: bool) -> np.ndarray:
  """`v`; under `strict`, raises _Unclean unless every element is zero or finite and normal."""
  if strict:
    w = np.asarray(v, np.float64)
    tiny = float(jnp.finfo(v.dtype).tiny)
    if not (np.isfinite(w) & ((w == 0) | (np.abs(w) >= tiny))).all():
      raise _Unclean()
  return v


def _model_op(op: tuple, v: np.ndarray, dtype: str, pid: int, strict: bool) -> np.ndarray:
  nd = _np_dtype(dtype)
  if op[0] in ("neg", "double"):
    return _clean(_float_op(op, _clean(v, strict), nd), strict)
  with np.errstate(all="ignore"):
    if op[0] == "xor":
      return v ^ nd.type(op[1])
    if op[0] == "add":
      return (v + nd.type(op[1])).astype(nd)
    if op[0] == "add_pid":
      return (v + nd.type(pid + op[1])).astype(nd)
  return v


def _float_op(op: tuple, v: np.ndarray, nd: np.dtype) -> np.ndarray:
  with np.errstate(all="ignore"):
    if op[0] == "neg":
      return -v
    return (v * nd.type(2)).astype(nd)


def _add(a: np.ndarray, b: np.ndarray, dtype: str, strict: bool) -> np.ndarray:
  """`a + b` in `dtype`: wrapping for integers; for 16-bit floats the float32 sum rounded."""
  nd = _np_dtype(dtype)
  with np.errstate(all="ignore"):
    if _is_int(dtype):
      return (a + b).astype(nd)
    a, b = _clean(a, strict), _clean(b, strict)
    if dtype == "float32":
      return _clean((a + b).astype(nd), strict)
    return _clean((a.astype(np.float32) + b.astype(np.float32)).astype(nd), strict)


def _model_statement(s: dict, mems: dict, pid: int, strict: bool) -> None:
  src_mem, src_dtype, src_shape = mems[s["src"]]
  dst_mem, dst_dtype, dst_shape = mems[s["dst"]]
  soff, _ = _model_view(_offsets(src_shape, src_dtype), src_dtype, s["src_chain"], pid)
  doff, dtype = _model_view(_offsets(dst_shape, dst_dtype), dst_dtype, s["dst_chain"], pid)
  if s["kind"] == "rows":
    L = doff.shape[0]
    for r in range(L):
      r = L - 1 - r if s["reverse"] else r
      v = _model_op(s["op"], _load(src_mem, soff[r], dtype), dtype, pid, strict)
      _store(dst_mem, doff[r], v, dtype)
    return
  v = _model_op(s["op"], _load(src_mem, soff, dtype), dtype, pid, strict)
  if s["kind"] == "rmw":
    if _is_int(dtype):
      v = v & _np_dtype(dtype).type(63)
    v = _add(_load(dst_mem, doff, dtype), v, dtype, strict)
  _store(dst_mem, doff, v, dtype)


def _model(d: dict, args: tuple, strict: bool = False) -> np.ndarray:
  x, out = args[0], args[1].copy()
  G = d["G"]

  def rows(name: str, pid: int) -> slice:
    n = d["bufs"][name][0][0]
    kind = d["maps"][name]
    b = {"blocked": pid, "reversed": G - 1 - pid, "whole": 0}[kind]
    return slice(b * n, (b + 1) * n)

  def mem_of(a: np.ndarray) -> np.ndarray:
    return np.frombuffer(np.ascontiguousarray(a).tobytes(), np.uint8).copy()

  s_mem = None
  if d["scratch"] is not None:
    s_shape, s_dtype = d["bufs"]["s"]
    s_mem = np.zeros(math.prod(s_shape) * _width(s_dtype) // 8, np.uint8)
  for pid in range(G):
    mems = {"x": (mem_of(x[rows("x", pid)]), d["x_dtype"], d["bufs"]["x"][0]),
            "o": (mem_of(out[rows("o", pid)]), d["o_dtype"], d["bufs"]["o"][0])}
    statements = d["statements"]
    if s_mem is not None:
      mems["s"] = (s_mem, d["bufs"]["s"][1], d["bufs"]["s"][0])
      if not d["init_once"] or pid == 0:
        _model_statement(statements[0], mems, pid, strict)
      statements = statements[1:]
    for s in statements:
      _model_statement(s, mems, pid, strict)
    if d["scoped"] is not None:
      t = d["scoped"]
      mems["t"] = (np.zeros(math.prod(t["shape"]) * _width(t["dtype"]) // 8, np.uint8),
                   t["dtype"], t["shape"])
      for s in t["statements"]:
        _model_statement(s, mems, pid, strict)
    o_mem = mems["o"][0]
    out[rows("o", pid)] = o_mem.view(_np_dtype(d["o_dtype"])).reshape(d["bufs"]["o"][0])
  if not _is_int(d["o_dtype"]):
    _clean(out, strict)
  return out


# ------------------------------------------------------------------ description
def _show_index(entries: tuple) -> str:
  parts = []
  for e in entries:
    if e[0] == "all":
      parts.append(":")
    elif e[0] == "slice":
      _, s, n, as_ds = e
      parts.append(f"pl.ds({s}, {n})" if as_ds else f"{s}:{s + n}")
    elif e[0] == "ds":
      _, a, b, m, n = e
      parts.append(f"pl.ds((i*{a}+{b})%{m}, {n})")
    elif e[0] == "int":
      parts.append(str(e[1]))
    else:
      parts.append(f"(i*{e[1]}+{e[2]})%{e[3]}")
  return ", ".join(parts)


def _show_chain(name: str, chain: list) -> str:
  text = name
  for step in chain:
    if step[0] == "at":
      text += f".at[{_show_index(step[1])}]"
    elif step[0] == "reshape":
      text += f".reshape{tuple(step[1])}"
    else:
      text += f".bitcast({step[1]})"
  return text


def _show(s: dict) -> str:
  op = s["op"]
  v = f"op{op}({_show_chain(s['src'], s['src_chain'])}[...])"
  dst = _show_chain(s["dst"], s["dst_chain"])
  if s["kind"] == "rows":
    i = "pl.ds(r, 1)" if s["row_ds"] else "r"
    order = "reversed " if s["reverse"] else ""
    return f"for r in {order}rows: {dst}[{i}] = {v[:-6]}[{i}])"
  if s["direct"] and s["dst_chain"] and s["dst_chain"][-1][0] == "at":
    dst = f"{_show_chain(s['dst'], s['dst_chain'][:-1])}[{_show_index(s['dst_chain'][-1][1])}]"
  else:
    dst += "[...]"
  return f"{dst} {'+=' if s['kind'] == 'rmw' else '='} {v}"


def _describe(d: dict) -> dict:
  out = dict(grid=(d["G"],), maps=d["maps"],
             buffers={k: f"{v[1]}{list(v[0])}" for k, v in d["bufs"].items()},
             statements=[_show(s) for s in d["statements"]])
  if d["scratch"] is not None:
    out["scratch_init"] = "program 0 only" if d["init_once"] else "every program"
  if d["scoped"] is not None:
    out["run_scoped"] = [_show(s) for s in d["scoped"]["statements"]]
  return out

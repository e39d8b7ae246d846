"""Writes into a ref of values read from other places of the same ref, the bug class of
openxla/xla#49176 (XLA:CPU runs a reshape moved across a `dynamic_update_slice` in
place, though the update reads the array it updates): every path pallet has from a
kernel's ref writes to array updates followed by reshapes, other than ref views.

One target ref `T` per case: the output (aliased to an input of random data, or first
written whole from the input), or a VMEM scratch written from the input and copied to
the output after the statements. Its block is 2-D (R, C) or 3-D, in a grid of 1-4
steps: blocked along rows or columns (forwards or reversed: pallet vectorizes those
axes, batching the updates and reshaping the slab), a 3-D array walked by squeezed
(`None`, `pl.Squeezed()`), unit or larger leading blocks, or one whole-array block that
every step revisits (no BlockSpec, or an explicit one; statements then see earlier
steps' writes, and the first step alone initializes). 1-4 statements per step, each
reading `T` and writing `T`, so later ones read what earlier ones wrote:

* `copy`: `T[dst] = f(g(T[src]))`, windows with static or program-id-dependent starts
  (slices, `pl.ds`), integer indices that squeeze a dimension (static or program-id),
  spelled as indexing, `.at[...]` chains (`T.at[1:5].at[:, 2:]`) or
  `plgpu/pltpu.load/store`; `g` a shift (another window, overlapping or not),
  reversal (`v[::-1]`, `jnp.flip`), transpose, `jnp.roll`, a broadcast from a row,
  column or element, or a window of the whole block's value reshaped (and transposed)
  `T[...].reshape(...)[k]`; `f` identity, `+ c`, `* 2` or negation;
* `reduce`: `T[dst] = f(broadcast(sum(T[src], axis=-1, keepdims=True)))`;
* `reshape`: `T[...] = f(g(T[...].reshape(S))).reshape(T.shape)`, `g` a flip, roll or
  swap of axes of the reshaped value (a reshape right after the updates before it);
* `loop`: a `fori_loop` shifting `T` by 1-2 along an axis per iteration
  (`T[1:] = f(T[:-1])`), or propagating row by row (`T[pl.ds(i + 1, 1)] = f(T[pl.ds(i,
  1)])`, or integer rows), forwards or backwards.

Data are float32 multiples of 1/4 or int32, small; every op is exact (a draw whose
float values would grow past 2**20 is drawn again), so outputs compare exactly. The
model applies the statements to NumPy blocks, grid step by grid step.
"""
from __future__ import annotations

import math
import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..case import Case, poison

LAYOUTS = ["blocked", "blocked", "reversed", "columns", "whole", "whole_nospec",
           "squeezed", "unit", "block3", "whole3"]
TARGETS = ["alias", "copy", "scratch"]
STATEMENTS = ["copy"] * 5 + ["reduce", "reshape", "reshape", "loop", "loop"]
SOURCES = ["shift", "shift", "reverse", "transpose", "roll", "broadcast", "reshaped",
           "reshaped"]
SPELLINGS = ["slice", "ds", "at", "at2", "load"]
FLOAT_LIMIT = 2.0 ** 20


# ------------------------------------------------------------------ drawing
def _ranges(rng: random.Random, L: int, n: int | None = None, traced_ok: bool = True) -> tuple:
  """A window of one dimension of size L: ("rng", start, n) or ("rngd", a, b, m, n)."""
  if n is None:
    n = rng.choice([L, L, rng.randint(1, L), max(1, L // 2), max(1, L - 1)])
  if traced_ok and n < L and rng.random() < 0.3:
    return ("rngd", rng.randint(1, 3), rng.randint(0, 3), L - n + 1, n)
  return ("rng", rng.randint(0, L - n), n)


def _integer(rng: random.Random, L: int) -> tuple:
  if L > 1 and rng.random() < 0.3:      # (i*a+b) % 1 is refused by JAX's interpreter
    return ("intd", rng.randint(1, 3), rng.randint(0, 3), L)
  return ("int", rng.randrange(L))


def _window(rng: random.Random, shape: tuple, V: tuple, *, scalar_ok: bool = False) -> dict | None:
  """A window of a ref of `shape` whose value has shape V (range dims in order, integer
  indices elsewhere), with a random spelling; None if V does not fit."""
  rank = len(shape)
  fits = [c for c in _combinations(rank, len(V))
          if all(shape[d] >= v for d, v in zip(c, V))]
  if not fits or (not V and not scalar_ok):
    return None
  dims = rng.choice(fits)
  entries = []
  for d in range(rank):
    if d in dims:
      entries.append(_ranges(rng, shape[d], V[dims.index(d)]))
    else:
      entries.append(_integer(rng, shape[d]))
  return _spell(rng, shape, entries)


def _combinations(rank: int, k: int) -> list[tuple]:
  import itertools
  return list(itertools.combinations(range(rank), k))


def _spell(rng: random.Random, shape: tuple, entries: list) -> dict:
  spell = rng.choice(SPELLINGS)
  w = dict(entries=entries, spell=spell, omit=rng.random() < 0.3)
  if spell in ("at", "at2"):
    outer, inner = [], []
    for L, e in zip(shape, entries):
      if e[0] == "rng":
        s0 = rng.randint(0, e[1])
        e0 = rng.randint(e[1] + e[2], L)
        outer.append(("rng", s0, e0 - s0))
        inner.append(("rng", e[1] - s0, e[2]))
      elif e[0] == "int" and rng.random() < 0.5:
        outer.append(e)
      elif e[0] == "int":
        s0 = rng.randint(0, e[1])
        e0 = rng.randint(e[1] + 1, L)
        outer.append(("rng", s0, e0 - s0))
        inner.append(("int", e[1] - s0))
      else:
        outer.append(("rng", 0, L))
        inner.append(e)
    if not inner:                 # keep at least one dimension for the second step
      outer[-1], inner = ("rng", 0, shape[-1]), [entries[-1]]
    w.update(outer=outer, inner=inner)
  if spell == "load":
    w["module"] = rng.choice(["plgpu", "pltpu"])
  return w


def _factorization(rng: random.Random, n: int, rank: int) -> tuple:
  """A random shape of `rank` dimensions with n elements."""
  dims = []
  for _ in range(rank - 1):
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    d = rng.choice(divisors)
    dims.append(d)
    n //= d
  dims.append(n)
  rng.shuffle(dims)
  return tuple(dims)


def _value_shape(rng: random.Random, shape: tuple) -> tuple:
  """The value shape of a destination window: sizes of 1-rank kept dimensions."""
  rank = len(shape)
  keep = rank if rng.random() < 0.6 else rng.randint(1, rank)
  dims = sorted(rng.sample(range(rank), keep)) if keep < rank else list(range(rank))
  return tuple(rng.choice([shape[d], shape[d], rng.randint(1, shape[d])]) for d in dims)


def _op(rng: random.Random, dtype: str) -> tuple:
  kind = rng.choice(["id", "add", "mul2", "neg"])
  if kind == "add":
    return ("add", rng.choice([1, 2, 3, -5]) if dtype == "int32" else
            rng.choice([1.0, 0.5, -2.25, 3.0]))
  return (kind,)


def _source(rng: random.Random, shape: tuple, V: tuple) -> dict:
  for _ in range(20):
    kind = rng.choice(SOURCES)
    if kind in ("shift", "reverse", "roll"):
      w = _window(rng, shape, V)
      if w is None:
        continue
      src = dict(kind=kind, window=w)
      if kind == "reverse":
        src.update(axis=rng.randrange(len(V)), flip=rng.random() < 0.5)
      if kind == "roll":
        a = rng.randrange(len(V))
        src.update(axis=a, by=rng.randint(-V[a], V[a]))
      return src
    if kind == "transpose":
      if len(V) != 2:
        continue
      w = _window(rng, shape, V[::-1])
      if w is None:
        continue
      return dict(kind=kind, window=w, spelled=rng.choice(["T", "transpose", "swapaxes"]))
    if kind == "broadcast":
      j = rng.randrange(len(V))
      if rng.random() < 0.5:
        w = _window(rng, shape, V[:j] + (1,) + V[j + 1:])
        how = "keep"
      else:
        w = _window(rng, shape, V[:j] + V[j + 1:], scalar_ok=True)
        how = "expand"
      if w is None:
        continue
      return dict(kind=kind, window=w, axis=j, how=how)
    if kind == "reshaped":
      N, n = math.prod(shape), math.prod(V)
      if N % n:
        continue
      q = N // n
      W = _factorization(rng, n, rng.randint(1, 2))
      at = rng.randint(0, len(W))
      new = W[:at] + (q,) + W[at:]
      perm = list(range(len(new)))
      if rng.random() < 0.6:
        rng.shuffle(perm)
      k = ("int", rng.randrange(q)) if q == 1 or rng.random() < 0.7 else (
          "intd", rng.randint(1, 3), rng.randint(0, 3), q)
      return dict(kind=kind, new=new, perm=tuple(perm), q_axis=perm.index(at), k=k)
  return dict(kind="shift", window=_window(rng, shape, V))


def _statement(rng: random.Random, shape: tuple, dtype: str) -> dict:
  kind = rng.choice(STATEMENTS)
  op = _op(rng, dtype)
  if kind in ("copy", "reduce"):
    for _ in range(20):
      V = _value_shape(rng, shape)
      dst = _window(rng, shape, V)
      if dst is None:
        continue
      if kind == "copy":
        return dict(kind=kind, dst=dst, src=_source(rng, shape, V), op=op)
      m = rng.randint(1, max(shape))
      src = _window(rng, shape, V[:-1] + (m,))
      if src is not None:
        return dict(kind=kind, dst=dst, src=src, op=op)
    return _statement(rng, shape, dtype)
  if kind == "reshape":
    N = math.prod(shape)
    S = _factorization(rng, N, rng.randint(1, 3))
    g = rng.choice(["flip", "roll", "swap"] if len(S) >= 2 else ["flip", "roll"])
    a = rng.randrange(len(S))
    if g == "swap":
      a, b = rng.sample(range(len(S)), 2)
      return dict(kind=kind, shape=S, g=g, axes=(a, b), op=op)
    if g == "roll":
      return dict(kind=kind, shape=S, g=g, axis=a, by=rng.randint(-S[a], S[a]), op=op)
    return dict(kind=kind, shape=S, g=g, axis=a, op=op)
  # loop
  axes = [a for a in range(len(shape)) if shape[a] >= 2]
  if not axes:
    return dict(kind="reshape", shape=shape, g="flip", axis=0, op=op)
  a = rng.choice(axes)
  L = shape[a]
  if rng.random() < 0.5:
    s = rng.randint(1, min(2, L - 1))
    lead = _integer(rng, shape[0]) if len(shape) == 3 and a != 0 and rng.random() < 0.5 else None
    return dict(kind="loop", how="shift", axis=a, by=s, forward=rng.random() < 0.5,
                times=rng.randint(1, 4), lead=lead, ds=rng.random() < 0.5, op=op)
  return dict(kind="loop", how="rows", axis=0, forward=rng.random() < 0.5,
              scalar=rng.random() < 0.4 and shape[0] >= 2, op=op,
              length=shape[0]) if shape[0] >= 2 else dict(
      kind="loop", how="shift", axis=a, by=1, forward=True, times=2, lead=None, ds=False, op=op)


class _Unclean(Exception):
  """A float value of the model grew past FLOAT_LIMIT (no longer surely exact)."""


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  for _ in range(30):
    d = _draw(rng)
    inputs = _inputs(d, data)
    try:
      _model(d, inputs, strict=True)
      break
    except _Unclean:
      continue
  return _case(d, inputs)


def _draw(rng: random.Random) -> dict:
  G = rng.randint(1, 4)
  layout = rng.choice(LAYOUTS)
  R = rng.choice([2, 3, 4, 5, 8, 16])
  C = rng.choice([1, 2, 3, 4, 8, 16, 32, 128])
  A = rng.randint(2, 4)
  kshape = {"block3": (A, R, C), "whole3": (A, R, C), "unit": (1, R, C)}.get(layout, (R, C))
  dtype = rng.choice(["float32", "int32"])
  target = rng.choice(TARGETS)
  statements = [_statement(rng, kshape, dtype) for _ in range(rng.randint(1, 4))]
  squeeze = rng.choice(["None", "Squeezed"])
  return dict(G=G, layout=layout, kshape=kshape, dtype=dtype, target=target,
              statements=statements, squeeze=squeeze, R=R, C=C, A=A)


def _array_shape(d: dict) -> tuple:
  G, R, C, A = d["G"], d["R"], d["C"], d["A"]
  return {"blocked": (G * R, C), "reversed": (G * R, C), "columns": (R, G * C),
          "whole": (R, C), "whole_nospec": (R, C), "squeezed": (G, R, C), "unit": (G, R, C),
          "block3": (G * A, R, C), "whole3": (A, R, C)}[d["layout"]]


def _whole(d: dict) -> bool:
  return d["layout"] in ("whole", "whole_nospec", "whole3")


def _inputs(d: dict, data: np.random.Generator) -> tuple[np.ndarray, ...]:
  shape = _array_shape(d)
  x = data.integers(-50, 51, shape)
  x = np.where(x == 0, 7, x)                  # never zeros
  x = (x / 4).astype(np.float32) if d["dtype"] == "float32" else x.astype(np.int32)
  if d["target"] == "alias":            # the output starts from other random data
    b = data.integers(-50, 51, shape)
    b = np.where(b == 0, -3, b)
    b = (b / 4).astype(np.float32) if d["dtype"] == "float32" else b.astype(np.int32)
  else:                                 # the kernel writes it all (else the poison shows)
    b = poison(shape, x.dtype)
  return (x, b)


def _case(d: dict, inputs: tuple) -> Case:
  return Case(family="overlaps", seed=-1, description=_describe(d), inputs=inputs,
              run=lambda api, *a: _run(api, d, a), model=lambda *a: _model(d, a),
              jax_oracle=_jax_reason(d), triton=_triton_reason(d), tolerance_scale=0.0)


def _windows(d: dict) -> list[dict]:
  out = []
  for s in d["statements"]:
    for key in ("dst", "src"):
      w = s.get(key)
      if isinstance(w, dict):
        out.append(w["window"] if "window" in w else w)
  return [w for w in out if w is not None and "entries" in w]


def _jax_reason(d: dict) -> str | None:
  if any(w["spell"] == "load" and any(e[0] in ("int", "intd") for e in w["entries"])
         for w in _windows(d)):
    return ("JAX's interpreter fails on plgpu/pltpu.load/store through a view with an "
            "integer index ('TypedInt' object has no attribute 'shape')")
  return None


def _triton_reason(d: dict) -> str | None:
  rolls = any(s.get("g") == "roll" or s.get("src", {}).get("kind") == "roll"
              for s in d["statements"])
  if rolls:
    return ("jnp.roll concatenates unequal pieces (the Triton backend concatenates a "
            "power-of-two number of equal power-of-two pieces)")
  return None


# ------------------------------------------------------------------ the kernel
def _traced(pid: Any, a: int, b: int, m: int) -> Any:
  return (pid * a + b) % m


def _entry(pl: Any, L: int, e: tuple, pid: Any, spell: str) -> Any:
  if e[0] == "int":
    return e[1]
  if e[0] == "intd":
    return _traced(pid, *e[1:])
  if e[0] == "rng":
    _, s, n = e
    if spell == "ds":
      return pl.ds(s, n)
    return slice(None) if (s, n) == (0, L) else slice(s, s + n)
  _, a, b, m, n = e
  return pl.ds(_traced(pid, a, b, m), n)


def _full(L: int, e: tuple) -> bool:
  return e[0] == "rng" and e[1:] == (0, L)


def _index(pl: Any, shape: tuple, entries: list, pid: Any, spell: str, omit: bool) -> tuple:
  idx = [_entry(pl, L, e, pid, spell) for L, e in zip(shape, entries)]
  if omit:
    while len(idx) > 1 and _full(shape[len(idx) - 1], entries[len(idx) - 1]):
      idx.pop()
  return tuple(idx)


def _inner_shape(shape: tuple, outer: list) -> tuple:
  return tuple(e[2] for e in outer if e[0] == "rng")


def _read(api: Any, ref: Any, w: dict, pid: Any) -> Any:
  pl, shape, spell = api.pl, ref.shape, w["spell"]
  if spell in ("at", "at2"):
    outer = _index(pl, shape, w["outer"], pid, "slice", False)
    inner = _index(pl, _inner_shape(shape, w["outer"]), w["inner"], pid, "slice", w["omit"])
    if spell == "at":
      return ref.at[outer][inner]
    return ref.at[outer].at[inner][...]
  idx = _index(pl, shape, w["entries"], pid, spell, w["omit"] and spell != "load")
  if spell == "load":
    module = api.plgpu if w["module"] == "plgpu" else api.pltpu
    return module.load(ref.at[idx])
  return ref[idx]


def _write(api: Any, ref: Any, w: dict, pid: Any, v: Any) -> None:
  pl, shape, spell = api.pl, ref.shape, w["spell"]
  if spell in ("at", "at2"):
    outer = _index(pl, shape, w["outer"], pid, "slice", False)
    inner = _index(pl, _inner_shape(shape, w["outer"]), w["inner"], pid, "slice", w["omit"])
    if spell == "at":
      ref.at[outer][inner] = v
    else:
      ref.at[outer].at[inner][...] = v
    return
  idx = _index(pl, shape, w["entries"], pid, spell, w["omit"] and spell != "load")
  if spell == "load":
    module = api.plgpu if w["module"] == "plgpu" else api.pltpu
    module.store(ref.at[idx], v)
    return
  ref[idx] = v


def _apply_op(op: tuple, v: Any, xp: Any, dtype: Any) -> Any:
  if op[0] == "add":
    return v + xp.asarray(op[1], dtype)
  if op[0] == "mul2":
    return v * xp.asarray(2, dtype)
  if op[0] == "neg":
    return -v
  return v


def _kernel_source(api: Any, ref: Any, src: dict, V: tuple, pid: Any) -> Any:
  kind = src["kind"]
  if kind == "reshaped":
    k = src["k"]
    k = k[1] if k[0] == "int" else _traced(pid, *k[1:])
    w = ref[...].reshape(src["new"])
    if src["perm"] != tuple(range(len(src["perm"]))):
      w = jnp.transpose(w, src["perm"])
    idx = tuple(k if i == src["q_axis"] else slice(None) for i in range(w.ndim))
    return w[idx].reshape(V)
  v = _read(api, ref, src["window"], pid)
  if kind == "reverse":
    a = src["axis"]
    if src["flip"] or a > 1:
      return jnp.flip(v, a)
    return v[::-1] if a == 0 else v[:, ::-1]
  if kind == "roll":
    return jnp.roll(v, src["by"], axis=src["axis"])
  if kind == "transpose":
    return {"T": lambda: v.T, "transpose": lambda: jnp.transpose(v),
            "swapaxes": lambda: jnp.swapaxes(v, 0, 1)}[src["spelled"]]()
  if kind == "broadcast":
    if src["how"] == "expand":
      v = jnp.expand_dims(v, src["axis"])
    return jnp.broadcast_to(v, V)
  return v


def _value_of(w: dict) -> tuple:
  return tuple(e[-1] for e in w["entries"] if e[0] in ("rng", "rngd"))


def _run_statement(api: Any, ref: Any, s: dict, pid: Any) -> None:
  dtype = ref.dtype
  kind = s["kind"]
  if kind == "copy":
    V = _value_of(s["dst"])
    v = _kernel_source(api, ref, s["src"], V, pid)
    _write(api, ref, s["dst"], pid, _apply_op(s["op"], v, jnp, dtype))
  elif kind == "reduce":
    V = _value_of(s["dst"])
    v = jnp.sum(_read(api, ref, s["src"], pid), axis=-1, keepdims=True)
    _write(api, ref, s["dst"], pid, _apply_op(s["op"], jnp.broadcast_to(v, V), jnp, dtype))
  elif kind == "reshape":
    w = ref[...].reshape(s["shape"])
    if s["g"] == "flip":
      w = jnp.flip(w, s["axis"])
    elif s["g"] == "roll":
      w = jnp.roll(w, s["by"], axis=s["axis"])
    else:
      w = jnp.swapaxes(w, *s["axes"])
    ref[...] = _apply_op(s["op"], w, jnp, dtype).reshape(ref.shape)
  elif s["how"] == "shift":
    a, by, shape = s["axis"], s["by"], ref.shape
    pl = api.pl

    def window(start: int) -> tuple:
      L = shape[a] - by
      idx = [slice(None)] * len(shape)
      idx[a] = pl.ds(start, L) if s["ds"] else slice(start, start + L)
      if s["lead"] is not None:
        e = s["lead"]
        idx[0] = e[1] if e[0] == "int" else _traced(pid, *e[1:])
      return tuple(idx)
    dst, src = (window(by), window(0)) if s["forward"] else (window(0), window(by))

    def body(i, carry):
      ref[dst] = _apply_op(s["op"], ref[src], jnp, dtype)
      return carry
    lax.fori_loop(0, s["times"], body, 0)
  else:   # rows
    pl, L = api.pl, s["length"]

    def body(i, carry):
      a, b = (i, i + 1) if s["forward"] else (L - 1 - i, L - 2 - i)
      if s["scalar"]:
        ref[b] = _apply_op(s["op"], ref[a], jnp, dtype)
      else:
        ref[pl.ds(b, 1)] = _apply_op(s["op"], ref[pl.ds(a, 1)], jnp, dtype)
      return carry
    lax.fori_loop(0, L - 1, body, 0)


def _run(api: Any, d: dict, args: tuple) -> Any:
  pl, pltpu, G = api.pl, api.pltpu, d["G"]
  layout, target, kshape = d["layout"], d["target"], d["kshape"]
  dtype = jnp.dtype(d["dtype"])
  whole = _whole(d)

  def kernel(x_ref, buffer_ref, o_ref, *scratch):
    pid = pl.program_id(0)
    T = scratch[0] if target == "scratch" else o_ref

    def init():
      T[...] = x_ref[...]
    if target != "alias":
      if whole:
        pl.when(pid == 0)(init)
      else:
        init()
    for s in d["statements"]:
      _run_statement(api, T, s, pid)
    if target == "scratch":
      o_ref[...] = T[...]

  squeezed = None if d["squeeze"] == "None" else pl.Squeezed()
  R, C, A = d["R"], d["C"], d["A"]
  spec = {
      "blocked": lambda: pl.BlockSpec((R, C), lambda i: (i, 0)),
      "reversed": lambda: pl.BlockSpec((R, C), lambda i: (G - 1 - i, 0)),
      "columns": lambda: pl.BlockSpec((R, C), lambda i: (0, i)),
      "whole": lambda: pl.BlockSpec((R, C), lambda i: (0, 0)),
      "whole_nospec": lambda: None,
      "squeezed": lambda: pl.BlockSpec((squeezed, R, C), lambda i: (i, 0, 0)),
      "unit": lambda: pl.BlockSpec((1, R, C), lambda i: (i, 0, 0)),
      "block3": lambda: pl.BlockSpec((A, R, C), lambda i: (i, 0, 0)),
      "whole3": lambda: pl.BlockSpec((A, R, C), lambda i: (0, 0, 0)),
  }[layout]()
  out_shape = jax.ShapeDtypeStruct(args[1].shape, dtype)
  options: dict[str, Any] = dict(grid=(G,))
  if spec is not None:
    options.update(in_specs=[spec, spec], out_specs=spec)
  if target == "scratch":
    options["scratch_shapes"] = [pltpu.VMEM(kshape, dtype)]
  # The output is aliased to the second operand: random data it starts from ("alias"),
  # or a poisoned buffer the kernel writes over first.
  call = api.pallas_call(kernel, out_shape, input_output_aliases={1: 0}, **options)
  return call(*args)


# ------------------------------------------------------------------ the model
def _model_index(entries: list, pid: int) -> tuple:
  out = []
  for e in entries:
    if e[0] == "int":
      out.append(e[1])
    elif e[0] == "intd":
      out.append((pid * e[1] + e[2]) % e[3])
    elif e[0] == "rng":
      out.append(slice(e[1], e[1] + e[2]))
    else:
      _, a, b, m, n = e
      start = (pid * a + b) % m
      out.append(slice(start, start + n))
  return tuple(out)


def _model_op(op: tuple, v: np.ndarray, strict: bool) -> np.ndarray:
  nd = v.dtype
  with np.errstate(all="ignore"):
    if op[0] == "add":
      v = (v + nd.type(op[1])).astype(nd)
    elif op[0] == "mul2":
      v = (v * nd.type(2)).astype(nd)
    elif op[0] == "neg":
      v = (-v).astype(nd)
  if strict and nd.kind == "f" and np.abs(v).max(initial=0) > FLOAT_LIMIT:
    raise _Unclean()
  return v


def _model_source(T: np.ndarray, src: dict, V: tuple, pid: int) -> np.ndarray:
  kind = src["kind"]
  if kind == "reshaped":
    k = src["k"]
    k = k[1] if k[0] == "int" else (pid * k[1] + k[2]) % k[3]
    w = np.transpose(T.reshape(src["new"]), src["perm"])
    idx = tuple(k if i == src["q_axis"] else slice(None) for i in range(w.ndim))
    return np.array(w[idx]).reshape(V)
  v = np.array(T[_model_index(src["window"]["entries"], pid)])
  if kind == "reverse":
    return np.flip(v, src["axis"])
  if kind == "roll":
    return np.roll(v, src["by"], axis=src["axis"])
  if kind == "transpose":
    return v.T
  if kind == "broadcast":
    if src["how"] == "expand":
      v = np.expand_dims(v, src["axis"])
    return np.broadcast_to(v, V)
  return v


def _model_statement(T: np.ndarray, s: dict, pid: int, strict: bool) -> None:
  kind = s["kind"]
  if kind == "copy":
    V = _value_of(s["dst"])
    v = _model_source(T, s["src"], V, pid)
    T[_model_index(s["dst"]["entries"], pid)] = _model_op(s["op"], np.array(v), strict)
  elif kind == "reduce":
    V = _value_of(s["dst"])
    src = T[_model_index(s["src"]["entries"], pid)]
    with np.errstate(all="ignore"):
      v = np.sum(src, axis=-1, keepdims=True, dtype=T.dtype)
    v = np.array(np.broadcast_to(v, V))
    T[_model_index(s["dst"]["entries"], pid)] = _model_op(s["op"], v, strict)
  elif kind == "reshape":
    w = T.copy().reshape(s["shape"])
    if s["g"] == "flip":
      w = np.flip(w, s["axis"])
    elif s["g"] == "roll":
      w = np.roll(w, s["by"], axis=s["axis"])
    else:
      w = np.swapaxes(w, *s["axes"])
    T[...] = _model_op(s["op"], np.array(w), strict).reshape(T.shape)
  elif s["how"] == "shift":
    a, by = s["axis"], s["by"]
    L = T.shape[a] - by

    def window(start: int) -> tuple:
      idx = [slice(None)] * T.ndim
      idx[a] = slice(start, start + L)
      if s["lead"] is not None:
        idx[0] = _model_index([s["lead"]], pid)[0]
      return tuple(idx)
    dst, src = (window(by), window(0)) if s["forward"] else (window(0), window(by))
    for _ in range(s["times"]):
      T[dst] = _model_op(s["op"], np.array(T[src]), strict)
  else:
    L = s["length"]
    for i in range(L - 1):
      a, b = (i, i + 1) if s["forward"] else (L - 1 - i, L - 2 - i)
      T[b] = _model_op(s["op"], np.array(T[a]), strict)


def _model(d: dict, args: tuple, strict: bool = False) -> np.ndarray:
  x = args[0]
  out = args[1].copy()
  G, layout = d["G"], d["layout"]
  R, C, A = d["R"], d["C"], d["A"]
  scratch = None
  for pid in range(G):
    window = {
        "blocked": (slice(pid * R, (pid + 1) * R),),
        "reversed": (slice((G - 1 - pid) * R, (G - pid) * R),),
        "columns": (slice(None), slice(pid * C, (pid + 1) * C)),
        "squeezed": (pid,),
        "unit": (slice(pid, pid + 1),),
        "block3": (slice(pid * A, (pid + 1) * A),),
    }.get(layout, (...,))
    xb = x[window]
    if d["target"] == "scratch":
      if scratch is None or not _whole(d):
        scratch = xb.copy()
      T = scratch
    else:
      T = out[window]              # a view: writes land in `out`
      if d["target"] == "copy" and (pid == 0 or not _whole(d)):
        T[...] = xb
    for s in d["statements"]:
      _model_statement(T, s, pid, strict)
    if d["target"] == "scratch":
      out[window] = T
  return out


# ------------------------------------------------------------------ description
def _show_entries(entries: list, spell: str = "slice") -> str:
  parts = []
  for e in entries:
    if e[0] == "int":
      parts.append(str(e[1]))
    elif e[0] == "intd":
      parts.append(f"(i*{e[1]}+{e[2]})%{e[3]}")
    elif e[0] == "rng":
      parts.append(f"pl.ds({e[1]}, {e[2]})" if spell == "ds" else f"{e[1]}:{e[1] + e[2]}")
    else:
      parts.append(f"pl.ds((i*{e[1]}+{e[2]})%{e[3]}, {e[4]})")
  return ", ".join(parts)


def _show_window(w: dict, name: str = "T") -> str:
  spell = w["spell"]
  if spell == "at":
    return f"{name}.at[{_show_entries(w['outer'])}][{_show_entries(w['inner'])}]"
  if spell == "at2":
    return f"{name}.at[{_show_entries(w['outer'])}].at[{_show_entries(w['inner'])}][...]"
  if spell == "load":
    return f"{w['module']}.load/store({name}.at[{_show_entries(w['entries'])}])"
  return f"{name}[{_show_entries(w['entries'], spell)}]"


def _show_op(op: tuple, v: str) -> str:
  return {"id": v, "add": f"{v} + {op[-1]}", "mul2": f"{v} * 2", "neg": f"-{v}"}[op[0]]


def _show_source(src: dict) -> str:
  kind = src["kind"]
  if kind == "reshaped":
    k = src["k"]
    k = str(k[1]) if k[0] == "int" else f"(i*{k[1]}+{k[2]})%{k[3]}"
    idx = ", ".join(k if i == src["q_axis"] else ":" for i in range(len(src["new"])))
    return f"T[...].reshape{src['new']}.transpose{src['perm']}[{idx}].reshape(V)"
  v = _show_window(src["window"])
  if kind == "reverse":
    return f"flip({v}, {src['axis']})"
  if kind == "roll":
    return f"roll({v}, {src['by']}, axis={src['axis']})"
  if kind == "transpose":
    return f"{v}.{src['spelled']}"
  if kind == "broadcast":
    return f"broadcast({src['how']} axis {src['axis']}: {v})"
  return v


def _show(s: dict) -> str:
  kind, op = s["kind"], s["op"]
  if kind == "copy":
    return f"{_show_window(s['dst'])} = {_show_op(op, _show_source(s['src']))}"
  if kind == "reduce":
    return (f"{_show_window(s['dst'])} = "
            f"{_show_op(op, 'broadcast(sum(' + _show_window(s['src']) + ', -1))')}")
  if kind == "reshape":
    g = {"flip": f"flip(w, {s.get('axis')})", "roll": f"roll(w, {s.get('by')}, {s.get('axis')})",
         "swap": f"swapaxes(w, {s.get('axes')})"}[s["g"]]
    return f"w = T[...].reshape{s['shape']}; T[...] = ({_show_op(op, g)}).reshape(T.shape)"
  if s["how"] == "shift":
    return (f"fori x{s['times']}: shift by {s['by']} along axis {s['axis']} "
            f"{'forwards' if s['forward'] else 'backwards'}"
            f"{'' if s['lead'] is None else ' at leading ' + _show_entries([s['lead']])}"
            f"{' (pl.ds)' if s['ds'] else ''}: dst = {_show_op(op, 'src')}")
  return (f"fori rows {'forwards' if s['forward'] else 'backwards'}: "
          f"T[{'r' if s['scalar'] else 'pl.ds(r, 1)'}] = {_show_op(op, 'previous row')}")


def _describe(d: dict) -> dict:
  return dict(grid=(d["G"],), layout=d["layout"], squeeze=d["squeeze"],
              block=d["kshape"], dtype=d["dtype"], target=d["target"],
              statements=[_show(s) for s in d["statements"]])

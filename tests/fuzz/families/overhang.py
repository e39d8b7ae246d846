"""Blocks past their array's end along the lanes, masked as Triton-style kernels mask
them: a head dimension D (1-40) in blocks of P lanes (the next power of two, or D plus
1-16), rows tiled exactly over a grid of 1-3 programs. Each program loads its rows of
q and windows of K and V through masks `lanes < c` (c at most D, `other` 0, 1 or 2; V
also with no `other` where c = D: the lanes it leaves unspecified lie past the array),
sums the scores `q k^T` (a product over the lanes, the padding's `other`
products included) and accumulates `tanh(q k^T) v` (the lanes free), at once, in a
`fori_loop` over the windows, or to a bound made from the program id; it stores the
accumulator through a mask `lanes < s` (s at most D) or unmasked, into an output
aliased to a poisoned buffer, and the score sums into a second output. Lanes past the
array are read only through masks, so every result is defined; the model computes it
in float64.
"""
from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..case import Case, poison, random_array

HIGHEST = lax.Precision.HIGHEST


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  D = rng.choice([1, 3, 5, 8, 24, 40, rng.randint(1, 40)])
  P = rng.choice([1 << (D - 1).bit_length(), D + rng.randint(1, 16)])
  P = P if P > D else D + 1
  bm, programs = rng.choice([1, 2, 4, 8, 16]), rng.randint(1, 3)
  bk, windows = rng.choice([1, 2, 4, 16]), rng.randint(1, 3)
  edge = lambda: rng.choice([D, D, max(D - 1, 0), rng.randint(0, D)])
  d = dict(D=D, P=P, bm=bm, M=bm * programs, bk=bk, N=bk * windows,
           q=(edge(), rng.choice([0.0, 1.0, 2.0])), k=(edge(), rng.choice([0.0, 1.0, 2.0])),
           # no `other`: masked lanes are unspecified, so only those past the array
           v=rng.choice([(D, None), (edge(), 0.0), (edge(), 1.0)]),
           loop=rng.choice(["none", "static", "program"]) if windows > 1 else "none",
           store=rng.choice([None, edge()]))
  q = random_array(data, (d["M"], D), np.float32)
  k, v = random_array(data, (d["N"], D), np.float32), random_array(data, (d["N"], D), np.float32)
  small = min(bm, d["N"] if d["loop"] == "none" else bk, P) < 16
  return Case(family="overhang", seed=-1, description=d,
              inputs=(q, k, v, poison((d["M"], D), np.float32)),
              run=lambda api, *a: _run(api, d, a), model=lambda *a: _model(d, a),
              triton="tl.dot needs blocks of 16 or more" if small else None,
              tolerance_scale=max(1.0, P * d["N"] / 64))


def _windows(d: dict[str, Any], program: int) -> int:
  n = d["N"] // d["bk"]
  return {"none": 1, "static": n, "program": min(program + 1, n)}[d["loop"]]


def _masked(x: np.ndarray, P: int, mask: tuple[int, Any]) -> np.ndarray:
  """The block of `x` as the masked load gives it: lanes below the edge from the array,
  the others `other` (0 where there is none)."""
  end, other = mask
  block = np.full((x.shape[0], P), 0.0 if other is None else other, np.float64)
  block[:, :end] = x[:, :end]
  return block


def _model(d: dict[str, Any], args: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
  q, k, v, buf = args
  D, P, bm, bk = d["D"], d["P"], d["bm"], d["bk"]
  out, sums = buf.astype(np.float64), np.zeros((d["M"], 1))
  kb, vb = _masked(k, P, d["k"]), _masked(v, P, d["v"])
  rows = d["N"] if d["loop"] == "none" else bk
  for i in range(d["M"] // bm):
    qb = _masked(q[i * bm:(i + 1) * bm], P, d["q"])
    acc = np.zeros((bm, P))
    for j in range(_windows(d, i)):
      s = qb @ kb[j * rows:(j + 1) * rows].T
      sums[i * bm:(i + 1) * bm] += s.sum(axis=1, keepdims=True)
      acc += np.tanh(s) @ vb[j * rows:(j + 1) * rows]
    end = D if d["store"] is None else d["store"]
    out[i * bm:(i + 1) * bm, :end] = acc[:, :end]
  return out.astype(np.float32), sums.astype(np.float32)


def _run(api: Any, d: dict[str, Any], args: tuple[Any, ...]) -> Any:
  pl, plgpu = api.pl, api.plgpu
  P, bm, N = d["P"], d["bm"], d["N"]
  rows = N if d["loop"] == "none" else d["bk"]

  def load(ref, mask):
    end, other = mask
    lanes = jnp.broadcast_to(jnp.arange(P)[None, :], ref.shape)
    return plgpu.load(ref, mask=lanes < end, other=other)

  def kernel(q_ref, k_ref, v_ref, buf_ref, o_ref, s_ref):
    q = load(q_ref, d["q"])

    def step(j, carry):
      acc, sums = carry
      window = pl.ds(j * rows, rows)
      s = jnp.dot(q, load(k_ref.at[window, :], d["k"]).T, precision=HIGHEST)
      v = load(v_ref.at[window, :], d["v"])
      return acc + jnp.dot(jnp.tanh(s), v, precision=HIGHEST), sums + s.sum(axis=1, keepdims=True)

    carry = (jnp.zeros((bm, P), jnp.float32), jnp.zeros((bm, 1), jnp.float32))
    if d["loop"] == "none":
      acc, sums = step(0, carry)
    elif d["loop"] == "static":
      acc, sums = lax.fori_loop(0, N // rows, step, carry)
    else:
      acc, sums = lax.fori_loop(0, jnp.minimum(pl.program_id(0) + 1, N // rows), step, carry)
    if d["store"] is None:
      o_ref[...] = acc
    else:
      lanes = jnp.broadcast_to(jnp.arange(P)[None, :], acc.shape)
      plgpu.store(o_ref, acc, mask=lanes < d["store"])
    s_ref[...] = sums

  q_spec = pl.BlockSpec((bm, P), lambda i: (i, 0))
  kv_spec = pl.BlockSpec((N, P), lambda i: (0, 0))
  call = api.pallas_call(
      kernel, (jax.ShapeDtypeStruct((d["M"], d["D"]), jnp.float32),
               jax.ShapeDtypeStruct((d["M"], 1), jnp.float32)),
      grid=(d["M"] // bm,), in_specs=[q_spec, kv_spec, kv_spec, q_spec],
      out_specs=(q_spec, pl.BlockSpec((bm, 1), lambda i: (i, 0))),
      input_output_aliases={3: 0})
  return call(*args)

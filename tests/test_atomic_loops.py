"""Atomics and masked stores inside `lax.while_loop` / `fori_loop` with a traced trip
count: each loop step applies the atomic to the ref, checked against the same loop
written in jax.numpy on fresh random inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallet as pl
from helpers import assert_close, pallas_call, random_array

N = 16
_OPS = {
    "add": (pl.atomic_add, lambda old, v: old + v),
    "max": (pl.atomic_max, jnp.maximum),
    "min": (pl.atomic_min, jnp.minimum),
    "xchg": (pl.atomic_xchg, lambda old, v: v),
    "and": (pl.atomic_and, lambda old, v: old & v),
    "or": (pl.atomic_or, lambda old, v: old | v),
    "xor": (pl.atomic_xor, lambda old, v: old ^ v),
}
# What each step hits and with what: a static scalar index with a Python constant (a
# literal in the jaxpr), a static slice, the whole ref under a mask.
_TARGETS = {
    "scalar": (3, lambda v: 3),
    "slice": (pl.ds(2, 8), lambda v: v[:8]),
    "masked": ((), lambda v: v),
}


def _loop(kind, n, body, init):
  if kind == "fori":
    return lax.fori_loop(0, n, body, init)
  def step(carry):
    i, acc = carry
    return i + 1, body(i, acc)
  return lax.while_loop(lambda c: c[0] < n, step, (jnp.int32(0), init))[1]


def _reference(op, target, loop, n, x, v):
  combine = _OPS[op][1]
  idx, pick = _TARGETS[target]
  o = x
  total = jnp.zeros((), x.dtype)
  for _ in range(int(n)):
    if target == "scalar":
      old = o[idx]
      o = o.at[idx].set(combine(old, pick(v)))
    elif target == "slice":
      old = o[2:10]
      o = o.at[2:10].set(combine(old, pick(v)))
    else:
      mask = v > 0
      old = jnp.where(mask, o, 0)
      o = jnp.where(mask, combine(o, v), o)
    total = total + jnp.sum(old)
  return o, total


@pytest.mark.parametrize("loop", ["fori", "while"])
@pytest.mark.parametrize("target", sorted(_TARGETS))
@pytest.mark.parametrize("op", sorted(_OPS))
def test_atomic_in_loop_with_traced_trip_count(op, target, loop):
  # (Triton's interpreter exchanges integers only)
  dtype = jnp.float32 if op in ("add", "max", "min") else jnp.int32
  atomic, _ = _OPS[op]
  idx, pick = _TARGETS[target]

  def kernel(n_ref, x_ref, v_ref, o_ref, total_ref):
    o_ref[...] = x_ref[...]

    def body(i, acc):
      v = v_ref[...]
      if target == "masked":
        old = atomic(o_ref, idx, v, mask=v > 0)
        old = jnp.where(v > 0, old, 0)
      else:
        old = atomic(o_ref, idx, pick(v))
      return acc + jnp.sum(old)
    total_ref[0] = _loop(loop, n_ref[0], body, jnp.zeros((), dtype))

  x, v = random_array((N,), dtype), random_array((N,), dtype)
  n = jnp.array([3], jnp.int32)
  out, total = pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((N,), dtype), jax.ShapeDtypeStruct((1,), dtype)))(
          n, x, v)
  want, want_total = _reference(op, target, loop, n[0], x, v)
  assert_close(out, want)
  assert_close(total[0], want_total, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("loop", ["fori", "while"])
def test_atomic_cas_in_loop_with_traced_trip_count(loop):
  def kernel(n_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]

    def body(i, acc):
      # each step swaps in i + 1 where the slot still holds i (a counter by CAS)
      return acc + pl.atomic_cas(o_ref, 5, i.astype(jnp.int32), i.astype(jnp.int32) + 1)
    o_ref[0] = _loop(loop, n_ref[0], body, jnp.int32(0))

  x = random_array((N,), jnp.int32).at[5].set(0)
  n = int(np.random.default_rng().integers(2, 6))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((N,), jnp.int32))(
      jnp.array([n], jnp.int32), x)
  want = x.at[5].set(n).at[0].set(sum(range(n)))
  assert_close(out, want)


@pytest.mark.parametrize("loop", ["fori", "while"])
def test_masked_scalar_store_in_loop_with_traced_trip_count(loop):
  def kernel(n_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]

    def body(i, acc):
      pl.store(o_ref, 4, o_ref[4] * 2.0, mask=True)
      return acc
    _loop(loop, n_ref[0], body, jnp.int32(0))

  x = random_array((N,))
  out = pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((N,), jnp.float32))(
      jnp.array([3], jnp.int32), x)
  assert_close(out, x.at[4].multiply(8.0))

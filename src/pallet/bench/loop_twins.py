"""The algorithm of a kernel with a loop, written as a jax.numpy loop.

A kernel whose own algorithm is a loop (flash attention's online softmax over key
blocks) compiles like a loop, and XLA:CPU compiles a loop body as several kernels
where the loop-free `jax.numpy` twin is one fused program (docs/performance.md,
"Compile time"). The fair first-call comparison for such a kernel is the same
algorithm written by hand in `jax.numpy`: a `lax.fori_loop` over key blocks with
the running max, normaliser and accumulator as its carry, for every head and query
block at once. `python -m pallet.bench.compile_profile --loop-twins` times it next
to pallet and jax.numpy for the rows listed here.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallet.bench import attention
from pallet.bench.case import Size


def online_softmax_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_k: int,
                             causal: bool) -> jax.Array:
  """softmax(q k^T / sqrt(d)) v over (heads, seq, d), key blocks in a fori_loop."""
  heads, seq, d = q.shape
  q = q / math.sqrt(d)
  q_pos = lax.broadcasted_iota(jnp.int32, (seq, block_k), 0)

  def step(j, carry):
    running_max, normaliser, acc = carry
    kb = lax.dynamic_slice_in_dim(k, j * block_k, block_k, axis=1)
    vb = lax.dynamic_slice_in_dim(v, j * block_k, block_k, axis=1)
    s = jnp.einsum("hqd,hkd->hqk", q, kb)
    if causal:
      k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (seq, block_k), 1)
      s = jnp.where(k_pos <= q_pos, s, -jnp.inf)
    new_max = jnp.maximum(running_max, jnp.max(s, axis=-1))
    p = jnp.exp(s - new_max[..., None])
    rescale = jnp.exp(running_max - new_max)
    normaliser = normaliser * rescale + jnp.sum(p, axis=-1)
    acc = acc * rescale[..., None] + jnp.einsum("hqk,hkd->hqd", p, vb)
    return new_max, normaliser, acc

  init = (jnp.full((heads, seq), -jnp.inf, jnp.float32), jnp.zeros((heads, seq), jnp.float32),
          jnp.zeros((heads, seq, d), jnp.float32))
  _, normaliser, acc = lax.fori_loop(0, seq // block_k, step, init)
  return acc / normaliser[..., None]


def _attention(causal: bool, size: Size) -> Callable:
  return functools.partial(online_softmax_attention, block_k=attention.SIZES[size]["block_k"],
                           causal=causal)


# row name -> (size -> the jax.numpy loop program, same inputs as the row)
LOOP_TWINS: dict[str, Callable[[Size], Callable]] = {
    "flash_attention": functools.partial(_attention, False),
    "flash_attention_causal": functools.partial(_attention, True),
}

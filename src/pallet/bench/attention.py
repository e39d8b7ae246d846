"""Flash-attention forward: online softmax over key blocks inside the kernel.

The grid is (batch*heads, query blocks); each step loops over key/value blocks
with `lax.fori_loop`, carrying the running max, normaliser and accumulator. In
the causal variant the trip count depends on the query block index, so a backend
cannot treat the loop as static.
"""
from __future__ import annotations

import functools
import math
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallet.bench.case import Benchmark, Size

SIZES: dict[Size, dict[str, int]] = {
    "full": dict(batch_heads=8, seq=1024, head_dim=64, block_q=128, block_k=128),
    "test": dict(batch_heads=4, seq=384, head_dim=64, block_q=64, block_k=128),
    "small": dict(batch_heads=2, seq=256, head_dim=64, block_q=64, block_k=64),
    "tiny": dict(batch_heads=2, seq=64, head_dim=16, block_q=16, block_k=16),
}


def flash_attention_kernel(pl: ModuleType, *, block_k: int, causal: bool,
                           scale: float):
  """One (head, query block) step: o = softmax(q k^T * scale [masked]) v."""

  def kernel(q_ref, k_ref, v_ref, o_ref):
    block_q, head_dim = q_ref.shape
    seq = k_ref.shape[0]
    q_block = pl.program_id(1)
    q = q_ref[...] * scale
    q_pos = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)

    def step(j, carry):
      running_max, normaliser, acc = carry
      k = k_ref[pl.ds(j * block_k, block_k), :]
      v = v_ref[pl.ds(j * block_k, block_k), :]
      s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
      if causal:
        k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        s = jnp.where(k_pos <= q_pos, s, -jnp.inf)
      new_max = jnp.maximum(running_max, jnp.max(s, axis=1))
      p = jnp.exp(s - new_max[:, None])
      rescale = jnp.exp(running_max - new_max)
      normaliser = normaliser * rescale + jnp.sum(p, axis=1)
      acc = acc * rescale[:, None] + jnp.dot(p, v, preferred_element_type=jnp.float32)
      return new_max, normaliser, acc

    if causal:  # key blocks past the last query of this block are all masked
      num_k_blocks = ((q_block + 1) * block_q + block_k - 1) // block_k
    else:
      num_k_blocks = seq // block_k
    init = (jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32),
            jnp.zeros((block_q, head_dim), jnp.float32))
    _, normaliser, acc = lax.fori_loop(0, num_k_blocks, step, init)
    o_ref[...] = (acc / normaliser[:, None]).astype(o_ref.dtype)

  return kernel


def flash_attention(pl: ModuleType, *, batch_heads: int, seq: int, head_dim: int,
                    block_q: int, block_k: int, causal: bool, **call_kwargs: Any):
  q_spec = pl.BlockSpec((None, block_q, head_dim), lambda b, i: (b, i, 0))
  kv_spec = pl.BlockSpec((None, seq, head_dim), lambda b, i: (b, 0, 0))
  return pl.pallas_call(
      flash_attention_kernel(pl, block_k=block_k, causal=causal,
                             scale=1.0 / math.sqrt(head_dim)),
      out_shape=jax.ShapeDtypeStruct((batch_heads, seq, head_dim), jnp.float32),
      grid=(batch_heads, seq // block_q),
      in_specs=[q_spec, kv_spec, kv_spec],
      out_specs=q_spec,
      **call_kwargs,
  )


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *,
                        causal: bool) -> jax.Array:
  s = jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(q.shape[-1])
  if causal:
    seq = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), s, -jnp.inf)
  p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  return jnp.einsum("bqk,bkd->bqd", p, v)


def _inputs(batch_heads: int, seq: int, head_dim: int,
            key: jax.Array) -> tuple[jax.Array, ...]:
  shape = (batch_heads, seq, head_dim)
  return tuple(jax.random.normal(k, shape, jnp.float32)
               for k in jax.random.split(key, 3))


def benchmarks(size: Size) -> list[Benchmark]:
  s = SIZES[size]
  bh, seq, d = s["batch_heads"], s["seq"], s["head_dim"]
  return [
      Benchmark(
          name="flash_attention_causal" if causal else "flash_attention",
          family="attention",
          grid=(bh, seq // s["block_q"]),
          shapes=(f"{bh} heads x seq {seq} x d {d} f32, "
                  f"{s['block_q']}/{s['block_k']} q/k blocks"),
          make_inputs=functools.partial(_inputs, bh, seq, d),
          reference=functools.partial(attention_reference, causal=causal),
          build_pallas=functools.partial(flash_attention, causal=causal, **s),
          rtol=1e-4,
          atol=1e-5,
      )
      for causal in (False, True)
  ]

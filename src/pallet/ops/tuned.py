"""Autotuned forms of the ops (`pallet.ops.tuned.layer_norm(...)`, ...) and the cases
`pallet tune` runs for them.

Each wraps the op with `pallet.autotune` over its block-size keywords; the first
config is the op's own default (what the plain op uses), so an untuned call (under
grad, or with $PALLET_AUTOTUNE=0) behaves exactly like the plain op. The plain ops
stay untuned: tuning times every config on first use of a shape, which a library
call should not do unasked.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallet.autotune import Case, autotune
from pallet.ops.attention import flash_attention as _flash_attention
from pallet.ops.cross_entropy import linear_cross_entropy as _linear_cross_entropy
from pallet.ops.glu import swiglu as _swiglu
from pallet.ops.normalization import layer_norm as _layer_norm
from pallet.ops.normalization import rms_norm as _rms_norm
from pallet.ops.paged_attention import paged_attention as _paged_attention
from pallet.ops.ragged_dot import ragged_dot as _ragged_dot
from pallet.ops.rope import rotary_embedding as _rotary_embedding
from pallet.ops.softmax import softmax as _softmax

__all__ = ["layer_norm", "rms_norm", "softmax", "linear_cross_entropy", "rotary_embedding",
           "swiglu", "flash_attention", "paged_attention", "ragged_dot", "tuning_cases"]

_ROWS = [{"block_rows": r} for r in (None, 1, 8, 32, 128)]

layer_norm = autotune(_layer_norm, configs=_ROWS, key=("x",))
rms_norm = autotune(_rms_norm, configs=_ROWS, key=("x",))
softmax = autotune(_softmax, configs=_ROWS, key=("x",))
linear_cross_entropy = autotune(
    _linear_cross_entropy, key=("h", "w"),
    configs=[{"block_n": None, "block_v": None, "block_h": None},
             {"block_n": 64, "block_v": 256, "block_h": None},
             {"block_n": 256, "block_v": 1024, "block_h": None},
             {"block_n": 512, "block_v": 512, "block_h": None}])
rotary_embedding = autotune(_rotary_embedding, key=("x",),
                            configs=[{"block_seq": b} for b in (None, 1, 16, 64, 256)])
swiglu = autotune(_swiglu, key=("a",),
                  configs=[{"block_rows": None, "block_cols": None},
                           {"block_rows": 64, "block_cols": 256},
                           {"block_rows": 256, "block_cols": 1024},
                           {"block_rows": 1024, "block_cols": 4096}])
flash_attention = autotune(
    _flash_attention, key=("q", "k"),
    configs=[{"block_q": None, "block_k": None}, {"block_q": 64, "block_k": 64},
             {"block_q": 256, "block_k": 128}, {"block_q": 128, "block_k": 512}])
paged_attention = autotune(_paged_attention, key=("q", "k_pages", "page_indices"),
                           configs=[{"pages_per_compute_block": p, "k_splits": k}
                                    for p, k in ((None, None), (1, None), (4, None), (16, None),
                                                 (64, None), (None, 1), (None, 16))])
ragged_dot = autotune(
    _ragged_dot, key=("lhs", "rhs"),
    configs=[{"block_m": None, "block_k": None, "block_n": None},
             {"block_m": 64, "block_k": None, "block_n": None},
             {"block_m": 128, "block_k": None, "block_n": None},
             {"block_m": 512, "block_k": None, "block_n": None},
             {"block_m": 128, "block_k": 32, "block_n": 128},
             {"block_m": 64, "block_k": 64, "block_n": 128}])


def tuning_cases(size: str = "full") -> list[Case]:
  """One case per tuned op at the benchmark suite's problem sizes (`ops/<op>`), and
  `ops/<op>/<variant>` cases at shapes its defaults were not chosen for."""
  shrink = {"full": 0, "small": 2, "tiny": 4}[size]
  keys = jax.random.split(jax.random.key(0), 4)
  n, d = 4096 >> shrink, 1024 >> shrink
  x, w = jax.random.normal(keys[0], (n, d)), jax.random.normal(keys[1], (d,))
  ce_n, hidden, vocab = 2048 >> shrink, 512 >> shrink, 8192 >> shrink
  h = jax.random.normal(keys[0], (ce_n, hidden))
  wv = jax.random.normal(keys[1], (hidden, vocab)) / hidden ** 0.5
  labels = jax.random.randint(keys[2], (ce_n,), 0, vocab)
  seq = 1024 >> shrink
  q = jax.random.normal(keys[0], (1, 8, seq, 64))
  kv = jax.random.normal(keys[1], (1, 2, seq, 64))
  r = jax.random.normal(keys[3], (2, seq, 8, 64))
  pages = (4096 >> shrink) // 16                  # 4 sequences of up to 1024 >> shrink tokens
  k_pages = jax.random.normal(keys[1], (2, pages, 16, 64))
  table = jax.random.permutation(keys[2], pages).reshape(4, pages // 4)
  lengths = jnp.array([pages * 4, pages * 2, pages, 1], jnp.int32)
  tokens, experts = 4096 >> shrink, 8                # MoE: uneven groups, one empty
  moe_x = jax.random.normal(keys[0], (tokens, d))
  moe_w = jax.random.normal(keys[1], (experts, d, d)) / d ** 0.5
  moe_sizes = jnp.array([22, 7, 0, 29, 2, 15, 13, 12], jnp.int32) * tokens // 100
  # Shapes the defaults were not chosen for: many small experts (a row tile straddles
  # several groups and is multiplied once per group it touches), narrow rows, and a
  # 32K vocabulary.
  many_sizes = jnp.bincount(jax.random.randint(keys[3], (tokens,), 0, 64), length=64)
  narrow, narrow_w = (jax.random.normal(keys[2], (65536 >> shrink, 128)),
                      jax.random.normal(keys[3], (128,)))
  big_h = jax.random.normal(keys[0], (4096 >> shrink, 256))
  big_w = jax.random.normal(keys[1], (256, 32768 >> shrink)) / 16
  big_labels = jax.random.randint(keys[2], (4096 >> shrink,), 0, 32768 >> shrink)
  return [Case("ops/layer_norm", lambda: layer_norm(x, w, w)),
          Case("ops/layer_norm/narrow_rows", lambda: layer_norm(narrow, narrow_w, narrow_w)),
          Case("ops/rms_norm", lambda: rms_norm(x, w)),
          Case("ops/softmax", lambda: softmax(x)),
          Case("ops/linear_cross_entropy", lambda: linear_cross_entropy(h, wv, labels)),
          Case("ops/linear_cross_entropy/large_vocabulary",
               lambda: linear_cross_entropy(big_h, big_w, big_labels)),
          Case("ops/rotary_embedding", lambda: rotary_embedding(r)),
          Case("ops/swiglu", lambda: swiglu(x, x * 0.5)),
          Case("ops/flash_attention", lambda: flash_attention(q, kv, kv, causal=True)),
          Case("ops/paged_attention",
               lambda: paged_attention(jnp.swapaxes(q[0, :, :4], 0, 1), k_pages, k_pages,
                                       lengths, table)),
          Case("ops/ragged_dot", lambda: ragged_dot(moe_x, moe_w, moe_sizes)),
          Case("ops/ragged_dot/64_experts",
               lambda: ragged_dot(moe_x, jnp.tile(moe_w[:, :, :256], (8, 1, 1)),
                                  many_sizes.astype(jnp.int32))),
          ]


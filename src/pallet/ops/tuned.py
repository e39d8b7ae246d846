"""Autotuned forms of the ops (`pallet.ops.tuned.layer_norm(...)`, ...) and the cases
`pallet tune` runs for them.

Each wraps the op with `pallet.autotune` over its block-size keywords and, on a GPU,
over `launch`: whole launch-table sections of its forward kernel (blocks, num_warps,
num_stages; see pallet.ops.launch_table), which `pallet tune` writes into the user's
launch table when one beats the default. The first config is the op's own default
(what the plain op uses), so an untuned call (under grad, or with $PALLET_AUTOTUNE=0)
behaves exactly like the plain op. The plain ops stay untuned: tuning times every
config on first use of a shape, which a library call should not do unasked.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pallet.autotune import Case, autotune
from pallet.ops import launch_table
from pallet.ops._common import target_backend
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
           "swiglu", "flash_attention", "paged_attention", "ragged_dot", "tuning_cases",
           "launch_op"]


def _launched(op: Callable[..., Any], table_name: str) -> Callable[..., Any]:
  """`op` with one more keyword, `launch`: launch-table sections used for the call
  (`launch_table.overriding`); None: the tables' own."""
  @functools.wraps(op)
  def run(*args: Any, launch: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    if launch is None:
      return op(*args, **kwargs)
    with launch_table.overriding(table_name, launch):
      return op(*args, **kwargs)

  signature = inspect.signature(op)
  params = list(signature.parameters.values())
  at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
  params.insert(at, inspect.Parameter("launch", inspect.Parameter.KEYWORD_ONLY, default=None))
  run.__signature__ = signature.replace(parameters=params)
  del run.__wrapped__
  run.launch_op = table_name
  return run


def launch_op(fn: Any) -> str | None:
  """The launch-table op a tuned function's `launch` configs are for (None: none)."""
  return getattr(getattr(fn, "fn", fn), "launch_op", None)


def _on_gpu_only(config: Mapping[str, Any], shapes: Any) -> bool | str:
  if config.get("launch") is not None and target_backend() != "triton":
    return "launch-table configs only change Triton kernels"
  return False


def _tuned(op: Callable[..., Any], table_name: str, key: Sequence[str],
           configs: Sequence[Mapping[str, Any]],
           launches: Sequence[Mapping[str, Any]]) -> Any:
  """autotune over the op's block keywords (`configs`, the first its default) and, on
  Triton, over launch-table sections (`launches`)."""
  blank = {k: None for k in configs[0]}
  every = [{**c, "launch": None} for c in configs] + [{**blank, "launch": dict(l)}
                                                     for l in launches]
  return autotune(_launched(op, table_name), configs=every, key=key, prune=_on_gpu_only)


def _fwd(**params: Any) -> dict[str, dict[str, Any]]:
  return {"fwd": params}


def _rows_launches() -> list[dict[str, Any]]:
  return [_fwd(elements=e, num_warps=w, num_stages=None)
          for e, w in ((4096, 8), (8192, 8), (16384, 16), (2048, 4))]


_ROWS = [{"block_rows": r} for r in (None, 1, 8, 32, 128)]

layer_norm = _tuned(_layer_norm, "layer_norm", ("x",), _ROWS, _rows_launches())
rms_norm = _tuned(_rms_norm, "rms_norm", ("x",), _ROWS, _rows_launches())
softmax = _tuned(_softmax, "softmax", ("x",), _ROWS, _rows_launches())
linear_cross_entropy = _tuned(
    _linear_cross_entropy, "linear_cross_entropy", ("h", "w"),
    [{"block_n": None, "block_v": None, "block_h": None},
     {"block_n": 64, "block_v": 256, "block_h": None},
     {"block_n": 256, "block_v": 1024, "block_h": None},
     {"block_n": 512, "block_v": 512, "block_h": None}],
    [_fwd(block_n=n, block_v=v, block_h=h, num_warps=w, num_stages=s)
     for n, v, h, w, s in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 3),
                           (128, 128, 32, 8, 4))])
rotary_embedding = _tuned(_rotary_embedding, "rotary_embedding", ("x",),
                          [{"block_seq": b} for b in (None, 1, 16, 64, 256)],
                          [_fwd(elements=e, num_warps=w, num_stages=None)
                           for e, w in ((8192, 8), (16384, 8))])
swiglu = _tuned(_swiglu, "glu", ("a",),
                [{"block_rows": None, "block_cols": None},
                 {"block_rows": 64, "block_cols": 256},
                 {"block_rows": 256, "block_cols": 1024},
                 {"block_rows": 1024, "block_cols": 4096}],
                [_fwd(elements=e, max_cols=c, num_warps=w, num_stages=None)
                 for e, c, w in ((8192, 2048, 8), (16384, 4096, 8))])
flash_attention = _tuned(
    _flash_attention, "flash_attention", ("q", "k"),
    [{"block_q": None, "block_k": None}, {"block_q": 64, "block_k": 64},
     {"block_q": 256, "block_k": 128}, {"block_q": 128, "block_k": 512}],
    [_fwd(block_q=q, block_k=k, num_warps=w, num_stages=s)
     for q, k, w, s in ((128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3),
                        (64, 128, 4, 2), (128, 128, 8, 2))])
paged_attention = _tuned(
    _paged_attention, "paged_attention", ("q", "k_pages", "page_indices"),
    [{"pages_per_compute_block": p, "k_splits": k}
     for p, k in ((None, None), (1, None), (4, None), (16, None), (64, None), (None, 1),
                  (None, 16))],
    [_fwd(block_tokens=t, query_rows=16, programs_per_sm=p, split_keys=256, num_warps=w,
          num_stages=s)
     for t, p, w, s in ((32, 4, 4, 3), (128, 4, 4, 2), (64, 8, 4, 3), (64, 2, 8, 3))])
ragged_dot = _tuned(
    _ragged_dot, "ragged_dot", ("lhs", "rhs"),
    [{"block_m": None, "block_k": None, "block_n": None},
     {"block_m": 64, "block_k": None, "block_n": None},
     {"block_m": 128, "block_k": None, "block_n": None},
     {"block_m": 512, "block_k": None, "block_n": None},
     {"block_m": 128, "block_k": 32, "block_n": 128},
     {"block_m": 64, "block_k": 64, "block_n": 128}],
    [_fwd(block_m=m, block_k=k, block_n=n, num_warps=w, num_stages=s)
     for m, k, n, w, s in ((128, 64, 256, 16, 3), (128, 64, 128, 8, 3), (128, 32, 128, 8, 2),
                           (64, 64, 128, 4, 3), (256, 64, 128, 8, 3))])


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


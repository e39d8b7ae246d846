"""pallet.ops against jax.numpy: one row per op forward, one per op forward + backward
(the VJP for a fixed random cotangent).

The twin is the fastest plain jax.numpy form of the op, which is the op's own
`*_reference` where that is already plain; attention and decode attention get
`plain_attention` / `plain_decode_attention` (grouped heads contracted directly, one
`jax.nn.softmax`): their references repeat K/V per query group and guard empty rows,
about 3x slower (docs/ops/benchmarks.md has both).

The ops are written with pallet (`import pallet as pl` inside pallet/ops/*); the
interpret peer runs the very same op source with its module's `pl` bound to
`jax.experimental.pallas` (pallas_call in interpret mode), loaded as a separate copy.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallet.bench.case import Benchmark, Size
from pallet.ops import launch_table

FAMILY = "ops"


# ------------------------------------------------------------------ running an op
@functools.lru_cache(maxsize=None)
def _peer_module(module: str) -> types.ModuleType:
  """A fresh copy of pallet/ops/<module>.py whose `pl` is jax.experimental.pallas."""
  from pallet.bench.peer import peer_pallas
  jpl = peer_pallas()
  spec = importlib.util.find_spec(f"pallet.ops.{module}")
  copy = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(copy)
  shim = types.ModuleType("pallas_interpreted")
  shim.__dict__.update({k: v for k, v in vars(jpl).items() if not k.startswith("__")})
  shim.pallas_call = functools.partial(jpl.pallas_call, interpret=True)
  shim.CompilerParams = _peer_compiler_params(jpl)
  copy.pl = shim
  if hasattr(copy, "launch_table"):
    copy.launch_table = _PeerLaunchTable
  # sibling op modules it calls (decode and paged attention share flash_decoding's
  # kernels) must be peer copies too, or the peer would launch pallet's kernels
  for attr, value in list(vars(copy).items()):
    sibling = getattr(value, "__name__", "")
    if isinstance(value, types.ModuleType) and sibling.startswith("pallet.ops.") \
        and hasattr(value, "pl"):
      setattr(copy, attr, _peer_module(sibling.removeprefix("pallet.ops.")))
  return copy


class _PeerLaunch(launch_table.Launch):
  """pallet's per-GPU blocks, without pallet's compiler-params type (JAX's pallas_call
  takes its own): the peer leaves warps and stages to its backend."""

  def compiler_params(self, *args: Any, **kwargs: Any) -> None:
    return None


class _PeerLaunchTable:
  @staticmethod
  def lookup(op: str, **features: Any) -> _PeerLaunch:
    found = launch_table.lookup(op, **features)
    return _PeerLaunch(**{f.name: getattr(found, f.name)
                          for f in dataclasses.fields(found)})


def _peer_compiler_params(jpl: Any) -> Callable[..., Any]:
  """pallet's `pl.CompilerParams` takes any backend's fields; JAX's is a Protocol. The
  interpreter honours only the grid's dimension semantics, so the peer gets those."""
  def params(dimension_semantics: Any = None, **_backend_specific: Any) -> Any:
    return jpl.tpu.CompilerParams(dimension_semantics=dimension_semantics)
  return params


def _builder(module: str, name: str, wrap: Callable[[Callable], Callable]):
  def build(pl: Any, **call_kwargs: Any) -> Callable[..., Any]:
    if getattr(pl, "__name__", "") != "pallet":
      return wrap(getattr(_peer_module(module), name))
    import pallet.ops
    op = wrap(getattr(pallet.ops, name))
    if "backend" not in call_kwargs:
      return op

    def program(*args):
      with pl.default_backend(call_kwargs["backend"], interpret=call_kwargs.get("interpret")):
        return op(*args)
    return program
  return build


def _vjp(fn: Callable, wrt: int | None = None) -> Callable:
  """(*args, cotangent) -> the VJP of fn at args, w.r.t. its first `wrt` args (all by
  default; the rest, e.g. integer labels or group sizes, held fixed)."""
  def program(*args):
    inputs, cotangent = args[:-1], args[-1]
    count = len(inputs) if wrt is None else wrt
    fixed = inputs[count:]
    _, pullback = jax.vjp(lambda *diff: fn(*diff, *fixed), *inputs[:count])
    return pullback(cotangent)
  return program


def _rows(name: str, module: str, op: str, reference: Callable, *, grid: tuple[int, ...],
          shapes: str, make_inputs: Callable, out_shapes: Callable, kwargs: dict | None = None,
          blocks: dict | None = None, rtol: float = 1e-4, atol: float = 1e-4,
          grad: bool = True, grad_reference: Callable | None = None) -> list[Benchmark]:
  """The forward row `op_<name>` and, with grad, the `op_<name>_grad` row (`kwargs`
  go to op and reference, `blocks` to the op only; without them it runs its defaults;
  `grad_reference`: the twin whose VJP the grad row times, where the fastest plain
  form differs from the forward's; default `reference`)."""
  kwargs = kwargs or {}
  bind = lambda f: (lambda *a: f(*a, **kwargs))
  bind_op = lambda f: (lambda *a: f(*a, **kwargs, **(blocks or {})))
  rows = [Benchmark(name=f"op_{name}", family=FAMILY, grid=grid, shapes=shapes,
                    make_inputs=make_inputs, reference=bind(reference),
                    build_pallas=_builder(module, op, bind_op), rtol=rtol, atol=atol)]
  if grad:
    def with_cotangent(key):
      k1, k2 = jax.random.split(key)
      args = make_inputs(k1)
      shapes_ = out_shapes(*args)
      keys = jax.random.split(k2, len(jax.tree_util.tree_leaves(shapes_)))
      leaves, tree = jax.tree_util.tree_flatten(shapes_)
      cot = tree.unflatten([jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves)])
      return (*args, cot)
    rows.append(Benchmark(
        name=f"op_{name}_grad", family=FAMILY, grid=grid, shapes=shapes + ", fwd+bwd",
        make_inputs=with_cotangent, reference=_vjp(bind(grad_reference or reference)),
        build_pallas=_builder(module, op, lambda f: _vjp(bind_op(f))), rtol=rtol * 10,
        atol=atol * 10))
  return rows


def _normal(key: jax.Array, *shapes: tuple[int, ...], dtype=jnp.float32) -> tuple[jax.Array, ...]:
  keys = jax.random.split(key, len(shapes))
  return tuple(jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes))


def _like(*args):
  return jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)


# ------------------------------------------------------------------ families of rows
_NORM = {"full": (4096, 1024), "test": (768, 192), "small": (512, 256), "tiny": (64, 512)}


def _normalization(size: Size) -> list[Benchmark]:
  from pallet.ops import normalization as m
  from pallet.ops._common import rows_per_block
  n, d = _NORM[size]
  br = rows_per_block(d, n)
  grid = (math.ceil(n / br),)
  shapes = f"{n}x{d} f32, {br}-row blocks"
  return (
      _rows("layer_norm", "normalization", "layer_norm", m.layer_norm_reference, grid=grid,
            shapes=shapes, make_inputs=lambda k: _normal(k, (n, d), (d,), (d,)),
            out_shapes=_like)
      + _rows("layer_norm_residual", "normalization", "layer_norm", m.layer_norm_reference,
              grid=grid, shapes=shapes + ", residual",
              make_inputs=lambda k: _normal(k, (n, d), (d,), (d,), (n, d)),
              out_shapes=lambda x, *_: (_like(x), _like(x)))
      + _rows("rms_norm", "normalization", "rms_norm", m.rms_norm_reference, grid=grid,
              shapes=shapes, make_inputs=lambda k: _normal(k, (n, d), (d,)), out_shapes=_like))


def _softmax(size: Size) -> list[Benchmark]:
  from pallet.ops import softmax_reference
  from pallet.ops._common import rows_per_block
  n, d = _NORM[size]
  br = rows_per_block(d, n)
  return _rows("softmax", "softmax", "softmax", softmax_reference, grid=(math.ceil(n / br),),
               shapes=f"{n}x{d} f32, {br}-row blocks",
               make_inputs=lambda k: tuple(3 * a for a in _normal(k, (n, d))), out_shapes=_like,
               rtol=1e-5, atol=1e-6)


_CE = {"full": (2048, 512, 8192), "test": (512, 256, 4096),
       "small": (256, 128, 2048), "tiny": (256, 32, 1024)}


def _cross_entropy(size: Size) -> list[Benchmark]:
  from pallet.ops import cross_entropy as m
  n, hidden, vocab = _CE[size]

  def make_inputs(key):
    kh, kw, kl = jax.random.split(key, 3)
    h, w = _normal(kh, (n, hidden))[0], _normal(kw, (hidden, vocab))[0] / math.sqrt(hidden)
    return h, w, jax.random.randint(kl, (n,), 0, vocab, jnp.int32)

  rows = _rows("linear_cross_entropy", "cross_entropy", "linear_cross_entropy",
               m.linear_cross_entropy_reference, grid=(math.ceil(n / 128), math.ceil(vocab / 512)),
               shapes=f"{n} rows x hidden {hidden} x vocabulary {vocab} f32, 128x512 blocks",
               make_inputs=make_inputs, out_shapes=lambda h, *_: jax.ShapeDtypeStruct(
                   h.shape[:1], jnp.float32), grad=False)
  rows.append(Benchmark(
      name="op_linear_cross_entropy_grad", family=FAMILY, grid=rows[0].grid,
      shapes=rows[0].shapes + ", fwd+bwd (dh, dW)",
      make_inputs=lambda k: (*make_inputs(k), jax.random.normal(k, (n,), jnp.float32)),
      reference=_vjp(m.linear_cross_entropy_reference, wrt=2),
      build_pallas=_builder("cross_entropy", "linear_cross_entropy",
                            functools.partial(_vjp, wrt=2)),
      rtol=1e-3, atol=1e-3))
  rows.append(Benchmark(
      name="op_linear_cross_entropy_mean_grad", family=FAMILY, grid=rows[0].grid,
      shapes=rows[0].shapes + ", mean loss, grad (dh, dW)", make_inputs=make_inputs,
      reference=_ce_mean_grad(m.linear_cross_entropy_reference),
      build_pallas=_builder("cross_entropy", "linear_cross_entropy", _ce_mean_grad),
      rtol=1e-3, atol=1e-3))
  return rows


def _ce_mean_grad(fn: Callable) -> Callable:
  """The training step's case: the gradient of the mean loss (a scalar cotangent)."""
  def program(h, w, labels):
    return jax.grad(lambda h, w: fn(h, w, labels, reduction="mean"), argnums=(0, 1))(h, w)
  return program


def plain_rotary_embedding(x: jax.Array) -> jax.Array:
  """RoPE at positions 0..seq-1 as x * cos + (-x2, x1) * sin, the halves swapped by
  one concatenation: XLA:CPU fuses it into one vectorized pass, where the op's
  reference (two half-width products concatenated) takes a pass more, 1.2-1.5x its
  time (issue 26)."""
  from pallet.ops.rope import _inverse_frequencies
  b, t, heads, d = x.shape
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * _inverse_frequencies(d, 10000.0)
  cos, sin = jnp.cos(angles)[None, :, None, None, :], jnp.sin(angles)[None, :, None, None, :]
  xs = x.astype(jnp.float32).reshape(b, t, heads, 2, d // 2)
  swapped = jnp.concatenate([-xs[..., 1:, :], xs[..., :1, :]], axis=3)
  return (xs * cos + swapped * sin).reshape(x.shape).astype(x.dtype)


_ROPE = {"full": (4, 1024, 16, 128), "test": (2, 384, 2, 64),
         "small": (2, 256, 4, 64), "tiny": (2, 32, 2, 16)}


def _rope(size: Size) -> list[Benchmark]:
  """At the op's CPU default (one block per sequence); the tiny smoke size passes
  8-position blocks so its grid has several steps along the sequence too. The forward
  twin is `plain_rotary_embedding`; the gradient's, the reference's VJP (faster than
  the plain form's: 0.54 against 0.68 ms at the test size, 82 against 93 ms full)."""
  from pallet.ops import rotary_embedding_reference
  b, t, heads, d = _ROPE[size]
  block = 8 if size == "tiny" else t
  return _rows("rotary_embedding", "rope", "rotary_embedding", plain_rotary_embedding,
               grad_reference=rotary_embedding_reference,
               grid=(b, math.ceil(t / block)), shapes=f"{b}x{t}x{heads}x{d} f32 (batch, seq, "
               f"heads, head_dim), {block}-position blocks", make_inputs=lambda k: _normal(k, (b, t, heads, d)),
               out_shapes=_like, rtol=1e-4, atol=1e-4,
               blocks={"block_seq": 8} if size == "tiny" else None)


_GLU = {"full": (4096, 2816), "test": (768, 512), "small": (512, 704), "tiny": (64, 96)}


def _glu(size: Size) -> list[Benchmark]:
  """At the op's CPU default (the whole array in one block, which XLA fuses like the
  twin); the tiny smoke size passes 16x32 blocks so its grid has several steps."""
  from pallet.ops import swiglu_reference
  n, f = _GLU[size]
  rows, cols = (16, 32) if size == "tiny" else (n, f)
  return _rows("swiglu", "glu", "swiglu", swiglu_reference,
               grid=(math.ceil(n / rows), math.ceil(f / cols)),
               shapes=f"{n}x{f} f32 gate and up, {rows}x{cols} blocks",
               make_inputs=lambda k: _normal(k, (n, f), (n, f)), out_shapes=_like,
               rtol=1e-5, atol=1e-5,
               blocks={"block_rows": 16, "block_cols": 32} if size == "tiny" else None)


_ATTN = {"full": (1, 8, 2, 1024, 64), "test": (2, 4, 2, 384, 64),
         "small": (1, 4, 2, 256, 64), "tiny": (1, 2, 1, 64, 16)}


def plain_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool) -> jax.Array:
  """Grouped-query attention as einsum, softmax, einsum (the query groups of a kv head
  contract against it directly, no repeated K/V)."""
  b, h, t, d = q.shape
  hkv = k.shape[1]
  qg = q.reshape(b, hkv, h // hkv, t, d)
  s = jnp.einsum("bkgtd,bksd->bkgts", qg, k) / math.sqrt(d)
  if causal:
    s = jnp.where(jnp.tril(jnp.ones((t, k.shape[2]), bool)), s, -jnp.inf)
  o = jnp.einsum("bkgts,bksd->bkgtd", jax.nn.softmax(s, axis=-1), v)
  return o.reshape(b, h, t, d)


def plain_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                           lengths: jax.Array) -> jax.Array:
  """One query per sequence against its first `lengths` keys (lengths >= 1)."""
  b, h, d = q.shape
  hkv, s_len = k.shape[1], k.shape[2]
  qg = q.reshape(b, hkv, h // hkv, d)
  s = jnp.einsum("bkgd,bksd->bkgs", qg, k) / math.sqrt(d)
  s = jnp.where(jnp.arange(s_len)[None, None, None, :] < lengths[:, None, None, None], s,
                -jnp.inf)
  return jnp.einsum("bkgs,bksd->bkgd", jax.nn.softmax(s, axis=-1), v).reshape(b, h, d)


def _attention(size: Size) -> list[Benchmark]:
  from pallet.ops.attention import cpu_block
  b, h, hkv, t, d = _ATTN[size]
  block = cpu_block(t)
  rows = []
  for causal in (False, True):
    name = "flash_attention_causal" if causal else "flash_attention"
    rows += _rows(name, "attention", "flash_attention", plain_attention,
                  grid=(b, h, math.ceil(t / block)),
                  shapes=f"B{b} H{h} Hkv{hkv} T{t} D{d} f32 (GQA), {block}x{block} blocks",
                  make_inputs=lambda k: _normal(k, (b, h, t, d), (b, hkv, t, d), (b, hkv, t, d)),
                  out_shapes=_like, kwargs=dict(causal=causal), rtol=1e-4, atol=1e-4)
  return rows


_DECODE = {"full": (8, 32, 8, 4096, 128), "test": (2, 16, 4, 1024, 64),
           "small": (4, 8, 2, 512, 64),
           "tiny": (2, 4, 2, 64, 16)}


def _decode(size: Size) -> list[Benchmark]:
  b, h, hkv, s, d = _DECODE[size]

  def make_inputs(key):
    q, k, v = _normal(key, (b, h, d), (b, hkv, s, d), (b, hkv, s, d))
    return q, k, v, (jnp.arange(b, dtype=jnp.int32) * 7919) % s + 1

  return _rows("decode_attention", "decode_attention", "decode_attention",
               plain_decode_attention, grid=(b, hkv),
               shapes=f"B{b} Hq{h} Hkv{hkv} S{s} D{d} f32, varied lengths",
               make_inputs=make_inputs, out_shapes=None, grad=False, rtol=1e-4, atol=1e-4)


_PAGED = {"full": (8, 32, 8, 4096, 128, 16), "test": (5, 32, 2, 2048, 64, 16),
          "small": (4, 8, 2, 512, 64, 16),
          "tiny": (2, 4, 2, 64, 16, 8)}


def _paged(size: Size) -> list[Benchmark]:
  from pallet.ops import paged_attention_reference
  b, h, hkv, s, d, page = _PAGED[size]
  pages = b * s // page

  def make_inputs(key):
    k1, k2 = jax.random.split(key)
    q, k, v = _normal(k1, (b, h, d), (hkv, pages, page, d), (hkv, pages, page, d))
    table = jax.random.permutation(k2, pages).reshape(b, s // page).astype(jnp.int32)
    return q, k, v, (jnp.arange(b, dtype=jnp.int32) * 7919) % s + 1, table

  return _rows("paged_attention", "paged_attention", "paged_attention",
               paged_attention_reference, grid=(b, hkv),
               shapes=f"B{b} Hq{h} Hkv{hkv} S{s} D{d} f32, {page}-token pages shuffled, "
                      f"varied lengths",
               make_inputs=make_inputs, out_shapes=None, grad=False, rtol=1e-4, atol=1e-4)


_RAGGED = {"full": (4096, 1024, 1024), "test": (512, 2048, 256),
           "small": (1024, 256, 256), "tiny": (512, 32, 32)}
_EXPERT_SHARES = (22, 7, 0, 29, 2, 15, 13, 12)   # percent of the tokens per expert


def _ragged_dot(size: Size) -> list[Benchmark]:
  from pallet.ops import ragged_dot_reference
  m, k, n = _RAGGED[size]
  groups = len(_EXPERT_SHARES)
  sizes = jnp.asarray([share * m // 100 for share in _EXPERT_SHARES], jnp.int32)
  make_inputs = lambda key: (*_normal(key, (m, k), (groups, k, n)), sizes)
  shapes = (f"m{m} k{k} n{n} f32, {groups} groups of {'/'.join(map(str, sizes.tolist()))} "
            f"rows (MoE)")
  rows = _rows("ragged_dot", "ragged_dot", "ragged_dot", ragged_dot_reference,
               grid=(math.ceil(m / 256), 1), shapes=shapes, make_inputs=make_inputs,
               out_shapes=None, grad=False, rtol=1e-4, atol=1e-4)
  rows.append(Benchmark(
      name="op_ragged_dot_grad", family=FAMILY, grid=rows[0].grid,
      shapes=shapes + ", fwd+bwd (dlhs, drhs)",
      make_inputs=lambda key: (*make_inputs(key), jax.random.normal(key, (m, n), jnp.float32)),
      reference=_vjp(ragged_dot_reference, wrt=2),
      build_pallas=_builder("ragged_dot", "ragged_dot", functools.partial(_vjp, wrt=2)),
      rtol=1e-3, atol=1e-3))
  return rows


FAMILIES = (_normalization, _softmax, _cross_entropy, _rope, _glu, _attention, _decode,
            _paged, _ragged_dot)


def benchmarks(size: Size) -> list[Benchmark]:
  return [b for family in FAMILIES for b in family(size)]

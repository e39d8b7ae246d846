"""Kernels written from scratch as a new user would, differentiated and scattered.

Two families, each row timed against the jax.numpy form of the same computation:

* `user_grad`: an elementwise kernel over a 2-D grid, a row softmax, a layer norm, a
  blocked matmul with a k reduction axis (zeroed with `pl.when(k == 0)`, `+=` every
  step) and a fused two-layer MLP over row blocks, each through `jax.grad` (a VJP with
  a random cotangent, w.r.t. every float input), `jax.jvp` (a random tangent per
  input) and `jax.vmap(jax.grad(...))` (per-example gradients of a batch of 4). The
  twin differentiates the jax.numpy program: what pallet must match is JAX's own
  derivative of the same computation, not a hand-written backward kernel.
* `user_atomics`: `pl.atomic_add` with repeated indices: a histogram (values in
  blocks, the counts one resident block aliased to a zero input) and a scatter-add of
  rows of updates into a table by index (the table aliased), against `.at[].add`.

Sizes: `full` is a medium size (hundreds of rows of hundreds of columns), `small` and
`tiny` the sizes of JAX's own tests of such kernels.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallet.bench.case import Benchmark, Size
from pallet.bench.indexing import PEER_ATOMIC_DUPLICATES

GRAD_FAMILY = "user_grad"
ATOMICS_FAMILY = "user_atomics"
EPS = 1e-5

SIZES: dict[Size, dict[str, int]] = {
    "full": dict(rows=1024, cols=512, block_rows=64, block_cols=128, k=512, block_k=128,
                 hidden=1024, batch=4),
    "small": dict(rows=128, cols=128, block_rows=16, block_cols=64, k=128, block_k=32,
                  hidden=256, batch=4),
    "tiny": dict(rows=32, cols=64, block_rows=8, block_cols=32, k=32, block_k=16,
                 hidden=64, batch=2),
}
ATOMIC_SIZES: dict[Size, dict[str, int]] = {
    "full": dict(num_values=256 * 1024, bins=512, block=1024, table_rows=1024, width=64,
                 num_updates=16384, update_block=256),
    "small": dict(num_values=16 * 1024, bins=128, block=512, table_rows=128, width=32,
                  num_updates=1024, update_block=128),
    "tiny": dict(num_values=2048, bins=32, block=256, table_rows=32, width=16,
                 num_updates=256, update_block=64),
}

# The test class is the small preset: JAX's own tests of such kernels use these sizes.
SIZES["test"] = SIZES["small"]
ATOMIC_SIZES["test"] = ATOMIC_SIZES["small"]

# ------------------------------------------------------------------ the computations
def _elementwise(x, y):
  return jnp.sin(x) * y + 0.5 * x * x


def _softmax(x):
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def _layer_norm(x, gamma, beta):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  centered = x - mean
  var = jnp.mean(centered * centered, axis=-1, keepdims=True)
  return centered * jax.lax.rsqrt(var + EPS) * gamma + beta


def _mlp(x, w1, b1, w2, b2):
  h = jax.nn.gelu(jnp.dot(x, w1, preferred_element_type=jnp.float32) + b1)
  return jnp.dot(h, w2, preferred_element_type=jnp.float32) + b2


def _matmul(x, y):
  return jnp.dot(x, y, preferred_element_type=jnp.float32)


# ------------------------------------------------------------------ the kernels
def elementwise_call(pl: ModuleType, *, rows: int, cols: int, block_rows: int,
                     block_cols: int, **call_kwargs: Any):
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = _elementwise(x_ref[...], y_ref[...])

  spec = pl.BlockSpec((block_rows, block_cols), lambda i, j: (i, j))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32),
                        grid=(rows // block_rows, cols // block_cols),
                        in_specs=[spec, spec], out_specs=spec, **call_kwargs)


def softmax_call(pl: ModuleType, *, rows: int, cols: int, block_rows: int, **call_kwargs: Any):
  def kernel(x_ref, o_ref):
    o_ref[...] = _softmax(x_ref[...])

  spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32),
                        grid=(rows // block_rows,), in_specs=[spec], out_specs=spec,
                        **call_kwargs)


def layer_norm_call(pl: ModuleType, *, rows: int, cols: int, block_rows: int,
                    **call_kwargs: Any):
  def kernel(x_ref, g_ref, b_ref, o_ref):
    o_ref[...] = _layer_norm(x_ref[...], g_ref[...], b_ref[...])

  rows_spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
  vec_spec = pl.BlockSpec((cols,), lambda i: (0,))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32),
                        grid=(rows // block_rows,), in_specs=[rows_spec, vec_spec, vec_spec],
                        out_specs=rows_spec, **call_kwargs)


def matmul_call(pl: ModuleType, *, rows: int, cols: int, k: int, block_rows: int,
                block_cols: int, block_k: int, **call_kwargs: Any):
  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    o_ref[...] += _matmul(x_ref[...], y_ref[...])

  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32),
      grid=(rows // block_rows, cols // block_cols, k // block_k),
      in_specs=[pl.BlockSpec((block_rows, block_k), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((block_k, block_cols), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((block_rows, block_cols), lambda i, j, kk: (i, j)),
      **call_kwargs)


def mlp_call(pl: ModuleType, *, rows: int, cols: int, hidden: int, block_rows: int,
             **call_kwargs: Any):
  def kernel(x_ref, w1_ref, b1_ref, w2_ref, b2_ref, o_ref):
    o_ref[...] = _mlp(x_ref[...], w1_ref[...], b1_ref[...], w2_ref[...], b2_ref[...])

  whole = lambda *shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
  rows_spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32),
      grid=(rows // block_rows,),
      in_specs=[rows_spec, whole(cols, hidden), whole(hidden), whole(hidden, cols),
                whole(cols)],
      out_specs=rows_spec, **call_kwargs)


# ------------------------------------------------------------------ inputs
def _normals(key: jax.Array, shapes: list[tuple[int, ...]], scale: float = 1.0):
  keys = jax.random.split(key, len(shapes))
  return tuple(scale * jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes))


def _cases(s: dict[str, int]) -> list[tuple[str, str, Callable, Callable, list, float]]:
  """(name, shapes, reference, pallas builder, input shapes, input scale) per kernel."""
  r, c, br = s["rows"], s["cols"], s["block_rows"]
  return [
      ("elementwise", f"{r}x{c} f32, {br}x{s['block_cols']} blocks, grid 2-D",
       _elementwise, functools.partial(elementwise_call, rows=r, cols=c, block_rows=br,
                                       block_cols=s["block_cols"]), [(r, c), (r, c)], 1.0),
      ("softmax", f"{r}x{c} f32, {br}-row blocks", _softmax,
       functools.partial(softmax_call, rows=r, cols=c, block_rows=br), [(r, c)], 2.0),
      ("layer_norm", f"{r}x{c} f32, {br}-row blocks, gamma/beta", _layer_norm,
       functools.partial(layer_norm_call, rows=r, cols=c, block_rows=br),
       [(r, c), (c,), (c,)], 1.0),
      ("matmul", f"{r}x{s['k']} @ {s['k']}x{c} f32, {br}x{s['block_cols']}x{s['block_k']} "
       f"blocks, k grid axis", _matmul,
       functools.partial(matmul_call, rows=r, cols=c, k=s["k"], block_rows=br,
                         block_cols=s["block_cols"], block_k=s["block_k"]),
       [(r, s["k"]), (s["k"], c)], 1.0),
      ("mlp", f"{r}x{c} f32 rows, hidden {s['hidden']}, gelu, {br}-row blocks", _mlp,
       functools.partial(mlp_call, rows=r, cols=c, hidden=s["hidden"], block_rows=br),
       [(r, c), (c, s["hidden"]), (s["hidden"],), (s["hidden"], c), (c,)], 0.1),
  ]


# ------------------------------------------------------------------ transformations
def _grad(fn: Callable) -> Callable:
  """(*inputs, cotangent) -> the VJP w.r.t. every input."""
  def program(*args):
    _, pullback = jax.vjp(fn, *args[:-1])
    return pullback(args[-1])
  return program


def _jvp(fn: Callable) -> Callable:
  """(*inputs, *tangents) -> (output, output tangent)."""
  def program(*args):
    n = len(args) // 2
    return jax.jvp(fn, args[:n], args[n:])
  return program


def _vmap_grad(fn: Callable) -> Callable:
  """(*batched first input, *rest, batched cotangent) -> per-example gradients of
  <fn(x_b, rest), cot_b> w.r.t. every input."""
  def program(*args):
    def loss(*inputs):
      *inputs, cot = inputs
      return jnp.sum(fn(*inputs) * cot)
    in_axes = (0,) + (None,) * (len(args) - 2) + (0,)
    return jax.vmap(jax.grad(loss, argnums=tuple(range(len(args) - 1))), in_axes)(*args)
  return program


_TRANSFORMS = {"grad": _grad, "jvp": _jvp, "vmap_grad": _vmap_grad}


def _inputs(transform: str, shapes: list, scale: float, out_shape: tuple, batch: int,
            key: jax.Array) -> tuple:
  k1, k2 = jax.random.split(key)
  if transform == "vmap_grad":
    shapes = [(batch, *shapes[0]), *shapes[1:]]
    return (*_normals(k1, shapes, scale), *_normals(k2, [(batch, *out_shape)]))
  primals = _normals(k1, shapes, scale)
  if transform == "grad":
    return (*primals, *_normals(k2, [out_shape]))
  return (*primals, *_normals(k2, shapes))


def _pallas_program(build: Callable, transform: str) -> Callable[..., Callable]:
  def build_pallas(pl: ModuleType, **call_kwargs: Any) -> Callable:
    return _TRANSFORMS[transform](build(pl, **call_kwargs))
  return build_pallas


def grad_benchmarks(size: Size) -> list[Benchmark]:
  s = SIZES[size]
  rows = []
  for name, shapes, reference, build, in_shapes, scale in _cases(s):
    out_shape = (s["rows"], s["cols"])
    for transform in _TRANSFORMS:
      rows.append(Benchmark(
          name=f"user_{name}_{transform}", family=GRAD_FAMILY,
          grid=_grid_of(name, s), shapes=f"{shapes}, {transform}",
          make_inputs=functools.partial(_inputs, transform, in_shapes, scale, out_shape,
                                        s["batch"]),
          reference=_TRANSFORMS[transform](reference),
          build_pallas=_pallas_program(build, transform),
          rtol=2e-4, atol=2e-4))
  return rows


def _grid_of(name: str, s: dict[str, int]) -> tuple[int, ...]:
  r, br = s["rows"] // s["block_rows"], s["cols"] // s["block_cols"]
  return {"elementwise": (r, br), "matmul": (r, br, s["k"] // s["block_k"])}.get(name, (r,))


# ------------------------------------------------------------------ atomics
def histogram_call(pl: ModuleType, *, num_values: int, bins: int, block: int,
                   **call_kwargs: Any):
  def kernel(values_ref, counts_in_ref, counts_ref):
    del counts_in_ref   # aliased to counts_ref: the zero start
    values = values_ref[...]
    pl.atomic_add(counts_ref, values, jnp.ones(values.shape, jnp.int32))

  counts_spec = pl.BlockSpec((bins,), lambda i: (0,))
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((bins,), jnp.int32),
                        grid=(num_values // block,),
                        in_specs=[pl.BlockSpec((block,), lambda i: (i,)), counts_spec],
                        out_specs=counts_spec, input_output_aliases={1: 0}, **call_kwargs)
  return lambda values: call(values, jnp.zeros((bins,), jnp.int32))


def histogram_reference(values: jax.Array, *, bins: int) -> jax.Array:
  return jnp.zeros((bins,), jnp.int32).at[values].add(1)


def scatter_add_call(pl: ModuleType, *, table_rows: int, width: int, num_updates: int,
                     update_block: int, **call_kwargs: Any):
  def kernel(idx_ref, upd_ref, table_in_ref, table_ref):
    del table_in_ref    # aliased to table_ref
    pl.atomic_add(table_ref, idx_ref[...], upd_ref[...])

  table_spec = pl.BlockSpec((table_rows, width), lambda i: (0, 0))
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((table_rows, width), jnp.float32),
      grid=(num_updates // update_block,),
      in_specs=[pl.BlockSpec((update_block,), lambda i: (i,)),
                pl.BlockSpec((update_block, width), lambda i: (i, 0)), table_spec],
      out_specs=table_spec, input_output_aliases={2: 0}, **call_kwargs)


def scatter_add_reference(idx: jax.Array, updates: jax.Array, table: jax.Array) -> jax.Array:
  return table.at[idx].add(updates)


def _histogram_inputs(num_values: int, bins: int, key: jax.Array) -> tuple[jax.Array]:
  u = jax.random.uniform(key, (num_values,), jnp.float32)   # skewed: repeated bins
  return (jnp.minimum((u * u * bins).astype(jnp.int32), bins - 1),)


def _scatter_inputs(table_rows: int, width: int, num_updates: int,
                    key: jax.Array) -> tuple[jax.Array, ...]:
  ki, ku, kt = jax.random.split(key, 3)
  return (jax.random.randint(ki, (num_updates,), 0, table_rows, jnp.int32),
          jax.random.normal(ku, (num_updates, width), jnp.float32),
          jax.random.normal(kt, (table_rows, width), jnp.float32))


def atomic_benchmarks(size: Size) -> list[Benchmark]:
  a = ATOMIC_SIZES[size]
  hist = dict(num_values=a["num_values"], bins=a["bins"], block=a["block"])
  scat = dict(table_rows=a["table_rows"], width=a["width"], num_updates=a["num_updates"],
              update_block=a["update_block"])
  return [
      Benchmark(
          name="user_histogram", family=ATOMICS_FAMILY,
          grid=(a["num_values"] // a["block"],),
          shapes=f"{a['num_values']} int32 values, {a['bins']} bins, blocks of {a['block']}",
          make_inputs=functools.partial(_histogram_inputs, a["num_values"], a["bins"]),
          reference=functools.partial(histogram_reference, bins=a["bins"]),
          build_pallas=functools.partial(histogram_call, **hist), rtol=0.0, atol=0.0,
          peer_known_issue=PEER_ATOMIC_DUPLICATES),
      Benchmark(
          name="user_scatter_add", family=ATOMICS_FAMILY,
          grid=(a["num_updates"] // a["update_block"],),
          shapes=(f"{a['num_updates']} rows of {a['width']} f32 into a {a['table_rows']}-row "
                  f"table, blocks of {a['update_block']}"),
          make_inputs=functools.partial(_scatter_inputs, a["table_rows"], a["width"],
                                        a["num_updates"]),
          reference=scatter_add_reference,
          build_pallas=functools.partial(scatter_add_call, **scat), rtol=1e-5, atol=1e-5,
          peer_known_issue=PEER_ATOMIC_DUPLICATES),
  ]


def benchmarks(size: Size) -> list[Benchmark]:
  return grad_benchmarks(size) + atomic_benchmarks(size)

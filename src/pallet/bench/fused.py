"""A matmul that absorbs the elementwise work around it through the fuser API.

`fusible_matmul` is a fusible kernel in the style of JAX's fusible matmul: its
inputs arrive as fusions (here `x * scale`) pulled block by block into the kernel,
and what the program does with its output (`+ bias`, `relu`) is pushed into the
kernel's epilogue. The benchmark times `fuse(x * s @ y + b -> relu)` against the
same program in plain jax.numpy. `pl` is pallet or jax.experimental.pallas; the
fuser used is that module's `fuser`.
"""
from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from pallet.bench.case import Benchmark, Size

# Row panels (bn = n): each grid step multiplies one panel of rows by all of y, so y is
# read once per step and never replicated across programs.
SIZES: dict[Size, dict[str, Any]] = {
    "full": dict(m=2048, k=1024, n=2048, bm=512, bn=2048),
    "test": dict(m=512, k=512, n=512, bm=128, bn=512),
    "small": dict(m=512, k=512, n=512, bm=128, bn=512),
    "tiny": dict(m=256, k=128, n=256, bm=128, bn=256),
}


def _fuser(pl: ModuleType) -> ModuleType:
  return importlib.import_module(pl.__name__ + ".fuser")


def _matmul_kernel(*refs: Any, fns: tuple, n_prefetch: int) -> None:
  """One (bm, bn) output block: fused inputs, a full-K dot, the fused epilogue."""
  x_fn, y_fn, z_fn, program_id = fns
  prefetch = refs[:n_prefetch] if n_prefetch else ((), (), ())
  x_refs, y_refs, z_refs, o_refs = refs[n_prefetch:]
  pids = (program_id(0), program_id(1))
  load = lambda tree: jax.tree_util.tree_map(lambda r: r[...], tree)
  x = x_fn(pids, prefetch, load(x_refs))
  y = y_fn(pids, prefetch, load(y_refs))
  acc = jnp.dot(x, y, preferred_element_type=jnp.float32)
  out = z_fn(pids, prefetch, load(z_refs), acc)
  for ref, value in zip(jax.tree_util.tree_leaves(o_refs), jax.tree_util.tree_leaves(out)):
    ref[...] = value.astype(ref.dtype)


def _fusible_matmul(x: Any, y: Any, z: Any, *, pl: ModuleType, bm: int, bn: int,
                    call_kwargs: dict) -> Any:
  fuser = _fuser(pl)
  m, k = x.shape
  _, n = y.shape
  z_type = jax.ShapeDtypeStruct((m, n), jnp.float32)
  z = z or (lambda acc: (acc,))
  x_fn, x_values, x_sp = fuser.get_fusion_values(x)
  y_fn, y_values, y_sp = fuser.get_fusion_values(y)
  z_fn, z_values, z_sp = fuser.get_fusion_values(z, z_type)
  handler = fuser.make_scalar_prefetch_handler
  x_fn, (x_specs,), _ = fuser.pull_block_spec(
      x_fn, pl.BlockSpec((bm, k), lambda i, j, *_: (i, 0)), grid_len=2,
      scalar_prefetch_handler=handler(0))(x_values)
  y_fn, (y_specs,), _ = fuser.pull_block_spec(
      y_fn, pl.BlockSpec((k, bn), lambda i, j, *_: (0, j)), grid_len=2,
      scalar_prefetch_handler=handler(1))(y_values)
  z_out_specs = fuser.push_block_spec(z, pl.BlockSpec((bm, bn), lambda i, j, *_: (i, j)))(z_type)
  z_fn, (z_specs, _), _ = fuser.pull_block_spec(
      z_fn, z_out_specs, grid_len=2, scalar_prefetch_handler=handler(2))(z_values, z_type)
  out_type = jax.eval_shape(z, z_type)
  prefetch = (x_sp, y_sp, z_sp)
  n_prefetch = 3 if jax.tree_util.tree_leaves(prefetch) else 0
  kernel = functools.partial(_matmul_kernel, fns=(x_fn, y_fn, z_fn, pl.program_id),
                             n_prefetch=n_prefetch)
  grid = (m // bm, n // bn)
  in_specs = [x_specs, y_specs, z_specs]
  if n_prefetch:
    tpu = importlib.import_module(pl.__name__ + ".tpu")
    call = pl.pallas_call(kernel, out_shape=out_type, grid_spec=tpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=grid, in_specs=in_specs, out_specs=z_out_specs),
        **call_kwargs)
    return call(*jax.tree_util.tree_map(lambda a: jnp.reshape(a, (1,)), prefetch),
                x_values, y_values, z_values)
  return pl.pallas_call(kernel, out_shape=out_type, grid=grid, in_specs=in_specs,
                        out_specs=z_out_specs, **call_kwargs)(x_values, y_values, z_values)


def fusible_matmul(pl: ModuleType, x: jax.Array, y: jax.Array, *, bm: int = 128,
                   bn: int = 128, **call_kwargs: Any) -> jax.Array:
  """`x @ y` in f32 as a fusible kernel (whole K per block)."""
  impl = functools.partial(_fusible_matmul, pl=pl, bm=bm, bn=bn, call_kwargs=call_kwargs)
  out = _fuser(pl).fusible(impl)(x, y)
  return out[0] if isinstance(out, (tuple, list)) else out


def fused_program(pl: ModuleType, *, bm: int, bn: int, **call_kwargs: Any):
  """relu((x * scale) @ y + bias), fused into one kernel."""
  @_fuser(pl).fuse
  def program(x, y, scale, bias):
    out = fusible_matmul(pl, x * scale, y, bm=bm, bn=bn, **call_kwargs)
    return jnp.maximum(out + bias[None, :], 0.0)
  return program


def reference(x: jax.Array, y: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
  out = jnp.dot(x * scale, y, preferred_element_type=jnp.float32)
  return jnp.maximum(out + bias[None, :], 0.0)


def _inputs(m: int, k: int, n: int, key: jax.Array) -> tuple[jax.Array, ...]:
  kx, ky, ks, kb = jax.random.split(key, 4)
  return (jax.random.normal(kx, (m, k), jnp.float32),
          jax.random.normal(ky, (k, n), jnp.float32),
          jax.random.uniform(ks, (m, k), jnp.float32, 0.5, 1.5),
          jax.random.normal(kb, (n,), jnp.float32))


def benchmarks(size: Size) -> list[Benchmark]:
  p = SIZES[size]
  return [Benchmark(
      name="fused_matmul_epilogue",
      family="fused",
      grid=(p["m"] // p["bm"], p["n"] // p["bn"]),
      shapes=f"{p['m']}x{p['k']} @ {p['k']}x{p['n']} f32, scale/bias/relu fused",
      make_inputs=functools.partial(_inputs, p["m"], p["k"], p["n"]),
      reference=reference,
      build_pallas=functools.partial(fused_program, bm=p["bm"], bn=p["bn"]),
      rtol=1e-4, atol=1e-3)]

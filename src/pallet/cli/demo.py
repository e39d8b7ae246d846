"""`pallet demo`: a small gallery of kernels run on the default backend.

Each kernel is checked against the same computation written in jax.numpy, and
both are timed (median of several runs after a warm-up), so the table shows at a
glance that the kernels are right and how close to XLA they run.
"""
from __future__ import annotations

import functools
import os
import sys
import statistics
import time
from collections.abc import Callable, Sequence
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np

import pallet as pl
from pallet import backends


# ------------------------------------------------------------------ the kernels
def add_kernel(x_ref, y_ref, o_ref):
  """One block of a vector add."""
  o_ref[...] = x_ref[...] + y_ref[...]


def vector_add(x: jax.Array, y: jax.Array, block: int = 65536) -> jax.Array:
  spec = pl.BlockSpec((block,), lambda i: (i,))
  return pl.pallas_call(add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(pl.cdiv(x.shape[0], block),), in_specs=[spec, spec],
                        out_specs=spec)(x, y)


def matmul_kernel(x_ref, y_ref, o_ref):
  """One (i, j) output block, accumulated over the k grid axis."""
  @pl.when(pl.program_id(2) == 0)
  def _zero():
    o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)


def matmul(x: jax.Array, y: jax.Array, block: int = 128) -> jax.Array:
  m, k = x.shape
  _, n = y.shape
  return pl.pallas_call(
      matmul_kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(m // block, n // block, k // block),
      in_specs=[pl.BlockSpec((block, block), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((block, block), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((block, block), lambda i, j, kk: (i, j)))(x, y)


def softmax_kernel(x_ref, o_ref):
  """Numerically stable softmax of a block of rows."""
  x = x_ref[...]
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  o_ref[...] = e / jnp.sum(e, axis=-1, keepdims=True)


def row_softmax(x: jax.Array, rows: int = 8) -> jax.Array:
  spec = pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))
  return pl.pallas_call(softmax_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(x.shape[0] // rows,), in_specs=[spec], out_specs=spec)(x)


def layer_norm_kernel(x_ref, o_ref, *, eps: float):
  x = x_ref[...]
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
  o_ref[...] = (x - mean) * jax.lax.rsqrt(var + eps)


def layer_norm(x: jax.Array, rows: int = 8, eps: float = 1e-5) -> jax.Array:
  spec = pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))
  return pl.pallas_call(functools.partial(layer_norm_kernel, eps=eps),
                        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(x.shape[0] // rows,), in_specs=[spec], out_specs=spec)(x)


def _layer_norm_ref(x, eps=1e-5):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + eps)


# ------------------------------------------------------------------ the gallery
def _gallery(scale: int):
  keys = jax.random.split(jax.random.key(0), 4)
  n = 1 << (20 + scale)
  x, y = (jax.random.normal(k, (n,), jnp.float32) for k in keys[:2])
  a = jax.random.normal(keys[2], (512, 512), jnp.float32)
  b = jax.random.normal(keys[3], (512, 512), jnp.float32)
  rows = jax.random.normal(keys[0], (2048 << scale, 1024), jnp.float32)
  return [
      ("vector add", f"{n} f32, 64K blocks", vector_add, lambda x, y: x + y, (x, y), 1e-6),
      ("blocked matmul", "512^3 f32, 128 blocks", matmul,
       lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32), (a, b), 1e-4),
      ("row softmax", f"{rows.shape[0]}x1024, 8 rows", row_softmax,
       lambda x: jax.nn.softmax(x, axis=-1), (rows,), 1e-5),
      ("layer norm", f"{rows.shape[0]}x1024, 8 rows", layer_norm, _layer_norm_ref,
       (rows,), 1e-4),
  ]


def busy_note() -> str | None:
  """A warning when the machine is busy (the threshold `pallet bench` uses), else None."""
  try:
    load = os.getloadavg()[0]
  except (OSError, AttributeError):
    return None
  cores = os.cpu_count() or 1
  if load <= 0.5 * cores:
    return None
  return (f"note: machine busy (1-min load average {load:.2f} on {cores} cores); "
          f"timings will be noisy")


def interleaved_ms(fns: Sequence[Callable], args: tuple, reps: int) -> list[float]:
  """Median ms of each of `fns` over `reps` rounds, each round calling every fn once
  in turn, so a load spike slows all of them rather than one."""
  samples: list[list[float]] = [[] for _ in fns]
  for _ in range(reps):
    for fn, times in zip(fns, samples):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append((time.perf_counter() - start) * 1e3)
  return [statistics.median(times) for times in samples]


def run(scale: int = 0, reps: int = 7, backend: str | None = None) -> int:
  """Runs the gallery (on `backend` when given); returns 0 when every kernel matches
  jax.numpy."""
  if backend is None:
    return _run(scale, reps)
  if backends.canonical(backend) == "triton" and not _triton_installed():
    print("pallet demo --backend triton needs the triton package "
          "(pip install 'pallet[triton]')", file=sys.stderr)
    return 2
  with backends.default_backend(backend):
    return _run(scale, reps)


def _triton_installed() -> bool:
  try:
    metadata.version("triton")
  except metadata.PackageNotFoundError:
    return False
  return True


def _run(scale: int, reps: int) -> int:
  backend, interpret = backends.resolve(None, False)
  how = " under Triton's interpreter (no GPU: slow)" if interpret else ""
  print(f"pallet {pl.__version__} on {jax.devices()[0].platform} "
        f"(backend '{backend}'{how}), jax {jax.__version__}")
  note = busy_note()
  if note:
    print(note, flush=True)
  header = f"{'kernel':<16}{'size':<24}{'max err':>10}{'pallet ms':>11}{'jnp ms':>9}{'ratio':>7}  ok"
  print(header)
  print("-" * len(header))
  failures = 0
  for name, size, kernel_fn, ref_fn, args, tol in _gallery(scale):
    pallet_fn, jnp_fn = jax.jit(kernel_fn), jax.jit(ref_fn)
    got, want = pallet_fn(*args), jnp_fn(*args)   # also the warm-up: compiles both
    err = float(jnp.max(jnp.abs(got - want)))
    ok = bool(np.allclose(got, want, rtol=tol, atol=tol * 10))
    failures += not ok
    pallet_ms, jnp_ms = interleaved_ms([pallet_fn, jnp_fn], args, reps)
    print(f"{name:<16}{size:<24}{err:>10.2e}{pallet_ms:>11.2f}{jnp_ms:>9.2f}"
          f"{pallet_ms / jnp_ms:>7.2f}  {'yes' if ok else 'NO'}", flush=True)
  print("all kernels match jax.numpy" if not failures else f"{failures} kernel(s) differ")
  return 1 if failures else 0


# ------------------------------------------------------------------ tuned versions
def _divides(*names: str) -> Callable:
  """A prune rule: drop a config whose `block` does not divide every dim of `names`."""
  def prune(config: dict, shapes: dict) -> str:
    bad = [n for n in names if any(d % config["block"] for d in shapes[n].shape)]
    return f"block {config['block']} does not divide the shape of {bad}" if bad else ""
  return prune


tuned_vector_add = pl.autotune(
    vector_add, configs=[{"block": b} for b in (65536, 16384, 262144, 1 << 20)],
    key=("x", "y"), blocks=lambda c: {"x": (c["block"],)})
tuned_matmul = pl.autotune(
    matmul, configs=[{"block": b} for b in (128, 64, 256, 512)], key=("x", "y"),
    prune=_divides("x", "y"))
tuned_row_softmax = pl.autotune(
    row_softmax, configs=[{"rows": r} for r in (8, 32, 128, 512)], key=("x",),
    blocks=lambda c: {"x": (c["rows"], None)},
    prune=lambda c, shapes: shapes["x"].shape[0] % c["rows"] != 0)
tuned_layer_norm = pl.autotune(
    layer_norm, configs=[{"rows": r} for r in (8, 32, 128, 512)], key=("x",),
    blocks=lambda c: {"x": (c["rows"], None)},
    prune=lambda c, shapes: shapes["x"].shape[0] % c["rows"] != 0)


def tuning_cases(size: str = "full") -> list:
  """The gallery's kernels for `pallet tune`, each with its first config the default
  the untuned gallery uses."""
  from pallet.autotune import Case
  shrink = {"full": 0, "small": 1, "tiny": 2}[size]
  keys = jax.random.split(jax.random.key(0), 4)
  n, m, rows = (1 << 20) >> shrink, 512 >> shrink, 2048 >> shrink
  x, y = (jax.random.normal(k, (n,), jnp.float32) for k in keys[:2])
  a, b = (jax.random.normal(k, (m, m), jnp.float32) for k in keys[2:])
  r = jax.random.normal(keys[0], (rows, 1024 >> shrink), jnp.float32)
  return [Case("demo/vector_add", lambda: tuned_vector_add(x, y)),
          Case("demo/matmul", lambda: tuned_matmul(a, b)),
          Case("demo/row_softmax", lambda: tuned_row_softmax(r)),
          Case("demo/layer_norm", lambda: tuned_layer_norm(r))]

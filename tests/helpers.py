"""Shared test helpers: the backend under test, random inputs, dtype tolerances.

Every kernel test launches through `pallas_call` below, so that the whole suite can
be re-run on another backend by setting `PALLET_TEST_BACKEND` (e.g. `triton`, which
then runs with `interpret=True`).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallet as pl

BACKEND_ENV = "PALLET_TEST_BACKEND"


def current_test_backend() -> str:
  """The backend name the kernel tests run on ("xla" unless the environment says)."""
  return os.environ.get(BACKEND_ENV, "xla").strip().lower() or "xla"


def pallas_call(kernel: Callable[..., None], out_shape: Any, **kwargs: Any) -> Callable:
  """`pl.pallas_call` on the backend under test: on the GPU where one is present, else
  interpreted (Triton's interpreter)."""
  backend = current_test_backend()
  kwargs.setdefault("backend", backend)
  if backend != "xla":
    kwargs.setdefault("interpret", not runs_on_gpu())
  return pl.pallas_call(kernel, out_shape, **kwargs)


@functools.lru_cache(maxsize=None)
def runs_on_gpu() -> bool:
  """True when JAX's default device is a GPU and TRITON_INTERPRET does not force the
  interpreter: kernel tests then run the generated Triton code on the hardware."""
  from pallet.backends import generated_code_on_gpu
  return generated_code_on_gpu()


# ------------------------------------------------------------------ inputs
_rng_counter = [0]


def random_array(shape: tuple[int, ...], dtype: Any = jnp.float32, *, seed: int | None = None,
                 low: int = -50, high: int = 50) -> jax.Array:
  """Fresh random values (never zeros-only): normals for floats, uniform ints otherwise."""
  if seed is None:
    _rng_counter[0] += 1
    seed = _rng_counter[0]
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    x = rng.standard_normal(shape).astype(np.float32)
  elif dtype == jnp.bool_:
    x = rng.integers(0, 2, shape).astype(bool)
  else:
    info = jnp.iinfo(dtype)
    x = rng.integers(max(low, info.min), min(high, info.max) + 1, shape)
  return jnp.asarray(x, dtype)


def sds(x: Any) -> jax.ShapeDtypeStruct:
  """The ShapeDtypeStruct of an array (for out_shape)."""
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


def poisoned(shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
  """A buffer whose every element shows if a kernel failed to write it."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.full(shape, jnp.nan, dtype)
  return jnp.full(shape, jnp.iinfo(dtype).min, dtype)


# ------------------------------------------------------------------ comparison
_TOLERANCES = {
    jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-5),
    jnp.dtype(jnp.float16): dict(rtol=2e-3, atol=2e-3),
    jnp.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=2e-2),
    jnp.dtype(jnp.float64): dict(rtol=1e-12, atol=1e-12),
}


def tolerance(dtype: Any, *, matmul: bool = False) -> dict[str, float]:
  """rtol/atol fitting a dtype (exact for integers); looser for matmul accumulation."""
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    return dict(rtol=0, atol=0)
  tol = dict(_TOLERANCES.get(dtype, dict(rtol=1e-5, atol=1e-5)))
  if matmul:
    tol = {k: v * 20 for k, v in tol.items()}
  return tol


def assert_close(actual: Any, expected: Any, *, matmul: bool = False, **overrides: Any) -> None:
  """Compares pytrees leaf by leaf with the tolerance of the expected dtype."""
  a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
  e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
  assert a_tree == e_tree, f"structure {a_tree} != {e_tree}"
  for a, e in zip(a_leaves, e_leaves):
    e = jnp.asarray(e)
    assert jnp.shape(a) == e.shape, f"shape {jnp.shape(a)} != {e.shape}"
    assert jnp.asarray(a).dtype == e.dtype, f"dtype {jnp.asarray(a).dtype} != {e.dtype}"
    tol = {**tolerance(e.dtype, matmul=matmul), **overrides}
    np.testing.assert_allclose(np.asarray(a, np.float64) if e.dtype == jnp.bfloat16 else
                               np.asarray(a),
                               np.asarray(e, np.float64) if e.dtype == jnp.bfloat16 else
                               np.asarray(e), **tol)


# ------------------------------------------------------------------ several devices
def run_on_simulated_devices(code: str | None = None, *, path: str | None = None,
                             devices: int = 4, env: dict[str, str] | None = None,
                             timeout: int = 300) -> str:
  """Runs Python `code` (or the script at `path`) in its own process with `devices`
  simulated CPU devices (the device count is fixed when JAX starts); returns its
  stdout and stderr together."""
  import subprocess
  import sys
  full_env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
              "JAX_PLATFORMS": "cpu", **(env or {})}
  command = [sys.executable, path] if path is not None else [sys.executable, "-c", code]
  done = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=timeout)
  return done.stdout + done.stderr

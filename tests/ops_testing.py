"""Helpers for the pallet.ops tests: the backend under test, and forward + VJP
comparison of an op against its jax.numpy reference on fresh random inputs."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallet as pl
from helpers import current_test_backend, random_array, tolerance

DTYPES = (jnp.float32, jnp.bfloat16)


def on_test_backend() -> contextlib.AbstractContextManager:
  """Runs the ops' pallas_calls on the backend under test (Triton: on the GPU where one
  is present, else interpreted)."""
  backend = current_test_backend()
  if backend == "xla":
    return contextlib.nullcontext()
  return pl.default_backend(backend, interpret=None)


def assert_close_scaled(actual: Any, expected: Any, *, scale: float = 1.0) -> None:
  """Leaf by leaf: |a - e| <= rtol*|e| + atol*max|e| with the dtype's tolerances
  (times `scale`), so gradients of large magnitude get a fitting absolute bound."""
  a_leaves, e_leaves = jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)
  assert len(a_leaves) == len(e_leaves)
  for k, (a, e) in enumerate(zip(a_leaves, e_leaves)):
    assert a.shape == e.shape, f"leaf {k}: shape {a.shape} != {e.shape}"
    assert a.dtype == e.dtype, f"leaf {k}: dtype {a.dtype} != {e.dtype}"
    tol = tolerance(e.dtype)
    a64, e64 = np.asarray(a, np.float64), np.asarray(e, np.float64)
    bound = float(np.max(np.abs(e64))) if e64.size else 0.0
    np.testing.assert_allclose(a64, e64, rtol=tol["rtol"] * scale,
                               atol=tol["atol"] * scale * max(bound, 1.0),
                               err_msg=f"leaf {k}")


def check_op(op: Callable, reference: Callable, args: Sequence[Any], *,
             argnums: Sequence[int] = (0,), scale: float = 1.0, grad_scale: float | None = None,
             grad: bool = True, blocks: dict[str, Any] | None = None, **kwargs: Any) -> None:
  """op(*args, **blocks, **kwargs) matches reference(*args, **kwargs), and so do their
  VJPs w.r.t. `argnums` for a random cotangent (`blocks`: the op's block sizes)."""
  blocks = blocks or {}
  with on_test_backend():
    out = op(*args, **blocks, **kwargs)
  expected = reference(*args, **kwargs)
  assert_close_scaled(out, expected, scale=scale)
  if not grad:
    return
  cot = jax.tree_util.tree_map(lambda e: random_array(e.shape, e.dtype), expected)

  def vjp(fn, extra):
    def f(*diff):
      full = list(args)
      for i, v in zip(argnums, diff):
        full[i] = v
      return fn(*full, **extra, **kwargs)
    _, pullback = jax.vjp(f, *[args[i] for i in argnums])
    return pullback(cot)

  with on_test_backend():
    got = vjp(op, blocks)
  assert_close_scaled(got, vjp(reference, {}), scale=grad_scale or scale)


def inputs(shapes: Sequence[tuple[int, ...]], dtype: Any) -> list[jax.Array]:
  return [random_array(s, dtype) for s in shapes]

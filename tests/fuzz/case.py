"""A generated case: the description, its inputs, how to run it on an API, its model."""
from __future__ import annotations

import dataclasses
import pprint
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass
class Case:
  """One random kernel (or a few calls of kernels) and what it must compute.

  `run(api, *inputs)` builds the kernel against `api` and returns its outputs (a pytree
  of arrays); `model(*inputs)` computes them with NumPy from the description alone.
  `jax_oracle` / `triton` are None when JAX's interpreter is a valid oracle / the Triton
  backend can express the case, else the reason why not. `tolerance_scale` loosens
  float comparisons where the kernel sums many terms in an order the model does not fix.
  `may_refuse` says why pallet may refuse the kernel with an error (only accepted where
  JAX's interpreter refuses it too); anywhere else an error from pallet is a failure.
  """
  family: str
  seed: int
  description: dict[str, Any]
  inputs: tuple[np.ndarray, ...]
  run: Callable[..., Any]
  model: Callable[..., Any] | None
  jax_oracle: str | None = None
  triton: str | None = None
  tpu_interpreter: bool = False
  tolerance_scale: float = 1.0
  may_refuse: str | None = None

  @property
  def id(self) -> str:
    return f"{self.family}-{self.seed}"

  def describe(self) -> str:
    shapes = [f"{x.dtype}{list(x.shape)}" for x in self.inputs]
    return (f"case {self.id}\n  inputs: {', '.join(shapes)}\n"
            + "\n".join("  " + line for line in
                        pprint.pformat(self.description, width=96, sort_dicts=False).splitlines()))


_FLOAT_TOLERANCE = {
    np.dtype(np.float64): (1e-10, 1e-10),
    np.dtype(np.float32): (2e-5, 2e-5),
    np.dtype(np.float16): (4e-3, 4e-3),
}


def tolerance(dtype: Any, scale: float = 1.0) -> tuple[float, float]:
  """(rtol, atol) for a dtype: exact for integers and booleans."""
  dtype = np.dtype(dtype)
  if dtype.kind in "iub":
    return 0.0, 0.0
  if dtype.name == "bfloat16":
    rtol, atol = 3e-2, 3e-2
  else:
    rtol, atol = _FLOAT_TOLERANCE.get(dtype, (2e-5, 2e-5))
  return rtol * scale, atol * scale


def to_numpy(tree: Any) -> Any:
  """Arrays of a pytree as NumPy arrays (lists and tuples kept)."""
  if isinstance(tree, (list, tuple)):
    return type(tree)(to_numpy(t) for t in tree)
  if isinstance(tree, dict):
    return {k: to_numpy(v) for k, v in tree.items()}
  return np.asarray(tree)


def mismatch(actual: Any, expected: Any, *, scale: float = 1.0, path: str = "out") -> str | None:
  """None when `actual` matches `expected` (structure, shape, dtype kind, values within
  the tolerance of the expected dtype, NaN where NaN is expected), else what differs."""
  if isinstance(expected, (list, tuple)):
    if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
      return f"{path}: structure {type(actual).__name__} of {_len(actual)} != {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
      found = mismatch(a, e, scale=scale, path=f"{path}[{i}]")
      if found:
        return found
    return None
  a, e = np.asarray(actual), np.asarray(expected)
  if a.shape != e.shape:
    return f"{path}: shape {a.shape} != {e.shape}"
  rtol, atol = tolerance(e.dtype, scale)
  if e.dtype.kind in "iub":
    if a.dtype.kind not in "iub":
      return f"{path}: dtype {a.dtype} where {e.dtype} was expected"
    bad = a.astype(np.int64) != e.astype(np.int64)
  else:
    a64, e64 = a.astype(np.float64), e.astype(np.float64)
    nan_e, nan_a = np.isnan(e64), np.isnan(a64)
    with np.errstate(invalid="ignore"):
      bad = (nan_e != nan_a) | (~nan_e & ~nan_a
                                & ~(np.abs(a64 - e64) <= atol + rtol * np.abs(e64)))
  if not bad.any():
    return None
  where = [tuple(int(i) for i in idx) for idx in np.argwhere(bad)[:4]]
  samples = ", ".join(f"{w}: {a[w]!r} vs {e[w]!r}" for w in where)
  return (f"{path}: {int(bad.sum())} of {bad.size} elements differ "
          f"(rtol={rtol:g}, atol={atol:g}); e.g. {samples}")


def _len(x: Any) -> str:
  return str(len(x)) if isinstance(x, (list, tuple)) else "1"


def random_array(data: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
  """Fresh random values, never all zeros: normals for floats, small integers else."""
  dtype = np.dtype(dtype)
  if dtype.kind == "b":
    return data.integers(0, 2, shape).astype(bool)
  if dtype.kind in "iu":
    info = np.iinfo(dtype)
    return data.integers(max(-50, info.min), min(50, info.max) + 1, shape).astype(dtype)
  return data.standard_normal(shape).astype(dtype)


def poison(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
  """A buffer whose every element shows if a kernel leaves it unwritten."""
  dtype = np.dtype(dtype)
  if dtype.kind in "iu":
    return np.full(shape, np.iinfo(dtype).min, dtype)
  return np.full(shape, np.nan, dtype)

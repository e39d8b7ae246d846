"""What generated Triton code manipulates: typed values and their padded shapes.

Triton tensors must have power-of-two dimensions, so a value of logical shape
(3, 100) lives in a (4, 128) tensor; the extra elements are "padding" that
reductions, dots and stores mask out. Every `Value` knows both shapes.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Iterator

import numpy as np

from pallet.errors import TritonLoweringError


def next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def padded(shape: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(next_pow2(d) for d in shape)


_TL_DTYPES = {
    "bool": "tl.int1", "int8": "tl.int8", "int16": "tl.int16", "int32": "tl.int32",
    "int64": "tl.int64", "uint8": "tl.uint8", "uint16": "tl.uint16",
    "uint32": "tl.uint32", "uint64": "tl.uint64", "float16": "tl.float16",
    "bfloat16": "tl.bfloat16", "float32": "tl.float32", "float64": "tl.float64",
    "float8_e4m3fn": "tl.float8e4nv", "float8_e5m2": "tl.float8e5",
}
# Names in Triton's kernel signatures ("*fp32" for a pointer to float32).
_SIGNATURE_NAMES = {
    "bool": "i1", "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64",
    "float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
}


# Code generated for Triton's interpreter differs from the GPU program in two ways:
# bf16 values are stored and computed as float32 (the interpreter keeps raw bf16 bits
# and computes with them wrongly), and what only a GPU can run (inline assembly) is
# refused at generation time.
_for_interpreter = contextvars.ContextVar("pallet_triton_for_interpreter", default=False)


@contextlib.contextmanager
def for_interpreter() -> Iterator[None]:
  token = _for_interpreter.set(True)
  try:
    yield
  finally:
    _for_interpreter.reset(token)


def generating_for_interpreter() -> bool:
  return _for_interpreter.get()


def _name(dtype: Any) -> str:
  name = np.dtype(dtype).name
  return "float32" if name == "bfloat16" and _for_interpreter.get() else name


def tl_dtype(dtype: Any) -> str:
  name = _name(dtype)
  if name not in _TL_DTYPES:
    raise TritonLoweringError(f"dtype {name} has no Triton equivalent")
  return _TL_DTYPES[name]


def signature_dtype(dtype: Any) -> str:
  return _SIGNATURE_NAMES[_name(dtype)]


def is_float(dtype: Any) -> bool:
  """Floating point, bfloat16 and float8 included (NumPy knows neither as floating)."""
  import jax.numpy as jnp
  return bool(jnp.issubdtype(np.dtype(dtype), jnp.floating))


def is_int(dtype: Any) -> bool:
  return np.issubdtype(np.dtype(dtype), np.integer)


def is_signed(dtype: Any) -> bool:
  return np.issubdtype(np.dtype(dtype), np.signedinteger)


def is_bool(dtype: Any) -> bool:
  return np.dtype(dtype) == np.bool_


def bit_width(dtype: Any) -> int:
  return np.dtype(dtype).itemsize * 8


def python_literal(value: Any, dtype: Any) -> str:
  """Source text for a scalar constant of `dtype`."""
  if is_bool(dtype):
    return "True" if bool(value) else "False"
  if is_float(dtype):
    f = float(value)
    if math.isnan(f):
      return 'float("nan")'
    if math.isinf(f):
      return 'float("inf")' if f > 0 else '-float("inf")'
    return repr(f)
  return str(int(value))


@dataclasses.dataclass(frozen=True)
class Value:
  """A value in the generated code: an expression (usually a variable name),
  its logical shape and dtype, and its Python value when it is a constant."""
  expr: str
  shape: tuple[int, ...]
  dtype: np.dtype
  constant: Any = None

  @property
  def tensor_shape(self) -> tuple[int, ...]:
    return padded(self.shape)

  @property
  def is_padded(self) -> bool:
    return self.tensor_shape != self.shape

  @property
  def is_constant(self) -> bool:
    return self.constant is not None

  @property
  def typed(self) -> str:
    """An expression of exactly this dtype and shape (constants become tensors)."""
    if self.is_constant:
      return (f"tl.full({list(self.tensor_shape)}, "
              f"{python_literal(self.constant, self.dtype)}, {tl_dtype(self.dtype)})")
    return self.expr


def constant(value: Any, dtype: Any, shape: tuple[int, ...] = ()) -> Value:
  dtype = np.dtype(dtype)
  return Value(python_literal(value, dtype), shape, dtype, np.asarray(value, dtype).item())

"""Running generated Triton code on the CPU with Triton's interpreter.

`interpret=True, backend="triton"` executes the exact program that would run on
a GPU, through `triton`'s interpreter (numpy semantics, one program at a time),
from a host callback. Two pieces make that possible without torch:

* `HostTensor`: the few torch-tensor methods the interpreter calls on kernel
  arguments (`data_ptr`, `untyped_storage`, `set_`, ...), over a numpy array.
  Zero-copy: the interpreter reads and writes the array's own memory.
* `numpy_libdevice`: libdevice functions (tanh, erfinv, popc, ...) computed with
  numpy, since the interpreter cannot call external device libraries.

Both lean on interpreter internals of triton 3.x (`TensorHandle`, the argument
protocol of `GridExecutor`); see tests/triton for the version they are tested with.
"""
from __future__ import annotations

import math
import threading
import types
from typing import Any, Sequence

import numpy as np

from pallet.backends.triton.compiler import load_module
from pallet.core.checks import record_failure
from pallet.errors import KernelCheckError


class _HostStorage:
  """The 'untyped storage' of a HostTensor: the bytes of its base array."""

  def __init__(self, base: np.ndarray):
    self.bytes = base.reshape(-1, order="A").view(np.uint8)

  def data_ptr(self) -> int:
    return self.bytes.__array_interface__["data"][0]

  def cpu(self) -> "_HostStorage":
    return self

  def copy_(self, other: "_HostStorage") -> None:
    if other.data_ptr() != self.data_ptr():
      np.copyto(self.bytes, other.bytes)


class HostTensor:
  """A numpy array that Triton's interpreter accepts as a kernel argument."""

  device = "cpu"

  def __init__(self, array: np.ndarray):
    if not array.flags.c_contiguous:
      array = np.ascontiguousarray(array)
    self.array = array
    base = array
    while isinstance(base.base, np.ndarray):
      base = base.base
    self._storage = _HostStorage(base if base.flags.c_contiguous else array)

  @property
  def dtype(self) -> np.dtype:
    return self.array.dtype

  @property
  def data(self) -> "HostTensor":
    return self

  @property
  def shape(self) -> tuple[int, ...]:
    return self.array.shape

  def data_ptr(self) -> int:
    return self.array.__array_interface__["data"][0]

  def untyped_storage(self) -> _HostStorage:
    return self._storage

  def storage_offset(self) -> int:
    return (self.data_ptr() - self._storage.data_ptr()) // self.array.itemsize

  def size(self) -> tuple[int, ...]:
    return self.array.shape

  def stride(self, dim: int | None = None):
    strides = tuple(s // self.array.itemsize for s in self.array.strides)
    return strides if dim is None else strides[dim]

  def new_empty(self, *sizes: Any, device: Any = None) -> "HostTensor":
    return HostTensor(np.empty(0, self.array.dtype))

  def set_(self, storage: _HostStorage, offset: int, size: Sequence[int],
           stride: Sequence[int]) -> "HostTensor":
    item = self.array.itemsize
    self._storage = storage
    self.array = np.ndarray(tuple(size), self.array.dtype, buffer=storage.bytes,
                            offset=offset * item, strides=tuple(s * item for s in stride))
    return self

  def copy_(self, other: "HostTensor") -> "HostTensor":
    np.copyto(self.array, other.array)
    return self


# ------------------------------------------------------------------ libdevice on numpy
def _wrap(fn):
  def call(*args, _semantic=None, **kwargs):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle
    first = next(a for a in args if isinstance(a, tl.tensor))
    data = [a.handle.data if isinstance(a, tl.tensor) else a for a in args]
    with np.errstate(all="ignore"):
      out = np.asarray(fn(*data))
    dtype = first.handle.dtype.scalar if hasattr(first.handle.dtype, "scalar") else \
        first.handle.dtype
    if out.dtype != first.handle.data.dtype:
      out = out.astype(first.handle.data.dtype)
    return tl.tensor(TensorHandle(out, dtype), first.type)
  return call


def _erfinv(y):
  y = np.asarray(y)
  wide = y.astype(np.float64)
  # Giles' single-precision approximation, then Newton steps on erf.
  w = -np.log((1.0 - wide) * (1.0 + wide))
  small = w < 5.0
  ws = w - 2.5
  wl = np.sqrt(np.maximum(w, 5.0)) - 3.0
  p_small = 2.81022636e-08
  for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
            -0.00125372503, -0.00417768164, 0.246640727, 1.50140941):
    p_small = c + p_small * ws
  p_large = -0.000200214257
  for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
            -0.0076224613, 0.00943887047, 1.00167406, 2.83297682):
    p_large = c + p_large * wl
  x = np.where(small, p_small, p_large) * wide
  erf = np.vectorize(math.erf)
  for _ in range(2):
    finite = np.isfinite(x)
    xf = np.where(finite, x, 0.0)
    err = erf(xf) - wide
    x = np.where(finite, xf - err / (2.0 / math.sqrt(math.pi) * np.exp(-xf * xf)), x)
  x = np.where(wide == 1.0, np.inf, np.where(wide == -1.0, -np.inf, x))
  return np.where(np.abs(wide) > 1.0, np.nan, x)


def _popc(x):
  x = np.asarray(x)
  unsigned = x.view(np.dtype(f"u{x.itemsize}"))
  return np.bitwise_count(unsigned).astype(x.dtype)


def _clz(x):
  x = np.asarray(x)
  bits = x.itemsize * 8
  u = x.view(np.dtype(f"u{x.itemsize}")).astype(np.uint64)
  count = np.zeros(x.shape, np.int64)
  for b in range(bits):
    leading = (u >> np.uint64(bits - 1 - b)) == 0
    count += leading    # the top b+1 bits are all zero
  return count.astype(x.dtype)


def _values(x) -> np.ndarray:
  """The numbers an interpreter tensor holds (float8 is held as its raw bits)."""
  import ml_dtypes
  import triton.language as tl
  stored = {tl.float8e4nv: ml_dtypes.float8_e4m3fn, tl.float8e5: ml_dtypes.float8_e5m2}
  source = x.handle.dtype.scalar if hasattr(x.handle.dtype, "scalar") else x.handle.dtype
  data = x.handle.data
  return np.asarray(data.view(stored[source]) if source in stored else data)


def _tensor(data: np.ndarray, dtype, like):
  """An interpreter tensor of `dtype` holding `data`, shaped as `like`."""
  import triton.language as tl
  from triton.runtime.interpreter import TensorHandle
  ty = tl.block_type(dtype, like.type.shape) if like.type.is_block() else dtype
  return tl.tensor(TensorHandle(data, dtype), ty)


def _to_float8(name: str):
  """A conversion to float8 `name` with XLA's rounding (to nearest even; ml_dtypes)."""
  def convert(x, _semantic=None):
    import ml_dtypes
    import triton.language as tl
    target = {"float8_e4m3fn": tl.float8e4nv, "float8_e5m2": tl.float8e5}[name]
    with np.errstate(all="ignore"):
      bits = _values(x).astype(getattr(ml_dtypes, name)).view(np.uint8)
    return _tensor(bits, target, x)
  return convert


def _to_bfloat16(x, _semantic=None):
  """A conversion to bfloat16 (to nearest even; ml_dtypes), held in float32 as the
  interpreter's code holds bfloat16: without it `.astype(bf16)` would not round."""
  import ml_dtypes
  import triton.language as tl
  with np.errstate(all="ignore"):
    rounded = _values(x).astype(ml_dtypes.bfloat16).astype(np.float32)
  return _tensor(rounded, tl.float32, x)


numpy_libdevice = types.SimpleNamespace(
    to_bfloat16=_to_bfloat16,
    tan=_wrap(np.tan), asin=_wrap(np.arcsin), acos=_wrap(np.arccos), atan=_wrap(np.arctan),
    sinh=_wrap(np.sinh), cosh=_wrap(np.cosh), tanh=_wrap(np.tanh),
    asinh=_wrap(np.arcsinh), acosh=_wrap(np.arccosh), atanh=_wrap(np.arctanh),
    expm1=_wrap(np.expm1), log1p=_wrap(np.log1p), cbrt=_wrap(np.cbrt),
    erfinv=_wrap(_erfinv), erfc=_wrap(np.vectorize(math.erfc)),
    lgamma=_wrap(np.vectorize(math.lgamma)), atan2=_wrap(np.arctan2),
    pow=_wrap(np.power), nextafter=_wrap(np.nextafter),
    popc=_wrap(_popc), popcll=_wrap(_popc), clz=_wrap(_clz), clzll=_wrap(_clz),
    to_float8_e4m3fn=_to_float8("float8_e4m3fn"), to_float8_e5m2=_to_float8("float8_e5m2"),
)


# ------------------------------------------------------------------ running a kernel
def check_interpreter_enabled(kernel: Any) -> None:
  """Triton decides at import time whether its own library functions (tl.sum,
  tl.cdiv, ...) are compiled or interpreted, so the interpreter needs
  TRITON_INTERPRET=1 before `triton` is first imported."""
  import triton
  if not triton.knobs.runtime.interpret:
    raise RuntimeError(
        f"kernel '{kernel.name}' ({kernel.source}): backend='triton' with interpret=True runs "
        f"the generated code under Triton's interpreter, which must be switched on before "
        f"triton is imported: set the environment variable TRITON_INTERPRET=1 when starting "
        f"Python (this process imported triton without it)")


# Triton's interpreter swaps global state (its `interpret` knob, the `tl` functions) while a
# kernel loads and runs; host callbacks of several devices (shard_map) call in from threads.
_ONE_AT_A_TIME = threading.Lock()


def run(generated: Any, operands: Sequence[np.ndarray],
        aliases: dict[int, int]) -> list[np.ndarray]:
  """Runs the generated kernel on host arrays; returns the outputs."""
  with _ONE_AT_A_TIME:
    return _run(generated, operands, aliases)


def _run(generated: Any, operands: Sequence[np.ndarray],
         aliases: dict[int, int]) -> list[np.ndarray]:
  check_interpreter_enabled(generated.kernel)
  gm = generated.kernel.grid_mapping
  module = load_module(generated.source, True)
  module.libdevice = numpy_libdevice   # no GPU: libdevice's functions run on numpy
  fn = getattr(module, generated.function_name)
  ins = [_contiguous(_widen(np.asarray(a))) for a in operands]
  n_pre = len(gm.dynamic_axes) + len(gm.prefetch_avals)   # operands before the inputs
  for j in generated.written_inputs:   # never write into the caller's (JAX's) buffers
    ins[n_pre + j] = np.array(ins[n_pre + j], copy=True)
  by_output = {o: i for i, o in aliases.items()}
  buffers = []
  for k, b in enumerate(gm.outputs):
    init = ins[n_pre + by_output[k]] if k in by_output else \
        np.zeros(b.array_shape, _widen(np.zeros((), b.dtype)).dtype)
    buffers.append(_GuardedBuffer(init))
  if generated.workspace_bytes:
    buffers.append(_GuardedBuffer(np.zeros(
        generated.workspace_bytes * generated.schedule.num_programs, np.int8)))
  flags = np.zeros(len(generated.check_messages), np.int32)
  args = [HostTensor(a) for a in ins] + \
      [HostTensor(_contiguous(_widen(c))) for c in generated.constants] + \
      [HostTensor(b.array) for b in buffers] + \
      ([HostTensor(flags)] if flags.size else []) + \
      [HostTensor(ins[n_pre + j]) for j in generated.written_inputs]
  if generated.schedule.num_programs and 0 not in gm.grid:
    fn[generated.launch_grid](*args)
  for b, what in zip(buffers, [o.origin for o in gm.outputs] + ["the workspace"]):
    b.check(generated.kernel, what)
  failed = [(m, int(f)) for m, f in zip(generated.check_messages, flags) if f]
  if failed:
    checked = [(m, f) for m, f in failed if getattr(m, "info", None) is not None]
    if not checked:
      raise record_failure(KernelCheckError(failed[0][0]))
    # the failure at the first grid step (the largest flag), as a run in grid order sees it
    message, flag = max(checked, key=lambda mf: mf[1])
    raise record_failure(message.info.error(message, message.info.unravel(2147483647 - flag)))
  return [_narrow(b.array, o.dtype) for b, o in zip(buffers, gm.outputs)]


def _narrow(a: np.ndarray, dtype: Any) -> np.ndarray:
  """An output in its own dtype; bf16 held in float32 is rounded, except NaNs, whose
  bits (a bf16 NaN's, shifted up) are kept as they are."""
  out = a.astype(dtype)
  if np.dtype(dtype).name == "bfloat16":
    nan = np.isnan(a)
    if nan.any():
      bits = (a.view(np.uint32) >> 16).astype(np.uint16)
      out = np.where(nan, bits.view(dtype), out)
  return out


def _contiguous(a: np.ndarray) -> np.ndarray:
  """`a` in C order with its own shape (np.ascontiguousarray makes 0-d arrays 1-d)."""
  return np.ascontiguousarray(a).reshape(a.shape)


def _widen(a: np.ndarray) -> np.ndarray:
  """bf16 arrays as float32: the interpreter's code holds bf16 values in float32."""
  return a.astype(np.float32) if a.dtype.name == "bfloat16" else a


class _GuardedBuffer:
  """An output buffer with guard bytes on both sides: on a GPU a write out of
  bounds corrupts memory silently; here it is caught and named."""
  GUARD = 4096

  def __init__(self, init: np.ndarray):
    nbytes = init.nbytes
    self.raw = np.full(nbytes + 2 * self.GUARD, 0xA5, np.uint8)
    inner = self.raw[self.GUARD:self.GUARD + nbytes]
    self.array = inner.view(init.dtype).reshape(init.shape) if nbytes else \
        np.zeros(init.shape, init.dtype)
    self.array[...] = init

  def check(self, kernel: Any, what: str) -> None:
    g = self.GUARD
    if (self.raw[:g] != 0xA5).any() or (self.raw[-g:] != 0xA5).any():
      raise RuntimeError(f"kernel '{kernel.name}' ({kernel.source}) wrote outside "
                         f"{what} (out-of-bounds store found by pallet's interpreter guard)")

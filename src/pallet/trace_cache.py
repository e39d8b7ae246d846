"""The cache of traced kernels: a second `pallas_call` with the same kernel,
shapes and specs reuses the `KernelDescription` instead of re-tracing the user's
Python function (and, since the description is the same object, the compiled
executable too).

Keys are the kernel's content, not object identity: a Python function by its code,
globals, defaults and the values it closes over, and an array it closes over (a
NumPy or concrete JAX array) by its shape, dtype and bytes. So a kernel defined
afresh on every call, around a fresh array, still hits.

Correctness over hits: a key is built only from values whose equality implies
the same trace (types are part of the key, so `1`, `1.0` and `True` differ);
anything that cannot be frozen that way (mutable objects that define equality but
no hash, NumPy arrays over `MAX_ARRAY_BYTES`) disables caching for that call. Like
`jax.jit`, the cache assumes that module globals a kernel reads do not change
between calls.

Bounded: this cache and every per-kernel cache made with `kernel_cache` hold at
most `MAX_KERNELS` entries each, least recently used first out.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import hashlib
import types
from typing import Any, Callable

import numpy as np

from pallet import _internals as internals

MAX_KERNELS = 128                  # entries per cache (traced kernels, compiled calls, ...)
MAX_ARRAY_BYTES = 1 << 20          # closed-over arrays up to this size are keyed by content


class LRU:
  """A mapping that forgets its least recently used entries beyond `MAX_KERNELS`."""

  def __init__(self):
    self._data: collections.OrderedDict = collections.OrderedDict()
    _all_caches.append(self)

  def get(self, key: Any) -> Any:
    value = self._data.get(key)
    if value is not None:
      self._data.move_to_end(key)
    return value

  def put(self, key: Any, value: Any) -> None:
    self._data[key] = value
    self._data.move_to_end(key)
    while len(self._data) > MAX_KERNELS:
      self._data.popitem(last=False)

  def __len__(self) -> int:
    return len(self._data)

  def clear(self) -> None:
    self._data.clear()


_all_caches: list[LRU] = []


def kernel_cache(fn: Callable) -> Callable:
  """Memoizes `fn` (hashable positional arguments: kernel descriptions, names) in an
  `LRU`, so what it keeps alive for a kernel is bounded like the trace cache."""
  cache = LRU()

  @functools.wraps(fn)
  def cached(*args):
    hit = cache.get(args)
    if hit is None:
      hit = fn(*args)
      cache.put(args, hit)
    return hit
  cached.cache = cache
  cached.cache_clear = cache.clear
  return cached


_cache = LRU()
stats = collections.Counter()      # "hit", "miss", "uncacheable": how lookups went


class _Unhashable(Exception):
  pass


_MAX_NODES = 10_000    # freezing a key visits at most this many values


class _Walk:
  """Bounds a freeze: a value budget, and the containers being frozen right now (a
  container reached again inside itself is a cycle: not cached)."""

  def __init__(self):
    self.budget = _MAX_NODES
    self.active: set[int] = set()

  def enter(self, x: Any) -> None:
    self.budget -= 1
    if self.budget < 0 or id(x) in self.active:
      raise _Unhashable
    self.active.add(id(x))

  def leave(self, x: Any) -> None:
    self.active.discard(id(x))


def freeze(x: Any, walk: _Walk | None = None) -> Any:
  """A hashable value equal for equal inputs and different for different types."""
  walk = walk or _Walk()
  if x is None or isinstance(x, (str, bytes, bool, int, float, complex, enum.Enum)):
    return (type(x), x)
  if isinstance(x, np.generic):
    return (type(x), x.item())
  walk.enter(x)
  try:
    return _freeze_container(x, walk)
  finally:
    walk.leave(x)


def _freeze_container(x: Any, walk: _Walk) -> Any:
  if isinstance(x, (list, tuple)):
    return (tuple, tuple(freeze(v, walk) for v in x))
  if isinstance(x, dict):
    try:
      items = sorted(x.items())
    except TypeError:
      raise _Unhashable from None
    return (dict, tuple((freeze(k, walk), freeze(v, walk)) for k, v in items))
  if isinstance(x, (functools.partial, types.FunctionType)):
    return _freeze_function(x, walk)
  if isinstance(getattr(x, "aval", None), internals.AbstractRef) and not internals.is_tracer(x):
    return ("ref", _Same(x))     # a jax.new_ref array: mutable, so the same ref only
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return (type(x), tuple(freeze(getattr(x, f.name), walk) for f in dataclasses.fields(x)))
  if isinstance(x, np.ndarray) or (hasattr(x, "__array__") and not internals.is_tracer(x)
                                   and hasattr(x, "dtype")):
    return _freeze_array(x)
  if internals.is_tracer(x) or hasattr(x, "__array__"):
    raise _Unhashable
  try:
    hash(x)
  except TypeError:
    raise _Unhashable from None
  return (type(x), x)


class _Same:
  """Keys an immutable object by identity (and keeps it alive while keyed)."""

  def __init__(self, x: Any):
    self.x = x

  def __hash__(self) -> int:
    return id(self.x)

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, _Same) and other.x is self.x


def _freeze_array(x: Any) -> Any:
  """Small arrays by content; a large JAX array (immutable) by identity."""
  if x.nbytes > MAX_ARRAY_BYTES:
    if isinstance(x, np.ndarray):
      raise _Unhashable            # mutable, and too large to compare each call
    return ("array", _Same(x))
  try:
    data = np.ascontiguousarray(np.asarray(x))
  except Exception:                # e.g. an array spread over devices of other hosts
    raise _Unhashable from None
  return ("array", type(x), data.shape, str(data.dtype),
          hashlib.blake2b(data.view(np.uint8).reshape(-1), digest_size=32).digest())


def freeze_callable(fn: Any) -> Any:
  """Python functions are keyed by what decides their behaviour: their code, module
  globals, defaults and the values they close over. So the fresh lambdas and nested
  kernels that an op builds on every call still hit; other callables by identity."""
  if isinstance(fn, (functools.partial, types.FunctionType)):
    return freeze(fn)
  return ("callable", id(fn), fn)


def _freeze_function(fn: Any, walk: _Walk) -> Any:
  if isinstance(fn, functools.partial):
    return (functools.partial, freeze(fn.func, walk), freeze(fn.args, walk),
            freeze(dict(fn.keywords), walk))
  cells = []
  for cell in fn.__closure__ or ():
    try:
      cells.append(freeze(cell.cell_contents, walk))
    except ValueError:                 # a cell not yet filled
      cells.append(("empty",))
  return (types.FunctionType, fn.__code__, id(fn.__globals__),
          freeze(fn.__defaults__, walk), freeze(fn.__kwdefaults__, walk), tuple(cells),
          freeze(getattr(fn, "__dict__", {}), walk))


def lookup(kernel: Callable, key: Any, build: Callable[[], Any]) -> Any:
  """The cached result for (kernel, key), else `build()` (cached when it is safe)."""
  try:
    full_key = (freeze_callable(kernel), freeze(key))
    hash(full_key)
  except (_Unhashable, TypeError):
    stats["uncacheable"] += 1
    return build()
  hit = _cache.get(full_key)
  if hit is not None:
    stats["hit"] += 1
    return hit
  stats["miss"] += 1
  description = build()
  if _has_tracer_consts(description):
    return description          # index maps closed over values of an outer trace
  _cache.put(full_key, description)
  return description


def _has_tracer_consts(description: Any) -> bool:
  gm = description.grid_mapping
  jaxprs = [description.jaxpr] + [b.index_map for b in (*gm.inputs, *gm.outputs)]
  return (any(internals.is_tracer(c) for j in jaxprs for c in j.consts)
          or any(internals.is_tracer(v) for v in description.closed_over))


def clear() -> None:
  """Empties every cache (the trace cache and each `kernel_cache`)."""
  for cache in _all_caches:
    cache.clear()
  stats.clear()

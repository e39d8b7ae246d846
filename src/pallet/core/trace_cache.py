"""The cache of traced kernels: a second `pallas_call` with the same kernel,
shapes and specs reuses the `KernelDescription` instead of re-tracing the user's
Python function (and, since the description is the same object, the compiled
executable too).

Keys are the kernel's content, not object identity: a Python function by its code,
defaults, the values it closes over and the values of the module globals its code
reads (followed through the helper functions, classes and modules of user code it
reaches; installed packages and pallet itself are assumed, like `jax.jit` assumes,
not to change their globals), and an array (a NumPy or concrete JAX array) by its
shape, dtype and bytes. So a kernel defined afresh on every call, around a fresh
array, still hits, and one redefined around another global value does not.

Correctness over hits: a key is built only from values whose equality implies
the same trace (types are part of the key, so `1`, `1.0` and `True` differ);
anything that cannot be frozen that way (mutable objects that define equality but
no hash, NumPy arrays over `MAX_ARRAY_BYTES`, more than `_MAX_NODES` values)
disables caching for that call. docs/caching.md lists every cache pallet keeps and
why its key is complete.

Bounded: this cache and every per-kernel cache made with `kernel_cache` hold at
most `MAX_KERNELS` entries each, least recently used first out.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import hashlib
import os
import site
import sys
import sysconfig
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
  """Bounds a freeze: a value budget, and the values being frozen right now. A value
  reached again inside itself (a recursive helper naming itself, a method naming its
  class) is keyed by its depth on that path, which keeps the key faithful. `names` are
  the attribute names the code being keyed may read off modules and objects."""

  def __init__(self):
    self.budget = _MAX_NODES
    self.active: dict[int, int] = {}
    self.names: frozenset[str] = frozenset()

  def enter(self, x: Any) -> None:
    self.budget -= 1
    if self.budget < 0:
      raise _Unhashable
    self.active[id(x)] = len(self.active)

  def leave(self, x: Any) -> None:
    self.active.pop(id(x), None)


def freeze(x: Any, walk: _Walk | None = None) -> Any:
  """A hashable value equal for equal inputs and different for different types."""
  walk = walk or _Walk()
  if x is None or isinstance(x, (str, bytes, bool, int, float, complex, enum.Enum)):
    return (type(x), x)
  if isinstance(x, np.generic):
    return (type(x), x.item())
  if id(x) in walk.active:
    return ("back to depth", walk.active[id(x)])
  walk.enter(x)
  try:
    return _freeze_container(x, walk)
  finally:
    walk.leave(x)


def _freeze_container(x: Any, walk: _Walk) -> Any:
  if isinstance(x, (list, tuple)):
    return (tuple, tuple(freeze(v, walk) for v in x))
  if isinstance(x, (set, frozenset)):
    return (frozenset, frozenset(freeze(v, walk) for v in x))
  if isinstance(x, dict):
    try:
      items = sorted(x.items())
    except TypeError:
      raise _Unhashable from None
    return (dict, tuple((freeze(k, walk), freeze(v, walk)) for k, v in items))
  if isinstance(x, (functools.partial, types.FunctionType)):
    return _freeze_function(x, walk)
  if isinstance(x, (types.MethodType, staticmethod, classmethod)):
    self = getattr(x, "__self__", None)
    return (type(x), freeze(x.__func__, walk), None if self is None else freeze(self, walk))
  if isinstance(x, property):
    return (property, freeze(x.fget, walk), freeze(x.fset, walk), freeze(x.fdel, walk))
  if isinstance(x, types.ModuleType):
    return _freeze_module(x, walk)
  if isinstance(x, type):
    return _freeze_class(x, walk)
  if isinstance(getattr(x, "aval", None), internals.AbstractRef) and not internals.is_tracer(x):
    return ("ref", _Same(x))     # a jax.new_ref array: mutable, so the same ref only
  if dataclasses.is_dataclass(x):
    return (freeze(type(x), walk),
            tuple(freeze(getattr(x, f.name), walk) for f in dataclasses.fields(x)))
  if isinstance(x, np.ndarray) or (hasattr(x, "__array__") and not internals.is_tracer(x)
                                   and hasattr(x, "dtype")):
    return _freeze_array(x)
  if internals.is_tracer(x) or hasattr(x, "__array__"):
    raise _Unhashable
  try:
    hash(x)
  except TypeError:
    raise _Unhashable from None
  if callable(getattr(x, "__wrapped__", None)):    # jax.jit(f) and other wrappers
    return (type(x), x, freeze(x.__wrapped__, walk))
  if not _is_library_class(type(x)):
    return _freeze_user_object(x, walk)
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
  """Python functions are keyed by what decides their behaviour: their code, defaults,
  the values they close over and the values of the module globals they read. So the
  fresh lambdas and nested kernels that an op builds on every call still hit, and a
  kernel redefined around another global value does not."""
  return freeze(fn)


# ------------------------------------------------------------------ functions and globals
# Code of installed packages (the standard library, site-packages) and of pallet itself
# is library code: like `jax.jit`, the cache assumes its module globals stay as they
# are, and keys them by the module. Every other function (a script, a notebook cell, a
# test) is keyed by the values of the globals it reads, followed through the helper
# functions, classes and user modules it reaches.
def _library_roots() -> tuple[str, ...]:
  roots = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}   # src/pallet
  for name in ("stdlib", "platstdlib", "purelib", "platlib"):
    path = sysconfig.get_paths().get(name)
    if path:
      roots.add(path)
  site_dirs = getattr(site, "getsitepackages", lambda: [])()   # absent in old virtualenvs
  for path in (*site_dirs, site.getusersitepackages()):
    roots.add(path)
  return tuple(sorted({os.path.join(os.path.realpath(r), "") for r in roots}))


_LIBRARY_ROOTS = _library_roots()
# pallet.bench, the benchmark suite, is user code: its kernels are keyed like a script's.
_BENCH_ROOT = os.path.join(
    os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench", "")


@functools.lru_cache(maxsize=4096)
def _is_library_file(filename: str | None) -> bool:
  if not filename:
    return False
  if filename.startswith("<"):
    return filename.startswith("<frozen ")   # "<string>", "<stdin>", notebook cells: user
  path = os.path.realpath(filename)
  return path.startswith(_LIBRARY_ROOTS) and not path.startswith(_BENCH_ROOT)


def _is_library_module(module: types.ModuleType) -> bool:
  if module.__name__ == "__main__":
    return False
  filename = getattr(module, "__file__", None)
  if filename:
    return _is_library_file(filename)
  spec = getattr(module, "__spec__", None)
  if module.__name__ in sys.builtin_module_names or (
      spec is not None and spec.origin in ("built-in", "frozen")):
    return True
  paths = list(getattr(module, "__path__", None) or ())    # a namespace package
  if paths:
    return all(_is_library_file(os.path.join(p, "")) for p in paths)
  # A submodule an extension module makes (`jaxlib._jax.pytree`): its package's.
  parent = sys.modules.get(module.__name__.rpartition(".")[0])
  return parent is not None and parent is not module and _is_library_module(parent)


def _is_library_class(cls: type) -> bool:
  """Whether `cls` comes from library code: by the module it names, or, for classes of
  extension modules that are not in `sys.modules` themselves (`jaxlib._jax.pytree`),
  the nearest enclosing package that is."""
  name = getattr(cls, "__module__", None) or ""
  while name:
    module = sys.modules.get(name)
    if module is not None:
      return _is_library_module(module)
    name = name.rpartition(".")[0]
  return False


@functools.lru_cache(maxsize=4096)
def _names_read(code: types.CodeType) -> frozenset[str]:
  """The global and attribute names `code` and the functions nested in it refer to."""
  names = set(code.co_names)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names |= _names_read(const)
  return frozenset(names)


def _freeze_function(fn: Any, walk: _Walk) -> Any:
  if isinstance(fn, functools.partial):
    return (functools.partial, freeze(fn.func, walk), freeze(fn.args, walk),
            freeze(dict(fn.keywords), walk))
  code = fn.__code__
  outer_names, walk.names = walk.names, _names_read(code)
  try:
    cells = []
    for cell in fn.__closure__ or ():
      try:
        cells.append(freeze(cell.cell_contents, walk))
      except ValueError:                 # a cell not yet filled
        cells.append(("empty",))
    if _is_library_file(code.co_filename):
      globals_key = ("library module", id(fn.__globals__))
    else:
      module_globals = fn.__globals__
      globals_key = tuple((n, freeze(module_globals[n], walk))
                          for n in sorted(walk.names) if n in module_globals)
    return (types.FunctionType, code, globals_key, freeze(fn.__defaults__, walk),
            freeze(fn.__kwdefaults__, walk), tuple(cells),
            freeze(getattr(fn, "__dict__", {}), walk))
  finally:
    walk.names = outer_names


def _freeze_module(module: types.ModuleType, walk: _Walk) -> Any:
  """A library module by identity; a user module also by the attributes the code
  being keyed may read from it (`config.scale`)."""
  if _is_library_module(module):
    return ("module", _Same(module))
  attributes = vars(module)
  return ("module", _Same(module), tuple((n, freeze(attributes[n], walk))
                                         for n in sorted(walk.names) if n in attributes))


def _freeze_class(cls: type, walk: _Walk) -> Any:
  """A library class by identity; a user class also by everything its own body (and
  that of its user base classes) defines: methods, class attributes."""
  if _is_library_class(cls):
    return ("class", _Same(cls))
  bodies = tuple((_Same(c), tuple((k, freeze(v, walk)) for k, v in sorted(vars(c).items())))
                 for c in cls.__mro__ if not _is_library_class(c))
  return ("class", _Same(cls), bodies)


def _freeze_user_object(x: Any, walk: _Walk) -> Any:
  """An instance of a user class: by its class and, where it hashes by identity (so
  it may change while keeping its hash), by its attributes; one without a `__dict__`
  to read them from is not keyed."""
  if type(x).__hash__ is not object.__hash__:
    return ("object", freeze(type(x), walk), x)    # its own equality says what counts
  if not hasattr(x, "__dict__"):
    raise _Unhashable
  return ("object", freeze(type(x), walk), freeze(vars(x), walk))


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

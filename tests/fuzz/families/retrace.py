"""Redefinition and re-tracing: the same kernel called 2-4 times in a loop, each time
meant to compute with another value, which reaches the kernel through a module global
read by a kernel defined afresh, the same module-level kernel object reading a global
that changed, a closure from a factory, a closure over the loop variable, a
`functools.partial`, a default argument, a global helper function rebound, a global
NumPy array refilled, an attribute of a closed-over object, an index map reading a
global, a block size read from a global, or a kernel defined inside a jitted function;
or the same kernel called with `jax_enable_x64` switched on and off between calls
(`x.astype(float)` is float64 only with it on). Calls run directly or under `jax.jit`.

The model is the list of what each call should give. JAX's interpreter reuses its
trace of the same kernel object after a global it reads changed, as `jax.jit` does;
the model decides that variant.
"""
from __future__ import annotations

import functools
import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..case import Case, random_array

VARIANTS = ["global_redefined", "global_same_kernel", "factory", "loop_closure", "partial",
            "default_arg", "global_helper", "global_array", "object_attribute",
            "index_map_global", "block_global", "inside_jit", "x64"]

# Module globals the generated kernels read (set by each call of a case).
_SCALE = 1.0
_HELPER = None
_ARRAY = np.zeros(1, np.float32)
_BLOCK = 0
_BLOCK_SIZE = 8


def _same_kernel(x_ref, o_ref):
  """One kernel object for every call: reads the global `_SCALE`."""
  o_ref[...] = x_ref[...] * _SCALE


class _Settings:
  scale = 1.0


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  variant = rng.choice(VARIANTS)
  calls = rng.randint(2, 4)
  values = rng.sample([0.5, -1.0, 1.5, 2.0, 3.0, -2.5], calls)
  blocks = rng.randint(2, 4)
  rows = 8
  d = dict(variant=variant, values=values, jit=rng.random() < 0.3, blocks=blocks,
           rows=rows, block_picks=[rng.randrange(blocks) for _ in range(calls)],
           block_sizes=rng.sample([1, 2, 4, 8], calls) if calls <= 4 else None,
           repeat_first=rng.random() < 0.3)
  if d["repeat_first"]:       # come back to the first value at the end
    d["values"].append(d["values"][0])
    d["block_picks"].append(d["block_picks"][0])
    d["block_sizes"].append(d["block_sizes"][0])
  x = random_array(data, (blocks * rows, 4), np.float32)
  if variant == "x64":
    d["values"] = [bool(k % 2) for k in range(len(d["values"]))]
  jax_reason = None
  if variant == "global_same_kernel":
    jax_reason = ("JAX's pallas_call reuses its trace of the same kernel object after a "
                  "global it reads changed (as jax.jit does); the model decides")
  return Case(family="retrace", seed=-1, description=dict(d), inputs=(x,),
              run=lambda api, x: _run(api, d, x),
              model=None if variant == "x64" else (lambda x: _model(d, x)),
              jax_oracle=jax_reason)


def _model(d: dict[str, Any], x: np.ndarray) -> list[np.ndarray]:
  out = []
  rows = d["rows"]
  for k, c in enumerate(d["values"]):
    variant = d["variant"]
    if variant == "index_map_global":
      b = d["block_picks"][k]
      out.append(x[b * rows:(b + 1) * rows] * 2)
    elif variant == "block_global":
      size = d["block_sizes"][k]
      blocks = x.shape[0] // size
      y = np.concatenate([x[i * size:(i + 1) * size] + i for i in range(blocks)])
      out.append(y)
    elif variant == "global_helper":
      out.append(x * c + 1)
    elif variant == "global_array":
      out.append(x + np.float32(c) * np.arange(4, dtype=np.float32))
    else:
      out.append(x * np.float32(c))
  return out


def _kernel_for(d: dict[str, Any], k: int, c: float):
  """The kernel (and its call options) of call k, made the way the variant makes it."""
  global _SCALE, _HELPER, _ARRAY, _BLOCK, _BLOCK_SIZE
  variant = d["variant"]
  if variant == "global_redefined":
    _SCALE = c

    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] * _SCALE
    return kernel
  if variant == "global_same_kernel":
    _SCALE = c
    return _same_kernel
  if variant == "factory":
    def make(scale):
      def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * scale
      return kernel
    return make(c)
  if variant == "loop_closure":
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] * c
    return kernel
  if variant == "partial":
    def kernel(x_ref, o_ref, *, scale):
      o_ref[...] = x_ref[...] * scale
    return functools.partial(kernel, scale=c)
  if variant == "default_arg":
    def kernel(x_ref, o_ref, scale=c):
      o_ref[...] = x_ref[...] * scale
    return kernel
  if variant == "global_helper":
    _HELPER = (lambda scale: lambda v: v * scale + 1)(c)

    def kernel(x_ref, o_ref):
      o_ref[...] = _HELPER(x_ref[...])
    return kernel
  if variant == "global_array":
    _ARRAY[...] = 0  # the same array object, refilled
    if _ARRAY.shape != (4,):
      _ARRAY = np.zeros(4, np.float32)
    _ARRAY[...] = np.float32(c) * np.arange(4, dtype=np.float32)

    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] + _ARRAY
    return kernel
  if variant == "object_attribute":
    settings = _SETTINGS
    settings.scale = c

    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] * settings.scale
    return kernel
  raise ValueError(variant)


_SETTINGS = _Settings()


def _run(api: Any, d: dict[str, Any], x: Any) -> list[Any]:
  global _BLOCK, _BLOCK_SIZE
  pl, rows, variant = api.pl, d["rows"], d["variant"]
  out = []
  shape = jax.ShapeDtypeStruct(x.shape, jnp.float32)
  for k, c in enumerate(d["values"]):
    if variant == "index_map_global":
      _BLOCK = d["block_picks"][k]

      def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2
      call = api.pallas_call(kernel, jax.ShapeDtypeStruct((rows, 4), jnp.float32),
                             in_specs=[pl.BlockSpec((rows, 4), lambda: (_BLOCK, 0))],
                             out_specs=pl.BlockSpec((rows, 4), lambda: (0, 0)))
    elif variant == "block_global":
      _BLOCK_SIZE = d["block_sizes"][k]

      def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)
      spec = pl.BlockSpec((_BLOCK_SIZE, 4), lambda i: (i, 0))
      call = api.pallas_call(kernel, shape, grid=(x.shape[0] // _BLOCK_SIZE,),
                             in_specs=[spec], out_specs=spec)
    elif variant == "x64":
      def kernel(x_ref, o_ref):
        y = x_ref[...].astype(float)        # float64 only under jax_enable_x64
        o_ref[...] = ((y + 2.0 ** 22) - 2.0 ** 22).astype(o_ref.dtype)
      call = api.pallas_call(kernel, shape)
      if d["jit"]:
        call = jax.jit(call)
      with jax.enable_x64(c):
        out.append(call(x))
      continue
    elif variant == "inside_jit":
      def outer(v, scale=c):
        def kernel(x_ref, o_ref):
          o_ref[...] = x_ref[...] * scale
        return api.pallas_call(kernel, shape)(v)
      call = jax.jit(outer)
    else:
      call = api.pallas_call(_kernel_for(d, k, c), shape)
    if d["jit"]:
      call = jax.jit(call)
    out.append(call(x))
  return out

"""GPU-flavoured kernel operations: `jax.experimental.pallas.triton` (JAX 0.12).

`load`/`store` are pallet's masked loads and stores with Pallas-GPU's signatures
(`load(ref, *, mask, other, ...)`, `store(ref, val, *, mask, ...)`); `dot`
multiplies two blocks like Pallas' `pl.dot`. Two primitives exist only here, each
with its abstract evaluation and CPU meaning side by side (the Triton backend's
rules live in backends/triton/ops.py):

* `debug_barrier`: synchronises the threads of one program on a GPU; a program
  is sequential on the CPU backend, where it does nothing.
* `elementwise_inline_asm`: GPU assembly applied elementwise. Compiled Triton
  kernels run it; the CPU backend and Triton's interpreter cannot run assembly
  and say so.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallet import _internals as internals
from pallet.core import checks, primitives
from pallet.errors import PalletError

# What Triton's tl.load / tl.store accept (None: Triton's default).
_LOAD_CACHE_MODIFIERS = (None, "", ".ca", ".cg", ".cv")
_EVICTION_POLICIES = (None, "", "evict_first", "evict_last")


def _where() -> str:
  """The kernel being traced and the user's source line, for messages."""
  name = primitives.current_kernel_name()
  return f"{f'kernel {name!r} at ' if name else ''}{checks.user_source()}"


def _check_hint(fn: str, what: str, value: Any, allowed: Sequence[Any]) -> None:
  if value not in allowed:
    raise ValueError(f"pallet.triton.{fn} in {_where()}: {what}={value!r}; expected "
                     f"one of {[a for a in allowed if a]} (or None)")


# ------------------------------------------------------------------ loads and stores
def load(ref: Any, idx: Any = None, *, mask: Any = None, other: Any = None,
         cache_modifier: str | None = None, eviction_policy: str | None = None,
         volatile: bool = False) -> jax.Array:
  """Reads `ref` (a ref or a `ref.at[...]` view); where `mask` is False the result
  is `other` (zeros without it), and nothing outside the array is read.

  The caching hints are checked and accepted; generated Triton code leaves caching
  to Triton. (`load(ref, idx, ...)`, the form with an index, also works.)
  """
  _check_hint("load", "cache_modifier", cache_modifier, _LOAD_CACHE_MODIFIERS)
  _check_hint("load", "eviction_policy", eviction_policy, _EVICTION_POLICIES)
  del volatile  # every read goes to memory on the CPU; see docs/backends.md
  return primitives.load(ref, idx, mask=mask, other=other)


def store(ref: Any, val: Any, *rest: Any, mask: Any = None,
          eviction_policy: str | None = None) -> None:
  """Writes `val` to `ref` (or a `ref.at[...]` view) where `mask` is True; masked-out
  elements and elements outside the array are never written.

  (`store(ref, idx, val, ...)`, the form with an index, also works.)
  """
  _check_hint("store", "eviction_policy", eviction_policy, _EVICTION_POLICIES)
  idx = None
  if rest:
    if len(rest) != 1:
      raise TypeError(f"pallet.triton.store takes (ref, val) or (ref, idx, val), got "
                      f"{2 + len(rest)} positional arguments")
    idx, val = val, rest[0]
  primitives.store(ref, idx, val, mask=mask)


def atomic_cas(ref: Any, *args: Any) -> jax.Array:
  """Atomically stores `val` where the ref holds `cmp`; returns the previous contents.

  `atomic_cas(ref, cmp, val)` as in Pallas (a scalar ref or a `ref.at[i]` view),
  or `atomic_cas(ref, idx, cmp, val)`.
  """
  if len(args) == 2:
    return primitives.atomic_cas(ref, None, *args)
  if len(args) == 3:
    return primitives.atomic_cas(ref, *args)
  raise TypeError(f"pallet.triton.atomic_cas takes (ref, cmp, val) or (ref, idx, cmp, "
                  f"val), got {1 + len(args)} positional arguments")


# ------------------------------------------------------------------ math
def dot(a: jax.Array, b: jax.Array, trans_a: bool = False, trans_b: bool = False,
        allow_tf32: bool | None = None, precision: Any = None) -> jax.Array:
  """The matrix product of two 2-d blocks, accumulated in float32 (int32 for
  integers, float64 for float64), optionally transposing either operand.

  `allow_tf32=True` means `precision=HIGH` (3xTF32 on a GPU) and False means
  HIGHEST (IEEE float32); give at most one of the two.
  """
  a, b = jnp.asarray(a), jnp.asarray(b)
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(f"pallet.triton.dot in {_where()}: operands "
                     f"must be 2-d blocks, got shapes {a.shape} and {b.shape}")
  if allow_tf32 is not None:
    if precision is not None:
      raise ValueError("pallet.triton.dot: give allow_tf32 or precision, not both")
    precision = lax.Precision.HIGH if allow_tf32 else lax.Precision.HIGHEST
  dtype = jnp.promote_types(a.dtype, b.dtype)
  if jnp.issubdtype(dtype, jnp.integer):
    out_dtype = jnp.int32
  elif dtype == jnp.float64:
    out_dtype = jnp.float64
  else:
    out_dtype = jnp.float32
  contract = ((0 if trans_a else 1,), (1 if trans_b else 0,))
  return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                         preferred_element_type=out_dtype)


def approx_tanh(x: jax.Array) -> jax.Array:
  """Elementwise tanh. Pallas uses the GPU's approximate instruction; pallet computes
  the accurate tanh on every backend (which that instruction approximates)."""
  x = jnp.asarray(x)
  if x.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64):
    raise TypeError(f"pallet.triton.approx_tanh takes float16, bfloat16, float32 or "
                    f"float64 arrays, got {x.dtype}")
  return jnp.tanh(x)


# ------------------------------------------------------------------ debug_barrier
debug_barrier_p = Primitive("debug_barrier")
debug_barrier_p.multiple_results = True


def debug_barrier() -> None:
  """Waits until every thread of this program reaches the barrier (GPU); a no-op
  where a program runs sequentially (the CPU backend)."""
  debug_barrier_p.bind()


# The debug effect keeps the barrier in place through dead-code elimination.
debug_barrier_p.def_effectful_abstract_eval(lambda: ([], {internals.debug_effect}))
debug_barrier_p.def_impl(lambda: [])
mlir.register_lowering(debug_barrier_p, lambda ctx: [])


# ------------------------------------------------------------------ inline assembly
elementwise_inline_asm_p = Primitive("elementwise_inline_asm")
elementwise_inline_asm_p.multiple_results = True


def elementwise_inline_asm(asm: str, *, args: Sequence[jax.Array], constraints: str,
                           pack: int,
                           result_shape_dtypes: Sequence[jax.ShapeDtypeStruct]
                           ) -> Sequence[jax.Array]:
  """Applies GPU assembly `asm` elementwise to `args` (LLVM inline-asm `constraints`,
  `pack` elements per instance). Runs in compiled Triton kernels only."""
  results = tuple(jax.ShapeDtypeStruct(tuple(r.shape), jnp.dtype(r.dtype))
                  for r in result_shape_dtypes)
  return elementwise_inline_asm_p.bind(
      *[jnp.asarray(a) for a in args], asm=asm, constraints=constraints, pack=int(pack),
      result_shape_dtypes=results, where=_where())


def _inline_asm_abstract_eval(*avals, asm, constraints, pack, result_shape_dtypes, where):
  shapes = {tuple(a.shape) for a in avals} | {r.shape for r in result_shape_dtypes}
  if len(shapes) > 1:
    raise ValueError(f"pallet.triton.elementwise_inline_asm in {where}: arguments and "
                     f"results must all have one shape, got {sorted(shapes)}")
  return [jax.core.ShapedArray(r.shape, r.dtype) for r in result_shape_dtypes]


elementwise_inline_asm_p.def_abstract_eval(_inline_asm_abstract_eval)


def _inline_asm_unsupported(*args, asm, where, **params):
  raise PalletError(
      f"pallet.triton.elementwise_inline_asm in {where}: inline GPU assembly "
      f"({asm!r}) runs only in Triton kernels compiled for a GPU; this backend "
      f"(the XLA/CPU backend, or Triton's interpreter) cannot execute it. Write the "
      f"operation with jax.numpy for other backends")


elementwise_inline_asm_p.def_impl(_inline_asm_unsupported)
mlir.register_lowering(elementwise_inline_asm_p, _inline_asm_unsupported)


def _inline_asm_batch(args, dims, *, result_shape_dtypes, **params):
  """Elementwise, so a batch is more elements: every operand batched along axis 0."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  args = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
          for a, d in zip(args, dims)]
  results = tuple(jax.ShapeDtypeStruct((size, *r.shape), r.dtype) for r in result_shape_dtypes)
  outs = elementwise_inline_asm_p.bind(*args, result_shape_dtypes=results, **params)
  return outs, [0] * len(outs)


def _inline_asm_jvp(primals, tangents, *, asm, where, **params):
  raise PalletError(f"pallet.triton.elementwise_inline_asm in {where}: inline GPU assembly "
                    f"({asm!r}) has no derivative; differentiate a jax.numpy version of the "
                    f"operation instead")


batching.primitive_batchers[elementwise_inline_asm_p] = _inline_asm_batch
ad.primitive_jvps[elementwise_inline_asm_p] = _inline_asm_jvp

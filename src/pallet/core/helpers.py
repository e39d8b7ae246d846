"""Small helpers of the `pl` namespace that real Pallas kernels lean on.

Integer arithmetic for block sizes (`next_power_of_2`, `align_to`,
`strides_from_shape`), uninitialised values (`empty*`), loops and scoped
allocation as decorators (`loop`, `with_scoped`), `run_state`, `reciprocal`
and `estimate_cost`. Each is plain JAX underneath, so every backend that runs
the ops it emits runs these too.
"""
from __future__ import annotations

import functools
import inspect
import numbers
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallet import _internals as internals
from pallet.core import checks, discharge, primitives
from pallet.core.specs import CostEstimate, ScratchShape


# ------------------------------------------------------------------ integer helpers
def next_power_of_2(x: int) -> int:
  """The smallest power of two >= `x` (1 for 0), as block sizes are chosen."""
  if isinstance(x, bool) or not isinstance(x, (numbers.Integral, np.integer)):
    raise TypeError(f"pl.next_power_of_2 needs a Python int, got {type(x).__name__}: {x!r}")
  if x < 0:
    raise ValueError(f"pl.next_power_of_2 needs a non-negative integer, got {x}")
  return 1 if x == 0 else 2 ** (int(x) - 1).bit_length()


def align_to(a: Any, alignment: Any) -> Any:
  """`a` rounded up to a multiple of `alignment` (ints stay ints, arrays stay arrays)."""
  return primitives.cdiv(a, alignment) * alignment


def strides_from_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """Row-major element strides of an array of `shape`."""
  strides, size = [], 1
  for s in reversed(tuple(shape)):
    strides.append(size)
    size *= int(s)
  return tuple(reversed(strides))


def reciprocal(x: Any, *, approx: bool = False, full_range: bool = True) -> jax.Array:
  """`1 / x`. `approx` and `full_range` are speed hints for TPUs; pallet always
  computes the exact (IEEE) reciprocal, which every approximation is meant to match."""
  del approx, full_range
  x = jnp.asarray(x)
  return lax.div(jnp.ones_like(x), x)


# ------------------------------------------------------------------ uninitialised values
def empty(shape: Any, dtype: Any) -> jax.Array:
  """An array whose contents the kernel promises not to read before writing.

  pallet fills it with zeros, or with NaN / the integer minimum while
  `pl.enable_poison_buffers` is on, so that reading it shows.
  """
  shape = (shape,) if isinstance(shape, (numbers.Integral, np.integer)) else tuple(shape)
  return checks.uninitialized(shape, dtype)


def empty_like(x: Any) -> Any:
  """A pytree like `x` (arrays, refs or shape structs) of `pl.empty` values."""
  return jax.tree_util.tree_map(lambda leaf: empty(*_shape_dtype(leaf, "pl.empty_like")),
                                x, is_leaf=lambda l: isinstance(l, ScratchShape))


def empty_ref_like(x: Any) -> Any:
  """A fresh ref shaped like `x` (a ShapeDtypeStruct or a scratch shape such as
  `pltpu.VMEM((8, 128), f32)`), holding `pl.empty` values."""
  shape, dtype = _shape_dtype(x, "pl.empty_ref_like")
  return jax.new_ref(empty(shape, dtype))


def _shape_dtype(x: Any, fn_name: str) -> tuple[tuple[int, ...], Any]:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(f"{fn_name}: expected an array, a jax.ShapeDtypeStruct or a scratch "
                    f"shape such as pallet.tpu.VMEM((8, 128), jnp.float32); got "
                    f"{type(x).__name__}: {x!r}")
  return tuple(x.shape), x.dtype


# ------------------------------------------------------------------ control flow
def loop(lower: Any, upper: Any, *, init_carry: Any = None, step: Any = 1,
         unroll: int | bool | None = None) -> Callable[[Callable[..., Any]], Any]:
  """Decorator: runs the body for `i` in `range(lower, upper, step)`, now.

  `@pl.loop(lo, hi)` bodies take `i`; with `init_carry=` they take `(i, carry)`
  and return the new carry, which the decorator returns. Concrete bounds stay
  Python ints, so `unroll=True` can unroll fully.
  """
  concrete = all(isinstance(v, (numbers.Integral, np.integer)) and not isinstance(v, bool)
                 for v in (lower, upper, step))
  if concrete:
    lower, upper, step = int(lower), int(upper), int(step)
    if step == 0:
      raise ValueError("pl.loop: step must not be 0")
    trip_count, zero = max(0, -(-(upper - lower) // step)), 0
  else:
    index_type = jnp.result_type(lower, upper, step)
    lower, upper, step = (lax.convert_element_type(v, index_type)
                          for v in (lower, upper, step))
    zero = jnp.zeros((), index_type)
    # ceil((upper - lower) / step) for either sign of step, with floor division
    trip_count = lax.max(zero, -((lower - upper) // step))

  def decorator(body: Callable[..., Any]) -> Any:
    if init_carry is None:
      def fori_body(k, carry):
        body(lower + k * step)
        return carry
    else:
      def fori_body(k, carry):
        return body(lower + k * step, carry)
    kwargs = {} if unroll is None else {"unroll": unroll}
    return lax.fori_loop(zero, trip_count, fori_body, init_carry, **kwargs)
  return decorator


def with_scoped(*types: Any, collective_axes: Hashable | tuple[Hashable, ...] = (),
                **kw_types: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorator form of `pl.run_scoped`: the decorated function, when called with
  some leading arguments, gets fresh scratch refs of `types` after them."""
  del collective_axes  # one core: every allocation is already private to it

  def decorator(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def inner(*args: Any, **kwargs: Any) -> Any:
      return primitives.run_scoped(functools.partial(f, *args, **kwargs), *types, **kw_types)
    inner.__signature__ = _without_scoped_params(f, len(types), kw_types)
    return inner
  return decorator


def _without_scoped_params(f: Callable[..., Any], n_positional: int,
                           keywords: dict[str, Any]) -> inspect.Signature | None:
  """The signature callers of a `with_scoped` function see: `f`'s, less the refs
  it allocates (so pallas_call counts a decorated kernel's parameters right)."""
  try:
    sig = inspect.signature(f)
  except (TypeError, ValueError):
    return None
  params = [p for p in sig.parameters.values() if p.name not in keywords]
  positional = [i for i, p in enumerate(params)
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  drop = set(positional[len(positional) - n_positional:]) if n_positional else set()
  return sig.replace(parameters=[p for i, p in enumerate(params) if i not in drop])


def run_state(f: Callable[[Any], None]) -> Callable[[Any], Any]:
  """`run_state(f)(init)`: runs `f` on refs initialised to the pytree `init` and
  returns their final values (a stateful function made pure)."""
  def pure(init: Any) -> Any:
    leaves, tree = jax.tree_util.tree_flatten(init)
    leaves = [jnp.asarray(x) for x in leaves]
    avals = [internals.AbstractRef(jax.core.ShapedArray(x.shape, x.dtype)) for x in leaves]

    def stateful(*refs):
      f(jax.tree_util.tree_unflatten(tree, refs))
      return []
    closed = jax.make_jaxpr(stateful)(*avals)
    pure = discharge.discharge_state(closed)
    finals = jax.core.eval_jaxpr(pure.jaxpr, pure.consts, *leaves)
    return jax.tree_util.tree_unflatten(tree, finals)
  return pure


# ------------------------------------------------------------------ cost estimates
def _single(analysis: Any) -> dict:
  """One cost-analysis dict (older JAX gives one per computation)."""
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  return analysis or {}


def estimate_cost(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> CostEstimate:
  """XLA's cost analysis of `fun(*args, **kwargs)` as a `pl.CostEstimate`.

  `args` may be arrays or `jax.ShapeDtypeStruct`s (pytrees, None allowed);
  `kwargs` are static. Bytes count what XLA says the whole function touches.
  """
  def as_struct(x):
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) if not hasattr(x, "dtype") \
        else jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
  structs = jax.tree_util.tree_map(as_struct, args)
  # Counted on the CPU lowering, so an estimate does not depend on the device at hand;
  # where the uncompiled module gives no counts (seen with a GPU present), the compiled one.
  lowered = jax.jit(functools.partial(fun, **kwargs)).trace(*structs).lower(
      lowering_platforms=("cpu",))
  analysis = _single(lowered.cost_analysis()) or _single(lowered.compile().cost_analysis())
  return CostEstimate(flops=int(analysis.get("flops", 0)),
                      transcendentals=int(analysis.get("transcendentals", 0)),
                      bytes_accessed=int(analysis.get("bytes accessed", 0)))

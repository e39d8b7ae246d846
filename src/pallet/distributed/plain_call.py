"""Derivatives of a kernel across devices, behind a primitive boundary.

Inside `shard_map(check_vma=True)` every equation's operands must agree on the mesh
axes they vary over, and on an Explicit mesh vmap insists on matching shardings;
pallet's executor is written for plain per-device arrays. `linear_call` binds one
equation for a kernel's tangents (and its transpose one for the cotangents) whose
outputs vary over the union of the operands' axes, and traces the pure function
only when lowering, on avals without varying axes or shardings.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallet import _internals as internals
from pallet.core import trace_cache

# `fn(*args)` run as one equation; `fn` is traced at lowering on plain avals.
call_p = Primitive("pallet_plain_call")
call_p.multiple_results = True
# jvp(fn, primals, tangents)[1]: linear in the tangents, transposed into `call_p`.
linear_p = Primitive("pallet_plain_linear")
linear_p.multiple_results = True


def varying_union(values: Sequence[Any]) -> frozenset:
  return frozenset().union(*(internals.varying_axes(v) for v in values))


def _plain_shapes(avals: Sequence[Any]) -> list[Any]:
  return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


def _abstract_eval(*avals, fn, out_avals, out_specs=None, **_):
  varying = varying_union(avals)
  specs = out_specs or [()] * len(out_avals)
  return [internals.on_mesh_of(a, avals, varying, s) for a, s in zip(out_avals, specs)]


def _tangent_fn(fn: Callable, n: int) -> Callable:
  return lambda *a: list(jax.jvp(fn, tuple(a[:n]), tuple(a[n:]))[1])


def _lowering(ctx, *args, fn, out_avals, n_primals=None, out_specs=None):
  ctx = ctx.replace(avals_in=[internals.plain_aval(a) for a in ctx.avals_in],
                    avals_out=[internals.plain_aval(a) for a in ctx.avals_out])
  f = fn if n_primals is None else _tangent_fn(fn, n_primals)
  with internals.vma_checks_off():
    return mlir.lower_fun(lambda *a: list(f(*a)), multiple_results=True)(ctx, *args)


def _out_avals(fn: Callable, args: Sequence[Any]) -> tuple[Any, ...]:
  plain = _plain_shapes([jax.typeof(a) for a in args])
  with internals.vma_checks_off():
    outs = jax.eval_shape(fn, *plain)
  return tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in outs)


def call(fn: Callable, *args: Any) -> list[Any]:
  return call_p.bind(*args, fn=fn, out_avals=_out_avals(fn, args))


def linear_call(fn: Callable, primals: Sequence[Any], tangents: Sequence[Any],
                also_varying: frozenset = frozenset(),
                out_specs: tuple | None = None) -> list[Any]:
  """The tangents of `fn` at `primals`; every tangent is first marked varying over
  the operands' axes and `also_varying` (its transpose then sums the cotangent of an
  invariant operand over the devices, as for any value every device used).
  `out_specs`: the tangents' layout on an Explicit mesh (default replicated)."""
  varying = varying_union([*primals, *tangents]) | also_varying
  tangents = [internals.pvary(t, varying) for t in tangents]
  out_avals = _out_avals(fn, primals)
  return linear_p.bind(*primals, *tangents, fn=fn, out_avals=out_avals,
                       n_primals=len(primals), out_specs=out_specs)


for _p in (call_p, linear_p):
  _p.def_abstract_eval(_abstract_eval)
  mlir.register_lowering(_p, _lowering)
@trace_cache.kernel_cache
def _compiled(prim: Primitive, params: tuple) -> Callable:
  return jax.jit(lambda *args: prim.bind(*args, **dict(params)))


def _impl(prim: Primitive) -> Callable:
  # Run compiled, so `fn` is traced on plain avals even for sharded concrete operands
  # (jit re-enabled: under `jax.disable_jit()` the jit would call back in here).
  def impl(*args, **params):
    with jax.disable_jit(False):
      return _compiled(prim, tuple(sorted(params.items())))(*args)
  return impl


call_p.def_impl(_impl(call_p))
linear_p.def_impl(_impl(linear_p))


def _transpose(cts, *args, fn, out_avals, n_primals, out_specs):
  primals, tangents = args[:n_primals], args[n_primals:]
  if any(ad.is_undefined_primal(p) for p in primals):
    raise NotImplementedError("pallet: a kernel's tangents are linear in the tangents only")
  cts = [ad.instantiate_zeros(c) for c in cts]

  def cotangents(*a):
    _, pullback = jax.vjp(fn, *a[:n_primals])
    return list(pullback(list(a[n_primals:])))
  results = call(cotangents, *primals, *cts)
  out = []
  for t, ct in zip(tangents, results):
    # a cotangent is laid out like its operand (results come replicated)
    if internals.is_sharded(t.aval):
      ct = jax.sharding.reshard(ct, t.aval.sharding)
    out.append(ct)
  return [None] * n_primals + out


ad.primitive_transposes[linear_p] = _transpose


def _batched_fn(fn: Callable) -> Callable:
  return jax.vmap(lambda *a: list(fn(*a)))


def _moved(args, dims):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  return [jax.numpy.broadcast_to(a, (size, *a.shape)) if d is None
          else jax.numpy.moveaxis(a, d, 0) for a, d in zip(args, dims)]


def _call_batching(args, dims, *, fn, out_avals):
  outs = call(_batched_fn(fn), *_moved(args, dims))
  return outs, [0] * len(outs)


def _linear_batching(args, dims, *, fn, out_avals, n_primals, out_specs):
  moved = _moved(args, dims)
  outs = linear_p.bind(*moved, fn=_batched_fn(fn),
                       out_avals=_out_avals(_batched_fn(fn), moved[:n_primals]),
                       n_primals=n_primals, out_specs=None)
  return outs, [0] * len(outs)


def _jvp(primals, tangents, *, fn, out_avals, n_primals=None, out_specs=None):
  """Higher derivatives: the tangents of `fn` (or of its own tangent function)."""
  f = fn if n_primals is None else _tangent_fn(fn, n_primals)
  params = dict(fn=fn, out_avals=out_avals)
  prim = call_p if n_primals is None else linear_p
  if n_primals is not None:
    params.update(n_primals=n_primals, out_specs=out_specs)
  outs = prim.bind(*primals, **params)
  return outs, linear_call(f, primals, [ad.instantiate_zeros(t) for t in tangents])


ad.primitive_jvps[call_p] = _jvp
ad.primitive_jvps[linear_p] = _jvp
batching.primitive_batchers[call_p] = _call_batching
batching.primitive_batchers[linear_p] = _linear_batching

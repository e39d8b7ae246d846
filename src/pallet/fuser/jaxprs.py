"""Tracing fusions to jaxprs and running (parts of) those jaxprs again.

Only the public `jax.make_jaxpr` and the jaxpr data structures are used: calls
(`jit`, `custom_jvp_call`, ...) are inlined by re-tracing, so block spec rules see
plain primitives.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import jax
from jax.extend.core import Literal

# Primitives whose body is run in place (the fuser sees through them).
_CALLS = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
          "custom_vjp_call_jaxpr", "checkpoint", "remat", "remat2", "named_call"}
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def is_literal(atom: Any) -> bool:
  return isinstance(atom, Literal)


def body_of(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
  """The (jaxpr, consts) a call-like equation runs, or None."""
  if eqn.primitive.name not in _CALLS:
    return None
  for name in _BODY_PARAMS:
    sub = eqn.params.get(name)
    if hasattr(sub, "eqns"):                                  # Jaxpr
      return sub, tuple(getattr(sub, "consts", ()) or ())
    if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):      # ClosedJaxpr
      return sub.jaxpr, sub.consts
  return None


def bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
  out = eqn.primitive.bind(*invals, **eqn.params)
  return list(out) if eqn.primitive.multiple_results else [out]


Binder = Callable[[Any, Sequence[Any]], list]


def run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], binder: Binder = bind,
        eqns: Iterable[Any] | None = None, env: dict | None = None) -> list[Any]:
  """Evaluates `jaxpr`, calls inlined, each other equation by `binder`, and returns its
  outputs; with `eqns`, runs only those into `env` and returns nothing."""
  env = {} if env is None else env

  def read(atom: Any) -> Any:
    return atom.val if is_literal(atom) else env[atom]

  for var, value in zip(jaxpr.constvars, consts):
    env[var] = value
  for var, value in zip(jaxpr.invars, args):
    env[var] = value
  for eqn in (jaxpr.eqns if eqns is None else eqns):
    invals = [read(v) for v in eqn.invars]
    body = body_of(eqn)
    if body is not None:
      outs = run(body[0], body[1], invals, binder)
    else:
      outs = binder(eqn, invals)
    for var, value in zip(eqn.outvars, outs):
      env[var] = value
  return [read(v) for v in jaxpr.outvars] if eqns is None else []


def read(jaxpr_vars: Sequence[Any], env: dict) -> list:
  """The values of `jaxpr_vars` (literals or vars bound in `env`)."""
  return [v.val if is_literal(v) else env[v] for v in jaxpr_vars]


def _abstract(x: Any) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return x


def trace(f: Callable, *args: Any, **kwargs: Any) -> tuple[Any, list, Any, Any]:
  """`f` traced at the types of `args`/`kwargs`: (jaxpr with calls inlined, its consts,
  the tree of (args, kwargs), the output tree)."""
  flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
  out_tree_box: list = []

  def flat_f(*flat_args: Any) -> Any:
    a, k = jax.tree_util.tree_unflatten(in_tree, flat_args)
    out = f(*a, **k)
    leaves, tree = jax.tree_util.tree_flatten(out)
    out_tree_box.append(tree)
    return leaves

  closed = jax.make_jaxpr(flat_f)(*map(_abstract, flat))
  if any(body_of(e) is not None for e in closed.jaxpr.eqns):
    inner, inner_consts = closed.jaxpr, closed.consts
    closed = jax.make_jaxpr(lambda *a: run(inner, inner_consts, a))(*map(_abstract, flat))
  return closed.jaxpr, list(closed.consts), in_tree, out_tree_box[0]


def producers(jaxpr: Any) -> dict:
  """var -> (index of the equation defining it, output position)."""
  return {v: (i, k) for i, e in enumerate(jaxpr.eqns) for k, v in enumerate(e.outvars)}


def live_eqns(jaxpr: Any, needed: Iterable[Any], upto: int | None = None,
              stop: Iterable[Any] = ()) -> list[int]:
  """Indices (in order) of the equations among the first `upto` that `needed` depend
  on (not looking past the vars in `stop`)."""
  where = producers(jaxpr)
  todo = [v for v in needed if not is_literal(v)]
  seen_vars, keep = set(stop), set()
  while todo:
    v = todo.pop()
    if v in seen_vars:
      continue
    seen_vars.add(v)
    hit = where.get(v)
    if hit is None or (upto is not None and hit[0] >= upto) or hit[0] in keep:
      continue
    keep.add(hit[0])
    todo.extend(a for a in jaxpr.eqns[hit[0]].invars if not is_literal(a))
  return sorted(keep)


def depends_on(jaxpr: Any, sources: Iterable[Any]) -> set:
  """Vars of `jaxpr` whose value depends on any of `sources`."""
  dep = set(sources)
  for eqn in jaxpr.eqns:
    if any(not is_literal(v) and v in dep for v in eqn.invars):
      dep.update(eqn.outvars)
  return dep

"""`get_fusion_values`: split what a fusion closes over into arrays the kernel gets
blocks of (values) and scalars it needs for block indices (scalar prefetch).

An operation pallet has no block rule for, computed only from closed-over values, is
run here, outside the kernel, and its result becomes a value (a `fuse(debug=True)`
note says so): the fusion stays correct, only that intermediate is materialized.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from pallet import _internals
from pallet.core import ref_views
from pallet.fuser import jaxprs, rules, usage as usage_lib
from pallet.fuser.errors import note

_STATEFUL = {"get", "swap", "addupdate", "dynamic_update_slice"}


def _has_rule(eqn: Any) -> bool:
  return eqn.primitive.name in rules.PULL


def _where(eqn: Any) -> str:
  src = _internals.equation_source(eqn)
  return f" at {src[0]}:{src[1]}" if src else ""


def _run_stateful(jaxpr: Any, consts: list, args: list, eqns: list) -> tuple[list, dict]:
  """Runs equations with refs as plain arrays; returns outputs and final ref values."""
  env: dict = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda a: a.val if jaxprs.is_literal(a) else env[a]
  for eqn in eqns:
    invals = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name == "get":
      transforms = jax.tree_util.tree_unflatten(eqn.params["tree"], invals[1:])
      outs = [_internals.transform_array(invals[0], transforms)]
    elif name in ("swap", "addupdate"):
      transforms = jax.tree_util.tree_unflatten(eqn.params["tree"], invals[2:])
      value = invals[1]
      if name == "addupdate":
        value = _internals.transform_array(invals[0], transforms) + value
      old, new = ref_views.swap(invals[0], transforms, value)
      env[eqn.invars[0]] = new
      outs = [old] if name == "swap" else []
    else:
      outs = jaxprs.run(jaxprs.body_of(eqn)[0], jaxprs.body_of(eqn)[1], invals) \
        if jaxprs.body_of(eqn) else jaxprs.bind(eqn, invals)
    env.update(zip(eqn.outvars, outs))
  refs = {i: env[v] for i, v in enumerate(list(jaxpr.constvars) + list(jaxpr.invars))
          if isinstance(v.aval, _internals.AbstractRef)}
  return [read(v) for v in jaxpr.outvars], refs


def _values(fusion: Callable, args: tuple, kwargs: dict, stateful: bool,
            extra_outputs: bool) -> tuple:
  jaxpr, consts, in_tree, out_tree = jaxprs.trace(fusion, *args, **kwargs)
  is_ref = [isinstance(v.aval, _internals.AbstractRef) for v in jaxpr.constvars]
  used_prims = {e.primitive.name for e in jaxpr.eqns}
  if not stateful:
    if any(is_ref):
      raise ValueError("fuser: get_fusion_values got a fusion that closes over Refs; use "
                       "get_stateful_input_fusion_values / get_stateful_output_fusion_values")
    if used_prims & _STATEFUL:
      raise ValueError(f"fuser: stateful primitives {sorted(used_prims & _STATEFUL)} are not "
                       "supported by get_fusion_values")
  live = jaxprs.live_eqns(jaxpr, jaxpr.outvars)
  if stateful:
    live = list(range(len(jaxpr.eqns)))      # writes to refs are results too
  # Materialize what has no block rule and depends on closed-over values only.
  from_args = jaxprs.depends_on(jaxpr, jaxpr.invars)
  materialize = []
  if not stateful:
    for i in live:
      eqn = jaxpr.eqns[i]
      if not _has_rule(eqn) and not any(v in from_args for v in eqn.outvars):
        materialize.extend(eqn.outvars)
        note(f"materializing `{eqn.primitive.name}`{_where(eqn)}: pallet has no block rule "
             "for it, so its result is computed outside the kernel and read by blocks")
  if materialize:
    env: dict = {}
    jaxprs.run(jaxpr, consts, [None] * len(jaxpr.invars),
               eqns=[jaxpr.eqns[i] for i in jaxprs.live_eqns(jaxpr, materialize)], env=env)
    mat_values = [env[v] for v in materialize]
  else:
    mat_values = []
  # Equations still to run in the fusion: those not replaced by materialized values.
  done = set(materialize)
  remaining = live if stateful else jaxprs.live_eqns(jaxpr, jaxpr.outvars, stop=done)
  use = usage_lib.compute(jaxpr, remaining)
  for v in materialize:
    use.setdefault(v, {usage_lib.REGULAR})
  sources = list(jaxpr.constvars) + materialize
  source_values = list(consts) + mat_values
  used = set(v for i in remaining for v in jaxpr.eqns[i].invars if not jaxprs.is_literal(v))
  used.update(v for v in jaxpr.outvars if not jaxprs.is_literal(v))
  keep = [v in used for v in sources]
  scalar = [usage_lib.SCALAR in use.get(v, set()) for v in sources]
  regular = [s for s, k, sc in zip(source_values, keep, scalar) if k and not sc]
  prefetch = [s for s, k, sc in zip(source_values, keep, scalar) if k and sc]
  eqns = [jaxpr.eqns[i] for i in remaining]
  written = sorted({list(jaxpr.constvars).index(e.invars[0]) for e in jaxpr.eqns
                    if e.primitive.name in ("swap", "addupdate")
                    and e.invars[0] in jaxpr.constvars})

  def new_fusion(values: Any, *args: Any, **kwargs: Any) -> Any:
    it_r, it_p = iter(values), iter(prefetch)
    env: dict = {}
    for v, k, sc in zip(sources, keep, scalar):
      if k:
        env[v] = next(it_p) if sc else next(it_r)
    flat = in_tree.flatten_up_to((args, kwargs))
    if stateful:
      merged = [env.get(v) for v in jaxpr.constvars]
      out, refs = _run_stateful(jaxpr, merged, flat, eqns)
      result = jax.tree_util.tree_unflatten(out_tree, out)
      if extra_outputs and written:
        return result, tuple(refs[i] for i in written)
      return result
    for v, value in zip(jaxpr.invars, flat):
      env[v] = value
    jaxprs.run(jaxpr, [], [], eqns=eqns, env=env)
    out = jaxprs.read(jaxpr.outvars, env)
    return jax.tree_util.tree_unflatten(out_tree, out)

  result = (new_fusion, tuple(regular), tuple(prefetch))
  if extra_outputs:
    kept_index = {src: n for n, src in enumerate(
        i for i, (k, sc) in enumerate(zip(keep, scalar)) if k and not sc)}
    n_out = out_tree.num_leaves
    aliases = {n_out + k: kept_index[i] for k, i in enumerate(written)}
    return (*result, aliases)
  return result


def get_fusion_values(fusion: Callable, *args: Any, **kwargs: Any) -> tuple:
  """Traces `fusion` at `args` and splits what it closes over.

  Returns `(new_fusion, values, scalar_prefetch)`: `new_fusion(values, *args,
  **kwargs)` computes the fusion from the explicit `values`; `scalar_prefetch` are
  the closed-over scalars that block indices depend on (e.g. `dynamic_slice` starts).
  """
  return _values(fusion, args, kwargs, stateful=False, extra_outputs=False)


def get_stateful_input_fusion_values(fusion: Callable, *args: Any, **kwargs: Any) -> tuple:
  """Like `get_fusion_values` for a fusion that reads closed-over Refs: the Refs are
  among the values and `new_fusion` takes arrays in their place."""
  return _values(fusion, args, kwargs, stateful=True, extra_outputs=False)


def get_stateful_output_fusion_values(fusion: Callable, *args: Any, **kwargs: Any) -> tuple:
  """Like `get_stateful_input_fusion_values`, for a fusion that may write Refs:
  returns `(new_fusion, values, scalar_prefetch, output_input_aliases)`; when Refs are
  written `new_fusion` returns `(out, updated_ref_values)` and `output_input_aliases`
  maps each updated value's position (after the outputs' leaves) to the Ref's index
  in `values`."""
  return _values(fusion, args, kwargs, stateful=True, extra_outputs=True)

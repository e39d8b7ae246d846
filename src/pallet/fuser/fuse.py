"""`fuse`: hands a fusible kernel the computations around it as `Fusion`s.

The function is traced; the one `fusible` call in it splits the program into input
fusions (what computes each kernel input) and output fusions (what the program does
with the kernel's outputs). When pallet cannot carry block specs through an output
(or input) fusion it materializes the kernel's outputs (inputs) instead, computing
the rest with plain JAX, and `debug=True` says which operation and why.
"""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable, Iterable, Sequence

import jax

from pallet.fuser import jaxprs, rules
from pallet.fuser.errors import note, set_debug
from pallet.errors import UnfusibleError
from pallet.fuser.fusible import no_output_fusions
from pallet.fuser.fusion import Fusion


class _Nesting(threading.local):
  inside: bool = False


_nesting = _Nesting()


def _static_positions(f: Callable, argnums: Any, argnames: Any) -> tuple[set, set]:
  nums = {argnums} if isinstance(argnums, int) else set(argnums or ())
  names = {argnames} if isinstance(argnames, str) else set(argnames or ())
  try:
    params = list(inspect.signature(f).parameters)
  except (TypeError, ValueError):
    params = []
  for n in list(nums):
    if n < len(params):
      names.add(params[n])
  for name in list(names):
    if name in params:
      nums.add(params.index(name))
  return nums, names


def fuse(f: Callable | None = None, *, resolve_fusion_dtypes: bool = True, debug: bool = False,
         strict_mode: bool = True, static_argnums: int | Sequence[int] | None = None,
         static_argnames: str | Iterable[str] | None = None) -> Any:
  """Fuses the computation around the single `fusible` call in `f` into it.

  `debug=True` prints the traced program and a note for every value pallet
  materializes instead of fusing. `resolve_fusion_dtypes` is accepted for
  compatibility (pallet has no fusion dtypes).
  """
  def decorator(f: Callable) -> Callable:
    nums, names = _static_positions(f, static_argnums, static_argnames)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
      if _nesting.inside:
        return f(*args, **kwargs)
      nargs = len(args)
      static = {i: a for i, a in enumerate(args) if i in nums or i - nargs in nums}
      static_kw = {k: v for k, v in kwargs.items() if k in names}
      dyn_args = [a for i, a in enumerate(args) if i not in static]
      dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_kw}

      def dynamic_f(*d_args: Any, **d_kwargs: Any) -> Any:
        it = iter(d_args)
        full = [static[i] if i in static else next(it) for i in range(nargs)]
        return f(*full, **d_kwargs, **static_kw)

      for leaf in jax.tree_util.tree_leaves((dyn_args, dyn_kwargs)):
        if isinstance(leaf, jax.ref.Ref):
          raise NotImplementedError(
              f"fuse: {getattr(f, '__name__', f)} was passed a Ref ({leaf}); fused functions "
              "cannot take Refs as arguments, close over them instead")
      _nesting.inside, was = True, _nesting.inside
      try:
        jaxpr, consts, _, out_tree = jaxprs.trace(dynamic_f, *dyn_args, **dyn_kwargs)
      finally:
        _nesting.inside = was
      if debug:
        print("Jaxpr before fusion:")
        print(jaxpr)
      previous = set_debug(debug)
      try:
        flat = jax.tree_util.tree_leaves((dyn_args, dyn_kwargs))
        out = _Fused(jaxpr, consts, flat, strict_mode).run()
      finally:
        set_debug(previous)
      return jax.tree_util.tree_unflatten(out_tree, out)
    return wrapper

  return decorator(f) if f is not None else decorator


class _Fused:
  """One traced program around one fusible call."""

  def __init__(self, jaxpr: Any, consts: list, args: list, strict: bool):
    self.jaxpr, self.strict = jaxpr, strict
    self.base = dict(zip(jaxpr.constvars, consts))
    self.base.update(zip(jaxpr.invars, args))
    hits = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "pallet_fusible"]
    if not hits:
      raise ValueError("fuse: no fusible call found in the function")
    self.index = hits[0]
    self.eqn = jaxpr.eqns[self.index]

  def _eval(self, needed: Sequence[Any], env: dict, skip_fusible: bool = True) -> list:
    live = jaxprs.live_eqns(self.jaxpr, needed, stop=env)
    eqns = [self.jaxpr.eqns[i] for i in live if not (skip_fusible and i == self.index)]
    env = dict(env)
    jaxprs.run(self.jaxpr, [], [], eqns=eqns, env=env)
    return jaxprs.read(needed, env)

  def run(self) -> list:
    jaxpr, eqn = self.jaxpr, self.eqn
    fusible_out = set(eqn.outvars)
    dep = jaxprs.depends_on(jaxpr, fusible_out)
    if not any(v in dep for v in jaxpr.outvars if not jaxprs.is_literal(v)):
      return self._eval(jaxpr.outvars, self.base)
    params = eqn.params
    inputs = eqn.invars[params["num_consts"]:]
    for attempt in ("fused", "outputs materialized", "all materialized"):
      try:
        return self._attempt(attempt, params, inputs)
      except UnfusibleError as e:
        if attempt == "all materialized":
          raise
        note(f"{e}; falling back to computing the kernel's "
             f"{'outputs' if attempt == 'fused' else 'inputs'} outside it")
    raise AssertionError("unreachable")

  def _input_fusions(self, inputs: Sequence[Any], materialize: bool) -> list:
    fusions = []
    for var in inputs:
      if materialize:
        value = self._eval([var], self.base)[0]
        fusions.append(Fusion(lambda value=value: value, ((), {}), var.aval))
      else:
        fusions.append(Fusion(lambda var=var: self._eval([var], self.base)[0], ((), {}),
                              var.aval))
    return fusions

  def _attempt(self, attempt: str, params: dict, inputs: Sequence[Any]) -> list:
    jaxpr, eqn = self.jaxpr, self.eqn
    in_fusions = jax.tree_util.tree_unflatten(
        params["in_tree"], self._input_fusions(inputs, attempt == "all materialized"))
    prefix = params["output_fusion_prefix"]
    groups = jax.tree_util.tree_structure(prefix).flatten_up_to(
        jax.tree_util.tree_unflatten(params["out_tree"], list(eqn.outvars)))
    if attempt == "fused":
      reason = self._unfusible_consumer()
      if reason is None:
        return self._with_output_fusions(in_fusions, prefix, groups)
      note(f"{reason}; the kernel's outputs are materialized and the rest runs after it")
    raw = jax.tree_util.tree_leaves(params["func"](*in_fusions, no_output_fusions(prefix)))
    env = dict(self.base)
    env.update(zip(eqn.outvars, raw))
    return self._eval(jaxpr.outvars, env)

  def _unfusible_consumer(self) -> str | None:
    """Why the operations after the kernel cannot be output fusions (None if they can)."""
    dep = jaxprs.depends_on(self.jaxpr, self.eqn.outvars)
    for i in jaxprs.live_eqns(self.jaxpr, self.jaxpr.outvars):
      e = self.jaxpr.eqns[i]
      if i == self.index or not any(v in dep for v in e.invars if not jaxprs.is_literal(v)):
        continue
      if e.primitive.name not in rules.PULL or e.primitive.name not in rules.PUSH:
        return str(UnfusibleError(e.primitive.name, "pallet has no rule to push a block "
                                  "spec through it", e))
    return None

  def _with_output_fusions(self, in_fusions: Any, prefix: Any, groups: list) -> list:
    jaxpr = self.jaxpr
    outvars = list(jaxpr.outvars)
    claimed: dict[int, int] = {}
    fusions, order = [], []
    for g, group in enumerate(groups):
      group_vars = jax.tree_util.tree_leaves(group)
      dep = jaxprs.depends_on(jaxpr, group_vars)
      used = [k for k, v in enumerate(outvars) if not jaxprs.is_literal(v) and v in dep]
      for k in used:
        if k in claimed:
          raise ValueError("Outputs must be disjoint in order to use separate output "
                           "fusions (fuse)")
        claimed[k] = g
      order.extend(used)
      needed = [outvars[k] for k in used]
      if needed == group_vars:
        fusions.append(None)
        continue
      fusions.append(self._output_fusion(group, group_vars, needed))
    output_fusions = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(prefix), fusions)
    out = jax.tree_util.tree_leaves(self.eqn.params["func"](*in_fusions, output_fusions))
    if len(out) != len(order):
      raise ValueError(f"fuse: the fusible returned {len(out)} values where the output "
                       f"fusions produce {len(order)}")
    result: list[Any] = [None] * len(outvars)
    for k, value in zip(order, out):
      result[k] = value
    rest = [k for k in range(len(outvars)) if k not in claimed]
    for k, value in zip(rest, self._eval([outvars[k] for k in rest], self.base)):
      result[k] = value
    return result

  def _output_fusion(self, group: Any, group_vars: list, needed: list) -> Fusion:
    group_tree = jax.tree_util.tree_structure(group)

    def fn(*args: Any, **kwargs: Any) -> tuple:
      flat = jax.tree_util.tree_leaves((args, kwargs))
      env = dict(self.base)
      env.update(zip(group_vars, flat))
      return tuple(self._eval(needed, env))

    in_type = jax.tree_util.tree_unflatten(group_tree, [v.aval for v in group_vars])
    return Fusion(fn, (in_type, {}), tuple(v.aval for v in needed), strict_mode=self.strict)

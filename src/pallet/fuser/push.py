"""`push_block_spec`: from the blocks a kernel produces, the blocks of what an output
fusion makes of them; `push_pull_block_spec` then pulls those back to its side inputs."""
from __future__ import annotations

from typing import Any, Callable

import jax

from pallet.fuser import blocks, jaxprs, rules
from pallet.errors import UnfusibleError
from pallet.fuser.pull import canonical_spec, pull_block_spec
from pallet.core.specs import BlockSpec, no_block_spec


def _is_spec_leaf(x: Any) -> bool:
  return x is no_block_spec


def _unwrap(spec: Any, grid_len: int | None) -> Any:
  """An index map over the grid alone (scalar prefetch read from the context)."""
  if spec is no_block_spec or grid_len is None:
    return spec
  inner = spec.index_map
  def index_map(*grid: Any) -> Any:
    return inner(*grid, *(blocks.current_scalar_prefetch() or ()))
  return BlockSpec(spec.block_shape, index_map, memory_space=spec.memory_space,
                   pipeline_mode=spec.pipeline_mode)


def _wrap(spec: Any, grid_len: int | None) -> Any:
  """The inverse of `_unwrap`: an index map over (*grid, *scalar_prefetch)."""
  if spec is no_block_spec or grid_len is None:
    return spec
  inner = spec.index_map
  def index_map(*args: Any) -> Any:
    with blocks.scalar_prefetch_context(tuple(args[grid_len:])):
      return inner(*args[:grid_len])
  return BlockSpec(spec.block_shape, index_map, memory_space=spec.memory_space,
                   pipeline_mode=spec.pipeline_mode)


def push_block_spec(f: Callable, *in_spec_args: Any, scalar_prefetch_handler: Any = None,
                    grid_len: int | None = None, strict_mode: bool = True,
                    return_out_type: bool = False, **in_spec_kwargs: Any) -> Callable:
  """Pushes input BlockSpecs forward through `f`; returns a function of example
  `(*args, **kwargs)` giving the outputs' BlockSpecs (and their types when
  `return_out_type`)."""
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    flat_specs, spec_tree = jax.tree_util.tree_flatten((in_spec_args, in_spec_kwargs),
                                                       is_leaf=_is_spec_leaf)
    jaxpr, _, in_tree, out_tree = jaxprs.trace(f, *args, **kwargs)
    if spec_tree != in_tree:
      raise ValueError(f"fuser: push_block_spec expected block specs shaped like {in_tree}, "
                       f"got {spec_tree}")
    env: dict = {}
    for v, s in zip(jaxpr.invars, flat_specs):
      env[v] = canonical_spec(_unwrap(s, grid_len), v.aval)
    spec_of = lambda v: (no_block_spec if jaxprs.is_literal(v)
                         else env.get(v, no_block_spec))
    for i in jaxprs.live_eqns(jaxpr, jaxpr.outvars):
      eqn = jaxpr.eqns[i]
      ins = [spec_of(v) for v in eqn.invars]
      if all(s is no_block_spec for s in ins):
        continue
      rule = rules.PUSH.get(eqn.primitive.name)
      if rule is None:
        raise UnfusibleError(eqn.primitive.name, "pallet has no rule to push a block spec "
                             "through it", eqn)
      ctx = rules.RuleContext(eqn, tuple(v.aval for v in eqn.invars),
                              tuple(v.aval for v in eqn.outvars))
      outs = rule(ctx, *ins, **eqn.params)
      for v, s in zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]):
        env[v] = s
    out = [_wrap(spec_of(v), grid_len) for v in jaxpr.outvars]
    out = jax.tree_util.tree_unflatten(out_tree, out)
    if return_out_type:
      types = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.outvars]
      return out, jax.tree_util.tree_unflatten(out_tree, types)
    return out
  return wrapper


def push_pull_block_spec(f: Callable, *block_specs: Any, scalar_prefetch_handler: Any = None,
                         grid_len: int | None = None, **block_spec_kwargs: Any) -> Callable:
  """For an output fusion `f(values, *args, **kwargs)`: push the kernel outputs' specs
  forward, then pull the result back to get specs for `values`.

  Returns a function of `(values, *args, **kwargs)` giving `(kernel_fn,
  values_block_specs, kwarg_block_specs, out_type, out_block_specs)`.
  """
  def wrapper(values: Any, *args: Any, **kwargs: Any) -> tuple:
    value_specs = jax.tree_util.tree_map(lambda _: no_block_spec, values)
    out_specs, out_type = push_block_spec(
        f, value_specs, *block_specs, scalar_prefetch_handler=scalar_prefetch_handler,
        grid_len=grid_len, return_out_type=True, **block_spec_kwargs)(values, *args, **kwargs)
    kernel_fn, (values_specs, *_), kwarg_specs = pull_block_spec(
        f, out_specs, scalar_prefetch_handler=scalar_prefetch_handler, grid_len=grid_len,
        strict_mode=False)(values, *args, **kwargs)
    return kernel_fn, values_specs, kwarg_specs, out_type, out_specs
  return wrapper

"""`pull_block_spec`: from the blocks a kernel wants of a fusion's outputs, the blocks
of its inputs, and a function that computes one output block from input blocks."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from pallet.fuser import blocks, jaxprs, rules, usage as usage_lib
from pallet.fuser.blocks import BlockIndexTransform
from pallet.errors import UnfusibleError, UnfusibleValueError
from pallet.core.specs import BlockSpec, no_block_spec


def canonical_spec(spec: Any, aval: Any) -> Any:
  """A spec with `block_shape=None` / `index_map=None` spelled out for `aval`."""
  if spec is no_block_spec or spec is None:
    return no_block_spec
  shape = blocks.full_block_shape(spec, aval.shape)
  index_map = spec.index_map
  if index_map is None:
    index_map = lambda *_: (0,) * len(shape)
  return BlockSpec(shape, index_map, memory_space=spec.memory_space,
                   pipeline_mode=spec.pipeline_mode)


def _same_transform(a: BlockIndexTransform, b: BlockIndexTransform, n_out: list[int],
                    strict: bool) -> bool:
  if a is b:
    return True
  if blocks.canonical(a.block_shape) != blocks.canonical(b.block_shape):
    return False
  if not strict or a.block_index_transform is b.block_index_transform:
    return True
  def jaxpr_of(t: BlockIndexTransform) -> str:
    args = [tuple(jax.ShapeDtypeStruct((), "int32") for _ in range(n)) for n in n_out]
    return str(jax.make_jaxpr(lambda *bi: t.block_index_transform(*bi))(*args))
  try:
    return jaxpr_of(a) == jaxpr_of(b)
  except Exception:   # e.g. the transform reads scalar prefetch: compare identities only
    return False


class _Scalars:
  """Computes an equation's index operands from the kernel's scalar prefetch."""

  def __init__(self, jaxpr: Any, live: list[int], use: dict, mask: list[bool], eqn: Any,
               handler: Any):
    self.jaxpr, self.mask, self.eqn, self.handler = jaxpr, mask, eqn, handler
    self.needed = [jaxprs.is_literal(v) or usage_lib.SCALAR in use.get(v, ())
                   for v in eqn.invars]
    scalars = [v for v, n in zip(eqn.invars, self.needed) if n]
    self.eqns = [jaxpr.eqns[i] for i in jaxprs.live_eqns(jaxpr, scalars) if i in set(live)]

  def __call__(self) -> list:
    prefetch = blocks.current_scalar_prefetch()
    if prefetch is None:
      raise ValueError("fuser: this fusion computes block indices from scalar prefetch "
                       "values; pass grid_len= to pull_block_spec/push_block_spec and "
                       "call the index maps with the scalar prefetch operands")
    values = select_scalar_prefetch(self.handler, prefetch, sum(self.mask))
    it = iter(blocks.load_scalar(v) for v in values)
    consts = [next(it) if m else None for m in self.mask]
    env: dict = {}
    for var, value in zip(self.jaxpr.constvars, consts):
      env[var] = value
    jaxprs.run(self.jaxpr, [], [], eqns=self.eqns, env=env)
    return [(v.val if jaxprs.is_literal(v) else env.get(v)) if n else None
            for v, n in zip(self.eqn.invars, self.needed)]


def select_scalar_prefetch(handler: Any, prefetch: Any, expected: int) -> tuple:
  values = handler(*prefetch) if handler is not None else prefetch
  values = tuple(jax.tree_util.tree_leaves(values))
  if len(values) != expected:
    raise ValueError(f"fuser: the fusion prefetches {expected} scalars but was given "
                     f"{len(values)}")
  return values


def pull_block_spec(f: Callable, out_block_specs: Any, *,
                    scalar_prefetch_handler: Any | None = None, grid_len: int | None = None,
                    strict_mode: bool = True) -> Callable:
  """Pulls output BlockSpecs backwards through `f`.

  Returns a function of example `(*args, **kwargs)` (arrays or ShapeDtypeStructs)
  giving `(kernel_fn, arg_block_specs, kwarg_block_specs)`;
  `kernel_fn(program_ids, scalar_prefetch, *arg_blocks, **kwarg_blocks)` computes
  the outputs' blocks at that grid step.
  """
  def wrapped(*args: Any, **kwargs: Any) -> tuple:
    jaxpr, consts, in_tree, out_tree = jaxprs.trace(f, *args, **kwargs)
    flat_specs = jax.tree_util.tree_leaves(out_block_specs,
                                           is_leaf=lambda s: s is no_block_spec)
    if len(flat_specs) != len(jaxpr.outvars):
      raise ValueError(f"fuser: pull_block_spec got {len(flat_specs)} block specs for "
                       f"{len(jaxpr.outvars)} outputs")
    flat_specs = [canonical_spec(s, v.aval) for s, v in zip(flat_specs, jaxpr.outvars)]
    live = jaxprs.live_eqns(jaxpr, jaxpr.outvars)
    use = usage_lib.compute(jaxpr, live)
    mask = usage_lib.scalar_mask(jaxpr, use)
    transforms = _pull(jaxpr, live, use, mask, flat_specs, scalar_prefetch_handler,
                       strict_mode)
    in_specs = [blocks.apply_transform(flat_specs, transforms.get(v), grid_len)
                for v in jaxpr.invars]
    var_specs = {v: blocks.apply_transform(flat_specs, t, None)
                 for v, t in transforms.items()}
    kernel_fn = _KernelFn(jaxpr, consts, in_tree, out_tree, live, mask, var_specs,
                          scalar_prefetch_handler)
    non_scalar = [c for c, m in zip(consts, mask) if m and jax.numpy.ndim(c) != 0]
    if non_scalar:
      raise ValueError("fuser: the fusion computes a block index from non-scalar values "
                       f"of shapes {[jax.numpy.shape(c) for c in non_scalar]}; only "
                       "scalars can be prefetched (index the array outside the fusion)")
    kernel_fn.scalar_prefetch = tuple(c for c, m in zip(consts, mask) if m)
    arg_specs, kwarg_specs = jax.tree_util.tree_unflatten(in_tree, in_specs)
    return kernel_fn, arg_specs, kwarg_specs
  return wrapped


def _pull(jaxpr: Any, live: list[int], use: dict, mask: list[bool], out_specs: list,
          handler: Any, strict: bool) -> dict:
  env: dict = {}
  for v, t in zip(jaxpr.outvars, blocks.initial_transforms(out_specs)):
    if not jaxprs.is_literal(v) and t is not None:
      env[v] = t
  n_out = [len(s.block_shape) if s is not no_block_spec else 0 for s in out_specs]
  for i in reversed(live):
    eqn = jaxpr.eqns[i]
    outs = [env.get(v) for v in eqn.outvars]
    if all(t is None for t in outs):
      continue
    rule = rules.PULL.get(eqn.primitive.name)
    if rule is None:
      raise UnfusibleError(eqn.primitive.name, "pallet has no block rule for it", eqn)
    scalars = None
    if any(usage_lib.SCALAR in use.get(v, ()) for v in eqn.invars if not jaxprs.is_literal(v)):
      scalars = _Scalars(jaxpr, live, use, mask, eqn, handler)
    ctx = rules.RuleContext(eqn, tuple(v.aval for v in eqn.invars),
                            tuple(v.aval for v in eqn.outvars), scalars)
    ins = rule(ctx, outs if eqn.primitive.multiple_results else outs[0], **eqn.params)
    for v, t in zip(eqn.invars, ins):
      if jaxprs.is_literal(v) or t is None:
        continue
      if v in env and not _same_transform(env[v], t, n_out, strict):
        raise UnfusibleValueError(
            eqn.primitive.name, "the fusion is a DAG whose paths need different blocks of "
            f"one value ({env[v].block_shape} and {t.block_shape}), so pallet cannot "
            "uniquely pull block specs", eqn)
      env[v] = t
  return env


class _KernelFn:
  """Computes one block of a fusion's outputs inside a kernel."""

  def __init__(self, jaxpr, consts, in_tree, out_tree, live, mask, var_specs, handler):
    self.jaxpr, self.consts, self.in_tree, self.out_tree = jaxpr, consts, in_tree, out_tree
    self.eqns = [jaxpr.eqns[i] for i in live]
    self.mask, self.var_specs, self.handler = mask, var_specs, handler
    self.scalar_prefetch: tuple = ()

  def __call__(self, program_ids: Any, scalar_prefetch: Any, *args: Any, **kwargs: Any) -> Any:
    flat_args = self.in_tree.flatten_up_to((args, kwargs))
    consts = list(self.consts)
    if any(self.mask) and scalar_prefetch:
      values = select_scalar_prefetch(self.handler, scalar_prefetch, sum(self.mask))
      it = iter(blocks.load_scalar(v) for v in values)
      consts = [next(it) if m else c for c, m in zip(consts, self.mask)]
    binder = functools.partial(self._bind, tuple(program_ids), scalar_prefetch)
    env: dict = {}
    jaxprs.run(self.jaxpr, consts, flat_args, binder, eqns=self.eqns, env=env)
    out = jaxprs.read(self.jaxpr.outvars, env)
    return jax.tree_util.tree_unflatten(self.out_tree, out)

  def _bind(self, program_ids: tuple, scalar_prefetch: Any, eqn: Any, invals: list) -> list:
    spec_of = lambda v: (no_block_spec if jaxprs.is_literal(v)
                         else self.var_specs.get(v, no_block_spec))
    out_specs = tuple(map(spec_of, eqn.outvars))
    rule = rules.EVAL.get(eqn.primitive.name)
    if rule is None or all(s is no_block_spec for s in out_specs):
      return jaxprs.bind(eqn, invals)
    ctx = rules.EvalContext(eqn, program_ids, scalar_prefetch,
                            tuple(map(spec_of, eqn.invars)), out_specs,
                            scalar_prefetch_for_maps=scalar_prefetch or None,
                            handler=self.handler)
    out = rule(ctx, *invals, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]

"""`custom_fusion`: a function that takes part in fusions through rules its author gives
(how blocks pull back and push forward through it, how one block is computed)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

import jax

from pallet.fuser import calls, rules
from pallet.core.specs import no_block_spec

custom_fusion_p = calls.make("pallet_custom_fusion")


@dataclasses.dataclass(frozen=True)
class CustomEvalContext:
  """What a custom fusion's eval rule gets: its outputs' block specs and block indices
  at this grid step, and the kernel's scalar prefetch (with this fusion's handler)."""
  out_block_specs: tuple
  out_block_indices: tuple
  scalar_prefetch: Any | None = None
  scalar_prefetch_handler: Any | None = None


class custom_fusion:
  """Wraps a pure function as one operation with user-defined fuser rules.

  Register with `def_eval_rule(fn(ctx, *args) -> sequence of outputs)` (required),
  `def_pull_block_spec(fn(out_transforms) -> in_transforms)` (required),
  `def_push_block_spec(fn(in_specs) -> out_specs)` (for output fusions) and
  `def_pallas_impl(fn)` (an implementation for inside kernels).
  """

  def __init__(self, fun: Callable[..., Any]):
    functools.update_wrapper(self, fun)
    self.fun = fun
    self.eval_rule: Callable | None = None
    self.pull_block_spec_rule: Callable | None = None
    self.push_block_spec_rule: Callable | None = None
    self.pallas_impl: Callable | None = None

  def def_eval_rule(self, rule: Callable) -> Callable:
    self.eval_rule = rule
    return rule

  def def_pull_block_spec(self, rule: Callable) -> Callable:
    self.pull_block_spec_rule = rule
    return rule

  def def_push_block_spec(self, rule: Callable) -> Callable:
    self.push_block_spec_rule = rule
    return rule

  def def_pallas_impl(self, impl: Callable) -> Callable:
    self.pallas_impl = impl
    return impl

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    name = getattr(self.fun, "__name__", "custom_fusion")
    if self.eval_rule is None:
      raise ValueError(f"custom_fusion {name} is missing an evaluation rule "
                       "(define one with def_eval_rule)")
    if self.pull_block_spec_rule is None:
      raise ValueError(f"custom_fusion {name} is missing a pull_block_spec rule "
                       "(define one with def_pull_block_spec)")
    try:
      bound = inspect.signature(self.fun).bind(*args, **kwargs)
      bound.apply_defaults()
    except TypeError as e:
      raise TypeError(f"custom_fusion {name}: the arguments could not be bound to "
                      f"positional parameters: {e}") from e
    args = bound.args
    flat, in_tree = jax.tree_util.tree_flatten(args)
    out_tree_box: list = []

    def body(impl: Callable) -> Callable:
      def flat_fun(*flat_args: Any) -> list:
        leaves, tree = jax.tree_util.tree_flatten(
            impl(*jax.tree_util.tree_unflatten(in_tree, flat_args)))
        out_tree_box.append(tree)
        return leaves
      return flat_fun

    closed = jax.make_jaxpr(body(self.fun))(*flat)
    if self.pallas_impl is not None:
      other = jax.make_jaxpr(body(self.pallas_impl))(*flat)
      if [(a.shape, a.dtype) for a in other.out_avals] != \
         [(a.shape, a.dtype) for a in closed.out_avals]:
        raise ValueError(f"custom_fusion {name} and its pallas_impl have different output "
                         f"types: {closed.out_avals} vs {other.out_avals}")
    out = custom_fusion_p.bind(
        *closed.consts, *flat, jaxpr=_Body(closed), num_consts=len(closed.consts),
        eval_rule=self.eval_rule, pull_block_spec_rule=self.pull_block_spec_rule,
        push_block_spec_rule=self.push_block_spec_rule)
    return jax.tree_util.tree_unflatten(out_tree_box[0], out)


class _Body:
  """The traced function, its consts passed as the first operands."""

  def __init__(self, closed: Any):
    self.jaxpr, self.out_avals, self.effects = closed.jaxpr, closed.out_avals, closed.effects

  def __repr__(self) -> str:
    return str(self.jaxpr)


def _pull(ctx: rules.RuleContext, outs: Sequence[Any], *, num_consts: int,
          pull_block_spec_rule: Callable, **_: Any) -> list:
  return [None] * num_consts + list(pull_block_spec_rule(tuple(outs)))


def _push(ctx: rules.RuleContext, *specs: Any, num_consts: int,
          push_block_spec_rule: Callable | None, **_: Any) -> list:
  if push_block_spec_rule is None:
    raise ValueError("custom_fusion is missing a push_block_spec rule "
                     "(define one with def_push_block_spec)")
  return list(push_block_spec_rule(tuple(specs[num_consts:])))


def _eval(ctx: rules.EvalContext, *args: Any, num_consts: int, eval_rule: Callable,
          **_: Any) -> list:
  indices = tuple(None if s is no_block_spec else i
                  for s, i in zip(ctx.out_block_specs, ctx.out_block_indices()))
  custom = CustomEvalContext(ctx.out_block_specs, indices, ctx.scalar_prefetch, ctx.handler)
  return list(eval_rule(custom, *args[num_consts:]))


rules.PULL[custom_fusion_p.name] = _pull
rules.PUSH[custom_fusion_p.name] = _push
rules.EVAL[custom_fusion_p.name] = _eval

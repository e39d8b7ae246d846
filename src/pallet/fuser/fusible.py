"""`fusible`: marks a kernel wrapper whose inputs and outputs `fuse` may fuse into."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from pallet.fuser import calls
from pallet.fuser.fusion import Fusion

fusible_p = calls.make("pallet_fusible")


def _trivial_fusion(x: Any) -> Fusion:
  return Fusion(lambda: x, ((), {}), jax.ShapeDtypeStruct(jax.numpy.shape(x),
                                                          jax.numpy.result_type(x)))


def no_output_fusions(prefix: Any) -> Any:
  """`prefix`'s structure with None for every group: no output fusion."""
  structure = jax.tree_util.tree_structure(prefix)
  return jax.tree_util.tree_unflatten(structure, [None] * structure.num_leaves)


def fusible(f: Callable | None = None, *, output_fusion_prefix: Any = True) -> Any:
  """Marks `f` as a fusible kernel for `fuse`.

  `f` is called as `f(*in_fusions, output_fusions, **kwargs)`: each array input
  arrives as a `Fusion` (call it for the value, or hand it to `get_fusion_values` /
  `pull_block_spec` to compute it block by block inside a kernel) and
  `output_fusions` is shaped like `output_fusion_prefix`, with a `Fusion` for what
  the surrounding program does with each group of outputs, or None. Outside `fuse`
  the fusions are trivial and the output fusions None.
  """
  def decorator(f: Callable) -> Callable:
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
      bound = functools.partial(f, **kwargs) if kwargs else f
      flat, in_tree = jax.tree_util.tree_flatten(args)
      out_tree_box: list = []

      def trivial(*flat_args: Any) -> list:
        fusions = jax.tree_util.tree_map(_trivial_fusion,
                                         jax.tree_util.tree_unflatten(in_tree, flat_args))
        out = bound(*fusions, no_output_fusions(output_fusion_prefix))
        leaves, tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(tree)
        return leaves

      closed = jax.make_jaxpr(trivial)(*flat)
      out = fusible_p.bind(*closed.consts, *flat, jaxpr=_without_consts(closed),
                           num_consts=len(closed.consts),
                           func=bound, in_tree=in_tree, out_tree=out_tree_box[0],
                           output_fusion_prefix=output_fusion_prefix)
      return jax.tree_util.tree_unflatten(out_tree_box[0], out)
    return wrapper

  return decorator(f) if f is not None else decorator


class _without_consts:
  """A ClosedJaxpr whose consts are passed as operands (so none is captured in params)."""

  def __init__(self, closed: Any):
    self.jaxpr = closed.jaxpr
    self.out_avals = closed.out_avals
    self.effects = closed.effects

  def __repr__(self) -> str:
    return str(self.jaxpr)

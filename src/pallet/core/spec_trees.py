"""Pairing a pytree of BlockSpecs with the pytree of operands it describes.

`in_specs`/`out_specs` follow the operands' pytree, as in Pallas, down to where a
spec stands: a `BlockSpec` (or `no_block_spec`, or `None`: the whole array) stands
for every array of the operand subtree at its place, so a spec tree may be a prefix
of the operand tree (JAX's broadcast-prefix rule, as `tree_map(f, specs, operands)`
applies it). `None` operands, and `None` fields of registered dataclasses (a weights
pytree with `scale=None`), are empty subtrees: whatever spec stands there describes
nothing. Lists and tuples are interchangeable (Pallas code writes both).
A structure that does not line up is an error naming the kernel, the argument and
the place inside it.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from pallet.core import specs as specs_lib
from pallet.errors import PalletError

Path = tuple[Any, ...]


def is_spec(x: Any) -> bool:
  """Whether `x` is a leaf of a spec tree: it stands for a whole operand subtree."""
  return x is None or x is specs_lib.no_block_spec or isinstance(x, specs_lib.BlockSpec)


def match_specs(specs: Any, operands: Any, *, what: str, kernel_name: str,
                operand_name: Callable[[Path], str]) -> list:
  """One spec per array of `operands` (in flattening order). `operand_name(path)` names
  the operand at a key path in messages, e.g. "input 1 ('w_ref').scale"."""
  if specs is specs_lib.no_block_spec or specs is None:
    return [specs_lib.no_block_spec] * len(jax.tree_util.tree_leaves(operands))
  out: list = []

  def fail(path: Path, spec: Any, operand: Any) -> None:
    where = operand_name(path) if path else ("the outputs (out_shape)"
                                             if what.startswith("out") else "the inputs")
    raise PalletError(
        f"pallas_call of kernel '{kernel_name}': {what} does not have the structure of "
        f"{where}: {what} has {_describe(spec)} there, the operand is {_describe(operand)}; "
        f"expected the operands' pytree structure, where a spec (or None) may stand for "
        f"a whole subtree")

  _match(specs, operands, (), out, fail)
  return out


def _match(spec: Any, operand: Any, path: Path, out: list, fail: Callable) -> None:
  spec_children, spec_node = ([], None) if is_spec(spec) else _one_level(spec)
  if spec_node is None:
    # a spec (any other leaf is left for block_mapping to refuse, naming what it got)
    spec = specs_lib.no_block_spec if spec is None else spec
    out.extend([spec] * len(jax.tree_util.tree_leaves(operand)))
    return
  if operand is None:
    return   # an empty subtree: its spec describes nothing
  operand_children, operand_node = _one_level(operand)
  if operand_node is None or spec_node != operand_node:
    fail(path, spec, operand)
  for (key, s), (_, o) in zip(spec_children, operand_children):
    _match(s, o, path + key, out, fail)


def _one_level(x: Any) -> tuple[list[tuple[Path, Any]], Any]:
  """((key path, child) for each child of `x`, a description of the node to compare),
  or ([], None) where `x` is a leaf. Sequences compare by length only, dicts by keys."""
  children, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
  if jax.tree_util.treedef_is_leaf(treedef):
    return [], None
  if isinstance(x, (list, tuple)):
    return children, ("sequence", len(x))
  if isinstance(x, dict):
    return children, ("dict", tuple(sorted(x, key=repr)))
  # the type too: JAX's treedefs of two registered dataclasses with the same fields compare
  # equal
  return children, (type(x), treedef)


def _describe(x: Any) -> str:
  if x is None:
    return "None"
  if isinstance(x, specs_lib.BlockSpec):
    return "a BlockSpec"
  if isinstance(x, (list, tuple)):
    return f"a {type(x).__name__} of {len(x)}"
  if isinstance(x, dict):
    return f"a dict with keys {sorted(x, key=repr)}"
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array {np.dtype(x.dtype).name if _plain(x.dtype) else x.dtype}{list(x.shape)}"
  return f"a {type(x).__name__} pytree"


def _plain(dtype: Any) -> bool:
  try:
    np.dtype(dtype)
    return True
  except TypeError:
    return False

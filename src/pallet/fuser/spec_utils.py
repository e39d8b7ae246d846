"""Small helpers for the BlockSpecs that pulling and pushing produce."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax

from pallet.core.specs import BlockSpec, no_block_spec


def _is_leaf(x: Any) -> bool:
  return x is no_block_spec or x is None or isinstance(x, BlockSpec)


def filter_no_block_specs(values: Any, block_specs: Any) -> tuple[Any, Any]:
  """Replaces each value whose spec is `no_block_spec`, and that spec, with None."""
  filtered_values = jax.tree_util.tree_map(
      lambda spec, v: None if spec is no_block_spec else v, block_specs, values,
      is_leaf=_is_leaf)
  filtered_specs = jax.tree_util.tree_map(
      lambda spec: None if spec is no_block_spec else spec, block_specs, is_leaf=_is_leaf)
  return filtered_values, filtered_specs


def block_spec_with_prefetch(block_specs: Any, scalar_prefetch_refs: Sequence[Any]) -> Any:
  """Appends `scalar_prefetch_refs` to every index map's arguments."""
  def one(spec: Any) -> Any:
    if spec is no_block_spec or spec is None or spec.index_map is None:
      return spec
    inner = spec.index_map
    return dataclasses.replace(spec, index_map=lambda *a: inner(*a, *scalar_prefetch_refs))
  return jax.tree_util.tree_map(one, block_specs, is_leaf=_is_leaf)

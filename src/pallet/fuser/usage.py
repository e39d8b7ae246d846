"""Which values of a fusion feed block indices (scalar prefetch) and which feed data."""
from __future__ import annotations

from typing import Any

from pallet.fuser.jaxprs import is_literal

REGULAR = "regular"        # flows into the fusion's outputs as data
SCALAR = "scalar"          # flows into a block index: known before the kernel runs

# Operand positions of each primitive that are block indices.
_INDEX_OPERANDS = {"dynamic_slice": lambda n: range(1, n),
                   "dynamic_update_slice": lambda n: range(2, n)}


def compute(jaxpr: Any, live: list[int]) -> dict:
  """var -> set of usages, walking the live equations backwards from the outputs."""
  usage: dict = {}

  def add(var: Any, what: set) -> None:
    if not is_literal(var):
      usage.setdefault(var, set()).update(what)

  for v in jaxpr.outvars:
    add(v, {REGULAR})
  for i in reversed(live):
    eqn = jaxpr.eqns[i]
    out = set().union(*(usage.get(v, set()) for v in eqn.outvars))
    index_positions = set(_INDEX_OPERANDS.get(eqn.primitive.name, lambda n: ())(len(eqn.invars)))
    for k, v in enumerate(eqn.invars):
      if k in index_positions:
        add(v, {SCALAR})
      elif eqn.primitive.name == "broadcast_in_dim" and k == 0 and v.aval.ndim == 0:
        add(v, {SCALAR})    # a scalar filling a block: prefetch it
      else:
        add(v, out)
  return usage


def scalar_mask(jaxpr: Any, usage: dict) -> list[bool]:
  """Which consts of `jaxpr` are scalar prefetch."""
  return [SCALAR in usage.get(v, set()) for v in jaxpr.constvars]

"""The jaxprs nested in an equation's parameters, for passes that rewrite a body.

Loops, conds, scans and calls keep their bodies as plain computations of their
operands in named parameters; a pass over the emitted body (literal folding, product
rewriting, the update guard) rewrites those the same way as the body itself.
"""
from __future__ import annotations

from typing import Any, Callable

from jax.extend.core.primitives import closed_call_p

# Parameters holding jaxprs, by primitive name.
NESTED = {"cond": ("branches",), "while": ("cond_jaxpr", "body_jaxpr"), "scan": ("jaxpr",),
          "pjit": ("jaxpr",), "jit": ("jaxpr",), closed_call_p.name: ("call_jaxpr",)}


# Primitives that run one jaxpr on exactly their operands, its results theirs.
CALLS = ("pjit", "jit", "closed_call", "core_call", "eval_jaxpr")


def called(eqn: Any) -> Any:
  """The jaxpr (open or closed) a call in `CALLS` runs, or None for any other equation."""
  if eqn.primitive.name not in CALLS:
    return None
  return eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))


def rewrite_params(eqn: Any, rewrite: Callable[[Any], Any]) -> dict:
  """`eqn.params` with each nested jaxpr replaced by `rewrite(jaxpr)`: the same dict
  where `rewrite` returned every one unchanged (by identity)."""
  params = eqn.params
  for name in NESTED.get(eqn.primitive.name, ()):
    value = params.get(name)
    if value is None:
      continue
    new = tuple(rewrite(b) for b in value) if isinstance(value, tuple) else rewrite(value)
    unchanged = all(a is b for a, b in zip(new, value)) if isinstance(value, tuple) \
        else new is value
    if not unchanged:
      params = {**params, name: new}
  return params

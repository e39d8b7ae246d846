"""`evaluate`: run a function equation by equation, refusing what fusions cannot hold."""
from __future__ import annotations

from typing import Any, Callable

import jax

from pallet.fuser import jaxprs

_CONTROL_FLOW = {"scan", "while", "cond"}


def evaluate(f: Callable, *, allow_transpose: bool = True) -> Callable:
  """`f`, traced and re-run primitive by primitive: `scan`/`while`/`cond` raise
  NotImplementedError, and `transpose` raises ValueError unless `allow_transpose`."""
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    jaxpr, consts, _, out_tree = jaxprs.trace(f, *args, **kwargs)

    def binder(eqn: Any, invals: list) -> list:
      name = eqn.primitive.name
      if name in _CONTROL_FLOW:
        raise NotImplementedError(f"Primitive {name} not supported.")
      if name == "transpose" and not allow_transpose:
        raise ValueError("Transpose not allowed.")
      return jaxprs.bind(eqn, invals)

    out = jaxprs.run(jaxpr, consts, jax.tree_util.tree_leaves((args, kwargs)), binder)
    return jax.tree_util.tree_unflatten(out_tree, out)
  return wrapped

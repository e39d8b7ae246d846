"""A primitive that stands for a traced function (its jaxpr) and behaves as it.

`fusible` and `custom_fusion` each mark a call in a program with one; outside of
`fuse` (and of fused kernels) it runs, differentiates and batches as its body.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallet.fuser import jaxprs


def make(name: str) -> Primitive:
  """A call-like primitive; its params hold `jaxpr` (a ClosedJaxpr over the operands
  after the first `num_consts`, which are that jaxpr's consts)."""
  prim = Primitive(name)
  prim.multiple_results = True

  def impl(*args: Any, jaxpr: Any, num_consts: int, **_: Any) -> list:
    return jaxprs.run(jaxpr.jaxpr, args[:num_consts], args[num_consts:])

  prim.def_impl(impl)
  # Effects on refs the body closes over are positional in the body; they are not
  # carried (a fusible writing closed-over refs is not supported), others are.
  prim.def_effectful_abstract_eval(lambda *avals, jaxpr, **_: (
      list(jaxpr.out_avals), {e for e in jaxpr.effects if not hasattr(e, "input_index")}))
  mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))

  def jvp(primals: Any, tangents: Any, **params: Any) -> tuple:
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    out, tan = jax.jvp(functools.partial(impl, **params), tuple(primals), tuple(tangents))
    return list(out), list(tan)

  def batch(args: Any, dims: Any, **params: Any) -> tuple:
    axes = list(dims)   # None marks an unbatched operand
    out = jax.vmap(functools.partial(impl, **params), in_axes=axes)(*args)
    return list(out), [0] * len(out)

  ad.primitive_jvps[prim] = jvp
  batching.primitive_batchers[prim] = batch
  return prim

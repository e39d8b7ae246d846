"""Atomic scatters into a resident output, run as one scatter over the whole grid.

A histogram or a scatter-add kernel updates one output block that every grid step
sees whole, with `pl.atomic_add` (or max/min) at indices read from its input blocks:

    def kernel(values_ref, counts_in_ref, counts_ref):   # counts aliased to a zero input
      pl.atomic_add(counts_ref, values_ref[...], jnp.ones(...))

Run in grid order, that is a loop of small scatters. Since every step only adds
into the block (the combination is commutative and associative: the order of the
updates cannot matter, as for atomics), the result is the same as one scatter of
every step's updates at once. The kernel is rewritten as one that computes each
step's scatter indices and updates into arrays tiled along every grid axis (the
planner vectorizes it like any elementwise kernel), followed by one XLA scatter
per atomic of all of them into the output's initial value. What is proven, from
the discharged body, for every output `o`:

* `o`'s block is the whole array at every grid step (index map constant, no
  padding), so indices address the array itself;
* its final value is a chain of scatters (all of add, or all of max, or all of min;
  reshapes of the whole block allowed between them) starting from `o` itself or
  from `o` zeroed (a `pl.when`/select on grid ids that fires exactly on the grid's
  first step);
* every scatter's indices and updates are free of every output block;
  no scratch, scalar prefetch or traced grid sizes.
Anything else leaves the kernel to the planner (`rewrite` says why not).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

from pallet import _internals as internals
from pallet.core import checks, grid_analysis
from pallet.backends.xla import body_analysis
from pallet.backends.xla.scratch_accumulators import (_canonical, _depends_on, _evaluate,
                                                      _grid_table, _reset_table)
from pallet.core.grid_mapping import BlockDimension, BlockMapping
from pallet.core.tracing import KernelDescription

_COMBINERS = {"scatter-add": lax.scatter_add, "scatter_add": lax.scatter_add,
              "scatter-max": lax.scatter_max, "scatter_max": lax.scatter_max,
              "scatter-min": lax.scatter_min, "scatter_min": lax.scatter_min}
_REDUCERS = {"scatter-add": jnp.sum, "scatter_add": jnp.sum, "scatter-max": jnp.max,
             "scatter_max": jnp.max, "scatter-min": jnp.min, "scatter_min": jnp.min}


@dataclasses.dataclass(frozen=True)
class ScatterRewrite:
  kernel: KernelDescription          # every step's scatter indices and updates as outputs
  finish: Callable[[list[Any], list[Any]], list[Any]]   # (inputs, terms) -> real outputs
  note: str


@dataclasses.dataclass(frozen=True)
class _Chain:
  """How one output's final value is built from its (maybe zeroed) block."""
  zeroed: bool                        # zeroed on the first step (else: kept)
  steps: tuple[tuple[Any, int], ...]  # (equation, term number or -1 for a reshape)


def rewrite(kernel: KernelDescription) -> ScatterRewrite | str:
  """The kernel of scatter terms and how to finish it, or why the pattern is not proven."""
  gm = kernel.grid_mapping
  if gm.scratch_avals or gm.prefetch_avals or gm.dynamic_axes:
    return "scratch, scalar prefetch or traced grid sizes"
  if not gm.grid or not gm.outputs:
    return "no grid"
  grid, G = gm.grid, len(gm.grid)
  for o in gm.outputs:
    if (o.block_shape != tuple(o.array_shape) or any(d.kind != "blocked" for d in o.dims)
        or np.any(grid_analysis.block_table(o, grid))):
      return f"{o.origin} is not one whole-array block at every step"
  pure = body_analysis.discharged(kernel)
  jaxpr = pure.jaxpr
  n_in, n_out = len(gm.inputs), len(gm.outputs)
  o_in = jaxpr.invars[G + n_in:G + n_in + n_out]
  o_fin = jaxpr.outvars[n_in:n_in + n_out]
  blocks = set(o_in)
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  first = np.all([c == 0 for c in np.indices(grid)], axis=0)
  ids = jaxpr.invars[:G]
  terms: list[Any] = []            # indices and updates of every scatter, in order
  chains = []
  for o, (var, fin) in enumerate(zip(o_in, o_fin)):
    chain = _scatter_chain(fin, var, blocks, producer, terms, first,
                           lambda v: _grid_table(pure, v, ids, grid))
    if isinstance(chain, str):
      return f"{gm.outputs[o].origin}: {chain}"
    chains.append(chain)
  virtual = _terms_kernel(kernel, pure, terms)
  aliases = dict((o, i) for i, o in kernel.input_output_aliases)
  outs = gm.outputs

  def finish(inputs: list[Any], values: list[Any]) -> list[Any]:
    results = []
    for o, chain in enumerate(chains):
      if chain.zeroed:
        acc = jnp.zeros(outs[o].array_shape, outs[o].dtype)
      elif o in aliases:
        acc = inputs[aliases[o]]
      else:
        acc = checks.uninitialized(outs[o].array_shape, outs[o].dtype,
                                   poison=kernel.poison_buffers)
      for eqn, t in chain.steps:
        acc = (internals.bind_equation(eqn, [acc], source=False)[0] if t < 0
               else _scatter_all(eqn, acc, values[t], values[t + 1], G))
      results.append(acc)
    return results
  note = (f"atomic scatters into whole-array outputs: every step's indices and updates "
          f"computed at once, then one scatter per atomic ({len(terms) // 2} in all)")
  return ScatterRewrite(virtual, finish, note)


def _scatter_chain(fin: Any, block: Any, blocks: set, producer: dict, terms: list,
                   first: np.ndarray, grid_table: Callable) -> _Chain | str:
  steps, kind, var = [], None, _canonical(fin, producer)
  while var is not block:
    eqn = producer.get(var) if not isinstance(var, Literal) else None
    if eqn is None:
      return "its final value is not a chain of scatters into its block"
    name = eqn.primitive.name
    if name == "reshape" and eqn.params.get("dimensions") is None:
      steps.append((eqn, -1))
    elif name in _COMBINERS and not eqn.params["dimension_numbers"].operand_batching_dims:
      if kind not in (None, _COMBINERS[name]):
        return "it mixes scatters of different combinations (their order would matter)"
      kind = _COMBINERS[name]
      indices, updates = eqn.invars[1], eqn.invars[2]
      if _depends_on(indices, blocks, producer) or _depends_on(updates, blocks, producer):
        return "a scatter's indices or updates read an output block"
      steps.append((eqn, len(terms)))
      terms.extend([indices, updates])
    else:
      zeroed = _reset_table(var, block, producer, grid_table)
      if zeroed is None or kind is None:
        return "its final value is not a chain of scatters into its block"
      if not np.array_equal(zeroed, first):
        return "it is zeroed at steps other than the grid's first"
      return _Chain(True, tuple(steps[::-1]))
    var = _canonical(eqn.invars[0], producer)
  if kind is None:
    return "it is not updated by a scatter"
  return _Chain(False, tuple(steps[::-1]))


def _scatter_all(eqn: Any, operand: Any, indices: Any, updates: Any, G: int) -> Any:
  """`eqn`'s scatter with every step's indices and updates (grid dimensions first):
  the grid dimensions are more scatter dimensions of both."""
  dn = eqn.params["dimension_numbers"]
  steps = int(np.prod(indices.shape[:G]))
  i_shape, u_shape = indices.shape[G:], updates.shape[G:]
  if i_shape[-1] == 0:
    # Empty index vectors (an atomic on a whole window): every update lands on the
    # same window, so combine them first and scatter once. (XLA of jaxlib 0.10.2 keeps
    # only the last of several updates through empty index vectors.)
    window = tuple(G + d for d in dn.update_window_dims)
    others = tuple(d for d in range(updates.ndim) if d not in window)
    combined = _REDUCERS[eqn.primitive.name](updates, axis=others)
    one = lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(combined.ndim)),
        inserted_window_dims=dn.inserted_window_dims, scatter_dims_to_operand_dims=())
    return _COMBINERS[eqn.primitive.name](
        operand, jnp.zeros((0,), indices.dtype), combined, one, indices_are_sorted=True,
        unique_indices=True, mode=eqn.params["mode"])
  if len(i_shape) >= 2 and 0 not in dn.update_window_dims:
    # the steps joined with the first scatter dimension: XLA's own (jnp's) layout
    indices = indices.reshape(steps * i_shape[0], *i_shape[1:])
    updates = updates.reshape(steps * u_shape[0], *u_shape[1:])
  else:
    indices = indices.reshape(steps, *i_shape)
    updates = updates.reshape(steps, *u_shape)
    dn = dn._replace(update_window_dims=tuple(d + 1 for d in dn.update_window_dims))
  return _COMBINERS[eqn.primitive.name](
      operand, indices, updates, dn, indices_are_sorted=False, unique_indices=False,
      mode=eqn.params["mode"])


def _terms_kernel(kernel: KernelDescription, pure: Any, terms: list) -> KernelDescription:
  """The kernel writing each of `terms` (values of the discharged body) of every grid
  step into its own output, one block per step (squeezed grid dimensions first)."""
  gm = kernel.grid_mapping
  G, n_in = len(gm.grid), len(gm.inputs)
  jaxpr = pure.jaxpr
  ids, ins = jaxpr.invars[:G], jaxpr.invars[G:G + n_in]
  avals = [t.aval for t in terms]

  outputs = []
  for k, aval in enumerate(avals):
    shape = tuple(aval.shape)
    im = internals.trace_jaxpr(lambda *g, n=len(shape): (*g, *([jnp.int32(0)] * n)),
                               [jax.core.ShapedArray((), jnp.int32)] * G, "index_map")
    outputs.append(BlockMapping(
        origin=f"scatter {'indices' if k % 2 == 0 else 'updates'} {k // 2}",
        array_shape=(*gm.grid, *shape), dtype=aval.dtype,
        dims=(*[BlockDimension("squeezed", 1)] * G,
              *[BlockDimension("blocked", n) for n in shape]),
        index_map=im, memory_space=None, whole=False))
  new_gm = gm.replace(outputs=tuple(outputs), dimension_semantics=None)

  def body(*args):
    id_vals, refs = args[:G], args[G:]
    in_refs, term_refs = refs[:n_in], refs[n_in:]
    bound = {**dict(zip(ids, id_vals)), **{v: r[...] for v, r in zip(ins, in_refs)}}
    for r, value in zip(term_refs, _evaluate(jaxpr, pure.consts, bound, terms)):
      r[...] = jnp.broadcast_to(value, r.shape).astype(r.dtype)
    return []

  ref_avals = ([jax.core.ShapedArray((), jnp.int32)] * G
               + [internals.AbstractRef(b.kernel_aval) for b in (*gm.inputs, *outputs)])
  return kernel.replace(jaxpr=internals.trace_jaxpr(body, ref_avals, "one scatter"),
                        grid_mapping=new_gm,
                        input_output_aliases=(),
                        ref_names=kernel.ref_names[:n_in] + ("",) * len(outputs))

"""Tracing a user's kernel, once, into a backend-neutral `KernelDescription`.

The description is the contract between the front end and every backend: a
jaxpr over refs whose inputs are, in order,

    *grid_indices (int32 scalars, one per grid axis),
    *dynamic grid sizes (int32 scalars, one per axis whose size is traced),
    *scalar_prefetch refs, *input block refs, *output block refs, *scratch refs

and that returns nothing, plus the `GridMapping` that says which block of which
array each ref stands for at each grid step. Backends never see the user's
Python function.
"""
from __future__ import annotations

import dataclasses
import os
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallet import _internals as internals
from pallet.core import kernel_errors
from pallet.core import primitives
from pallet.core.grid_mapping import (GridMapping, function_source, kernel_parameter_names,
                                      user_function)
from pallet.errors import PalletError
from pallet.core.tracebacks import is_pallet_file


@dataclasses.dataclass(frozen=True, eq=False)
class KernelDescription:
  """A traced kernel: its jaxpr over refs and the grid mapping it runs under."""
  name: str
  jaxpr: Any                     # closed jaxpr, inputs as in the module docstring
  grid_mapping: GridMapping
  source: str                    # "file.py:line" of the kernel definition
  input_output_aliases: tuple[tuple[int, int], ...]
  compiler_params: Any
  debug: bool
  grid_names: tuple[Any, ...] | None = None    # a named grid: lax.axis_index(name) works
  metadata: Any = None                         # pallas_call(metadata=...), kept as given
  poison_buffers: bool = False                 # pl.enable_poison_buffers when traced
  ref_names: tuple[str, ...] = ()              # per ref input: the kernel parameter it is
  closed_over: tuple[Any, ...] = ()            # refs and traced scalars it closed over,
                                               # now its last operands (closed_over.py)

  def __repr__(self) -> str:
    # Shown inside jaxprs as the `kernel=` parameter of pallas_call: keep it short.
    return f"<kernel '{self.name}' grid={self.grid_mapping.grid} from {self.source}>"

  def replace(self, **changes) -> "KernelDescription":
    return dataclasses.replace(self, **changes)


internals.cache_weakly(KernelDescription)


def kernel_name(kernel: Callable) -> str:
  fn = user_function(kernel)
  return getattr(fn, "__name__", type(fn).__name__)


def kernel_source(kernel: Callable) -> str:
  return function_source(kernel) or "<unknown>"


def trace_kernel(kernel: Callable, name: str, grid_mapping: GridMapping,
                 kernel_args_tree: Any, **description_fields: Any) -> KernelDescription:
  """Traces `kernel` over abstract refs of its blocks.

  `kernel_args_tree` re-nests the flat refs as the kernel's (positional, keyword)
  arguments (pytrees of inputs and outputs are passed as pytrees of refs).
  """
  gm = grid_mapping
  ref_avals = ([internals.AbstractRef(a) for a in gm.prefetch_avals]
               + [internals.AbstractRef(b.kernel_aval) for b in gm.inputs]
               + [internals.AbstractRef(b.kernel_aval) for b in gm.outputs]
               + [internals.AbstractRef(a) for a in gm.scratch_avals])
  n_ids = len(gm.grid) + len(gm.dynamic_axes)
  id_avals = [jax.core.ShapedArray((), jnp.int32)] * n_ids
  source = description_fields.get("source", "")

  def stateful_body(*args):
    ids, sizes, refs = args[:len(gm.grid)], list(args[len(gm.grid):n_ids]), args[n_ids:]
    grid = tuple(sizes.pop(0) if n is None else n for n in gm.grid)
    with primitives.grid_context(ids, grid, name, description_fields.get("grid_names")):
      try:
        positional, keywords = jax.tree_util.tree_unflatten(kernel_args_tree, refs)
        result = kernel(*positional, **keywords)
      except Exception as e:  # noqa: BLE001 - re-raised unless JAX's Pallas raised it
        # Caught here, inside the trace, where the traceback still holds JAX's frames
        # (they show which ref the failing operation was applied to).
        called = _jax_pallas_call_site(e)
        if called is not None:
          raise _jax_pallas_error(name, source, called, "a function") from e
        if not isinstance(e, (ValueError, AssertionError)):
          raise
        error = kernel_errors.translate(e, kernel=name, source=source, refs=refs,
                                        labels=_ref_labels(gm, kernel, kernel_args_tree))
        if error is None:
          raise
        raise error from None
    if result is not None:
      raise PalletError(f"kernel '{name}' returned a value ({type(result).__name__}); "
                        f"kernels write their results into output refs and return None")
    return []

  try:
    jaxpr = internals.trace_jaxpr(stateful_body, [*id_avals, *ref_avals], "pallas_call kernel")
  except jax.errors.ConcretizationTypeError as e:
    raise PalletError(
        f"kernel '{name}' ({source}) used a traced value (such as pl.program_id) where "
        f"Python needs a concrete one: a slice bound (write pl.ds(start, size) for a "
        f"dynamic slice), an `if` (use pl.when or lax.cond) or a Python loop bound (use "
        f"lax.fori_loop)") from e
  _refuse_jax_pallas(jaxpr.jaxpr, name, source)
  return KernelDescription(name=name, jaxpr=jaxpr, grid_mapping=gm,
                           ref_names=_ref_names(kernel, kernel_args_tree, len(ref_avals)),
                           **description_fields)


def _refuse_jax_pallas(jaxpr: Any, name: str, source: str) -> None:
  """A kernel that calls JAX's own Pallas (a leftover `from jax.experimental.pallas import
  tpu as pltpu`, a helper imported from JAX's private modules) binds primitives pallet
  does not know, which fail far from the user's line; say so where the call is."""
  foreign = internals.jax_pallas_primitives()
  if not foreign:
    return
  for eqn in jaxpr.eqns:
    if eqn.primitive in foreign:
      where = internals.equation_source(eqn)
      raise _jax_pallas_error(name, source, f"{where[0]}:{where[1]}" if where else None,
                              f"primitive '{eqn.primitive.name}'")
  for sub in jax.extend.core.subjaxprs(jaxpr):
    _refuse_jax_pallas(sub, name, source)


def _jax_pallas_error(name: str, source: str, where: str | None, what: str) -> PalletError:
  at = f" at {where}" if where else ""
  return PalletError(
      f"kernel '{name}' ({source}){at} calls JAX's own Pallas ({what} of "
      f"jax.experimental.pallas); a kernel run by pallet uses pallet's API throughout: "
      f"import it from pallet (`import pallet as pl`, `from pallet import tpu as pltpu`, "
      f"`from pallet import triton as plgpu`)")


_JAX_PALLAS_DIRS = (os.path.join("jax", "_src", "pallas", ""),
                    os.path.join("jax", "experimental", "pallas", ""))
_JAX_KERNEL_LIBRARY = os.path.join("jax", "experimental", "pallas", "ops", "")


def _jax_pallas_call_site(error: BaseException) -> str | None:
  """"file:line" of the user's call into JAX's own Pallas that raised `error` (JAX's
  kernel library, which pallet runs as user code, excepted), or None."""
  caller = None
  for frame in traceback.extract_tb(error.__traceback__):
    path = frame.filename
    if any(d in path for d in _JAX_PALLAS_DIRS) and _JAX_KERNEL_LIBRARY not in path:
      return caller
    if not is_pallet_file(path) and f"{os.sep}jax{os.sep}" not in path:
      caller = f"{path}:{frame.lineno}"
  return None


def _ref_names(kernel: Callable, kernel_args_tree: Any, n_refs: int) -> tuple[str, ...]:
  """For messages: the parameter each flat ref is passed as (with its path inside a
  pytree parameter, e.g. "refs['k']"), "" where the signature does not say."""
  params = kernel_parameter_names(kernel) or []
  positional, keywords = jax.tree_util.tree_unflatten(kernel_args_tree, list(range(n_refs)))
  named_args = [*zip(params, positional), *keywords.items()]
  names = [""] * n_refs
  for param, arg in named_args:
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
      names[leaf] = param + jax.tree_util.keystr(path)
  return tuple(names)


def _ref_labels(gm: GridMapping, kernel: Callable, kernel_args_tree: Any) -> list[str]:
  """How messages name each flat kernel ref: "input 0 ('x_ref')", "scratch 1 ('acc')"."""
  params = kernel_parameter_names(kernel) or []
  kinds = ([("scalar prefetch", i) for i in range(len(gm.prefetch_avals))]
           + [("input", i) for i in range(len(gm.inputs))]
           + [("output", i) for i in range(len(gm.outputs))]
           + [("scratch", i) for i in range(len(gm.scratch_avals))])
  # parameter names line up with the flat refs only when every argument is one
  # positional ref
  positional, keywords = kernel_args_tree.children()
  if len(params) < len(kinds) or positional.num_leaves != len(kinds) \
      or len(positional.children()) != len(kinds):
    params = [None] * len(kinds)
  return [f"{kind} {i}" + (f" ('{p}')" if p else "") for (kind, i), p in zip(kinds, params)]

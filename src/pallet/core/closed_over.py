"""Refs and traced scalars a kernel closes over become operands of its call.

A kernel may use values it was not passed:
  * refs of an enclosing `pl.run_state` (or `jax.ref.run_state`), or arrays made with
    `jax.new_ref`: each becomes one more whole-array (`pl.ANY`) input, read from the
    ref when the call is made, aliased to one more output that the kernel's body uses
    in place of the ref; after the call that output is written back to the ref. A
    `pallas_call` runs as a whole, so this is the ref's meaning.
  * traced scalars (a loop index of the caller, an argument of an enclosing `jit`):
    each becomes one more input of shape (), read at the start of the body.
Either way every backend sees an ordinary kernel. A traced array that is not a
scalar stays an error, as in Pallas: pass it as an input, where a BlockSpec says how
the kernel sees it.

The extra operands come after the user's own inputs and outputs, so the indices in
`input_output_aliases` and in messages stay the user's.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax

from pallet import _internals as internals
from pallet.core import grid_mapping as gm_lib
from pallet.core import specs as specs_lib
from pallet.errors import PalletError
from pallet.core.tracing import KernelDescription


def _is_ref(value: Any) -> bool:
  return isinstance(jax.typeof(value), internals.AbstractRef)


def _is_lifted(value: Any) -> bool:
  """Closed-over values that become operands; concrete constants stay constants."""
  return _is_ref(value) or internals.is_tracer(value)


def lift(kernel: KernelDescription) -> KernelDescription:
  """The kernel with its closed-over refs and traced scalars made operands (the values
  themselves kept in `closed_over`); the kernel itself when it closes over none."""
  gm = kernel.grid_mapping
  consts = list(kernel.jaxpr.consts)
  positions = [i for i, c in enumerate(consts) if _is_lifted(c)]
  if not positions:
    return kernel
  for i in positions:
    aval = jax.typeof(consts[i])
    if not _is_ref(consts[i]) and aval.shape != ():
      raise PalletError(f"kernel '{kernel.name}' ({kernel.source}) closes over a traced "
                        f"array {aval.str_short()}; a kernel may close over traced scalars "
                        f"and refs only: pass the array to the call as an input instead")
  # refs first, then scalars: the refs' aliased outputs line up with their inputs
  positions.sort(key=lambda i: not _is_ref(consts[i]))
  n_refs = sum(_is_ref(consts[i]) for i in positions)
  in_avals = [_value_aval(consts[i]) for i in positions]

  def mapping(k: int, aval: Any, output: bool) -> gm_lib.BlockMapping:
    kind = "output" if output else "input"
    index = (len(gm.outputs) if output else len(gm.inputs)) + k
    space = specs_lib.MemorySpace.ANY if k < n_refs else specs_lib.MemorySpace.SMEM
    return gm_lib.block_mapping(
        specs_lib.BlockSpec(memory_space=space), aval, f"{kind} {index} ({_label(k, n_refs)})",
        gm.grid, gm.prefetch_avals, f"kernel '{kernel.name}', {_label(k, n_refs)}",
        kernel_name=kernel.name)

  new_inputs = tuple(mapping(k, a, False) for k, a in enumerate(in_avals))
  new_outputs = tuple(mapping(k, a, True) for k, a in enumerate(in_avals[:n_refs]))
  lifted_gm = gm.replace(inputs=gm.inputs + new_inputs, outputs=gm.outputs + new_outputs)

  n_lead = len(gm.grid) + len(gm.dynamic_axes) + len(gm.prefetch_avals)
  n_in, n_out, n_new = len(gm.inputs), len(gm.outputs), len(positions)
  old = kernel.jaxpr

  def body(*args: Any) -> list:
    lead, rest = args[:n_lead], args[n_lead:]
    ins, new_ins, rest = rest[:n_in], rest[n_in:n_in + n_new], rest[n_in + n_new:]
    outs, ref_outs, scratch = rest[:n_out], rest[n_out:n_out + n_refs], rest[n_out + n_refs:]
    values = list(consts)
    for k, position in enumerate(positions):
      # a ref is used through its aliased output; a scalar is read from its input
      values[position] = ref_outs[k] if k < n_refs else new_ins[k][...]
    jax.core.eval_jaxpr(old.jaxpr, values, *lead, *ins, *outs, *scratch)
    return []

  avals = [v.aval for v in old.jaxpr.invars]
  lead, ins = avals[:n_lead], avals[n_lead:n_lead + n_in]
  outs, scratch = avals[n_lead + n_in:n_lead + n_in + n_out], avals[n_lead + n_in + n_out:]
  # distinct aval objects: JAX takes one object passed twice for one aliased ref
  extra_in = [internals.AbstractRef(a) for a in in_avals]
  extra_out = [internals.AbstractRef(a) for a in in_avals[:n_refs]]
  with internals.vma_checks_off():
    jaxpr = jax.make_jaxpr(body)(*lead, *ins, *extra_in, *outs, *extra_out, *scratch)
  aliases = kernel.input_output_aliases + tuple((n_in + k, n_out + k) for k in range(n_refs))
  return kernel.replace(jaxpr=jaxpr, grid_mapping=lifted_gm, input_output_aliases=aliases,
                        ref_names=_ref_names(kernel, n_refs, n_new),
                        closed_over=tuple(consts[i] for i in positions))


def _value_aval(value: Any) -> Any:
  aval = jax.typeof(value)
  return aval.inner_aval if isinstance(aval, internals.AbstractRef) else aval


def _label(k: int, n_refs: int) -> str:
  return f"closed-over ref {k}" if k < n_refs else f"closed-over scalar {k - n_refs}"


def _ref_names(kernel: KernelDescription, n_refs: int, n_new: int) -> tuple[str, ...]:
  names = list(kernel.ref_names)
  if not names:
    return ()
  gm = kernel.grid_mapping
  labels = [_label(k, n_refs) for k in range(n_new)]
  after_inputs = len(gm.prefetch_avals) + len(gm.inputs)
  after_outputs = after_inputs + len(gm.outputs)
  return tuple(names[:after_inputs] + labels + names[after_inputs:after_outputs]
               + labels[:n_refs] + names[after_outputs:])


def operands(kernel: KernelDescription) -> list[Any]:
  """The call's extra inputs now: the refs' values, then the scalars."""
  return [v[...] if _is_ref(v) else v for v in kernel.closed_over]


def write_back(kernel: KernelDescription, results: Sequence[Any]) -> list[Any]:
  """Stores the call's extra outputs into the refs they stand for; returns the others."""
  refs = [v for v in kernel.closed_over if _is_ref(v)]
  if not refs:
    return list(results)
  for ref, value in zip(refs, results[-len(refs):]):
    ref[...] = value
  return list(results[:-len(refs)])

"""Element gathers and scatters whose indices are partly static runs, as windows.

JAX's state discharge reads `table_ref[idx]` (an index array on some dimensions,
slices on the others) as a gather of single elements: every slice becomes an iota
index column, concatenated with the index array broadcast against it. XLA runs that
element by element (65536 rows of 128 floats: 8M scalar gathers where jax.numpy's
`table[idx]` gathers 65536 rows), and batched under vmap it stays so.

When one index column is known at trace time and runs contiguously, in bounds, along
one dimension of the index array (`start + arange(n)`), while every other column is
provably constant along that dimension, the column is a window: the gather (or the
scatter, for `o_ref[idx] = v`) takes `n` elements from `start` along it, one index
vector per window instead of one per element. Out-of-bounds handling is unchanged:
the window itself lies in bounds, so an out-of-bounds value in another column does
to the whole window what it did to each of its elements (clamped, filled, dropped,
or unspecified, per the operation's mode).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np
from jax import lax
from jax.extend.core import Literal

# Primitives whose output element depends only on the operands' elements at the same
# position (with scalars broadcast): constant along a dimension when every operand is.
_ELEMENTWISE = frozenset((
    "add", "sub", "mul", "div", "rem", "neg", "max", "min", "select_n", "lt", "le",
    "gt", "ge", "eq", "ne", "and", "or", "not", "xor", "convert_element_type", "abs",
    "sign", "clamp", "shift_left", "shift_right_logical", "shift_right_arithmetic"))


def takes(eqn: Any, producer: dict) -> bool:
  """Whether `eqn` is a gather or scatter of single elements over every operand
  dimension whose indices are a concatenation: the form the rewrite can start
  from (a cheap test on the jaxpr; `rewrite` decides)."""
  form = _FORMS.get(eqn.primitive.name)
  if form is None:
    return False
  dn = eqn.params["dimension_numbers"]
  every = list(range(eqn.invars[0].aval.ndim))
  if (getattr(dn, "operand_batching_dims", ()) or tuple(getattr(dn, form.windows))
      or sorted(getattr(dn, form.collapsed)) != every
      or sorted(getattr(dn, form.index_map)) != every
      or any(s != 1 for s in eqn.params.get("slice_sizes", ()))):
    return False
  concat = producer.get(eqn.invars[1])
  index_dim = eqn.invars[1].aval.ndim - 1
  return (concat is not None and concat.primitive.name == "concatenate"
          and concat.params["dimension"] == index_dim)


class _Form(NamedTuple):
  """The names a gather or a scatter gives the same three dimension lists."""
  windows: str      # positions of the window dimensions in the result / updates
  collapsed: str    # operand dimensions taken one element wide
  index_map: str    # operand dimension of each index column


_GATHER = _Form("offset_dims", "collapsed_slice_dims", "start_index_map")
_SCATTER = _Form("update_window_dims", "inserted_window_dims", "scatter_dims_to_operand_dims")
_FORMS = {"gather": _GATHER, "scatter": _SCATTER, "scatter-add": _SCATTER,
          "scatter_add": _SCATTER, "scatter-mul": _SCATTER, "scatter_mul": _SCATTER,
          "scatter-min": _SCATTER, "scatter_min": _SCATTER, "scatter-max": _SCATTER,
          "scatter_max": _SCATTER}


def rewrite(eqn: Any, args: list[Any], producer: dict, known: Callable[[Any], Any],
            read: Callable[[Any], Any]) -> list[Any] | None:
  """The outputs of `eqn` (bound on `args`) with its run columns as windows, or None
  when no column qualifies; `eqn` is one that `takes` accepts.

  `known(var)` is the concrete value of a jaxpr variable known at trace time (None
  if it is not), `read(var)` its traced value."""
  form = _FORMS[eqn.primitive.name]
  dn = eqn.params["dimension_numbers"]
  index_map = tuple(getattr(dn, form.index_map))
  operand_shape = eqn.invars[0].aval.shape
  batch_shape = eqn.invars[1].aval.shape[:-1]
  nb = len(batch_shape)
  # One entry per index column: (part, column in part, value if known).
  columns = []
  for part in producer[eqn.invars[1]].invars:
    value = known(part)
    for k in range(part.aval.shape[-1]):
      columns.append((part, k, None if value is None else np.asarray(value)[..., k]))
  windows: dict[int, tuple[int, int]] = {}    # column -> (batch dim, window size)
  for c, (_, _, value) in enumerate(columns):
    run = None if value is None else _run(value, operand_shape[index_map[c]])
    if run is not None and run[0] not in {w[0] for w in windows.values()}:
      windows[c] = run
  run_dims = sorted(w[0] for w in windows.values())
  if not windows:
    return None
  for c, (part, _, value) in enumerate(columns):
    if c not in windows:
      const = (_constant_dims_of_value(value) if value is not None
               else _constant_dims(part, producer, known))
      if not set(run_dims) <= const:
        return None
  # The window dims appear in the result in the operand's order.
  by_operand = sorted(windows, key=lambda c: index_map[c])
  if [windows[c][0] for c in by_operand] != run_dims:
    return None

  # Every column at the first position along the run dims: a window's column is
  # then its start, the others are the same as before.
  keep = tuple(batch_shape[b] for b in range(nb) if b not in run_dims)
  limits = tuple(1 if b in run_dims else n for b, n in enumerate(batch_shape))
  new_columns = []
  for part, k, value in columns:
    if value is None:
      value = lax.slice(read(part), (0,) * (nb + 1), limits + (k + 1,), None)
      value = lax.reshape(lax.slice_in_dim(value, k, k + 1, axis=nb), keep + (1,))
    else:
      value = value[tuple(slice(0, n) for n in limits)].reshape(keep + (1,))
    new_columns.append(value)
  dtype = eqn.invars[1].aval.dtype
  indices = lax.concatenate([lax.convert_element_type(x, dtype) for x in new_columns],
                            len(keep))
  window_of = {index_map[c]: windows[c][1] for c in windows}
  changes = {form.windows: tuple(run_dims),
             form.collapsed: tuple(sorted(index_map[c] for c in range(len(columns))
                                          if c not in windows))}
  params = dict(eqn.params, dimension_numbers=dn._replace(**changes))
  if "slice_sizes" in params:
    params["slice_sizes"] = tuple(window_of.get(d, 1) for d in range(len(operand_shape)))
  outs = eqn.primitive.bind(args[0], indices, *args[2:], **params)
  return list(outs) if eqn.primitive.multiple_results else [outs]


def _run(column: np.ndarray, size: int) -> tuple[int, int] | None:
  """(dim, n) when `column` is `start + arange(n)` along one dim `dim` of
  length n > 1 and constant along the others, with [start, start + n) inside
  [0, size); None otherwise."""
  varying = [b for b in range(column.ndim)
             if column.shape[b] > 1 and b not in _constant_dims_of_value(column)]
  if len(varying) != 1:
    return None
  b = varying[0]
  line = np.take(column, 0, axis=None) + np.arange(column.shape[b])
  first = column[tuple(slice(None) if k == b else 0 for k in range(column.ndim))]
  start, n = int(first[0]), column.shape[b]
  if not np.array_equal(first, line) or start < 0 or start + n > size:
    return None
  return b, n


def _constant_dims_of_value(value: np.ndarray) -> set[int]:
  return {b for b in range(value.ndim)
          if np.array_equal(value, np.take(value, [0], axis=b).repeat(value.shape[b], b))}


def _constant_dims(var: Any, producer: dict, known: Callable[[Any], Any]) -> set[int]:
  """Dimensions along which the value of `var` is provably constant, from the
  equations that compute it (broadcasts and elementwise arithmetic)."""
  shape = var.aval.shape
  ones = {b for b, n in enumerate(shape) if n == 1}
  value = known(var)
  if value is not None:
    return _constant_dims_of_value(np.asarray(value))
  eqn = producer.get(var)
  if eqn is None:
    return ones
  name = eqn.primitive.name
  if name == "broadcast_in_dim":
    src = eqn.invars[0]
    src_const = _constant_dims(src, producer, known) if not isinstance(src, Literal) else set(
        range(np.ndim(src.val)))
    dims = tuple(eqn.params["broadcast_dimensions"])
    return {b for b in range(len(shape))
            if b not in dims or dims.index(b) in src_const} | ones
  if name in _ELEMENTWISE:
    const = set(range(len(shape)))
    for x in eqn.invars:
      if isinstance(x, Literal) or x.aval.ndim == 0:
        continue
      if x.aval.shape != shape:
        return ones
      const &= _constant_dims(x, producer, known)
    return const | ones
  return ones

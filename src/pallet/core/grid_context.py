"""The kernel being traced: its program ids, grid and name, as `pl.program_id`,
`pl.num_programs`, named grid axes and error messages see them.

Kept apart from the primitives so that modules the primitives build on (the checks,
which name the kernel in their messages) can ask for it too.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Sequence

from pallet import _internals as internals


@dataclasses.dataclass
class _GridContext:
  program_ids: tuple[Any, ...]
  grid: tuple[int, ...]
  kernel_name: str | None = None
  grid_names: tuple[Any, ...] | None = None   # a named grid: one name (or None) per axis
  nested: bool = False   # an inner grid of the same kernel (emit_pipeline)


_grid_contexts: list[_GridContext] = []


@contextlib.contextmanager
def grid_context(program_ids: Sequence[Any], grid: Sequence[int], kernel_name: str | None = None,
                 grid_names: Sequence[Any] | None = None, nested: bool = False) -> Iterator[None]:
  """Makes `program_id`/`num_programs` (and `lax.axis_index` of a named grid axis)
  answer for the kernel being traced. A `nested` grid (a pipeline inside the kernel)
  answers `program_id` for itself but keeps the kernel's named (mesh) axes."""
  names = tuple(grid_names) if grid_names is not None else None
  _grid_contexts.append(_GridContext(tuple(program_ids), tuple(grid), kernel_name, names,
                                     nested))
  axes = [(n, g) for n, g in zip(names or (), grid) if n is not None]
  try:
    with internals.extend_axis_env(axes):
      yield
  finally:
    _grid_contexts.pop()


def current_kernel_name() -> str | None:
  """The name of the kernel being traced, or None outside a kernel."""
  return _grid_contexts[-1].kernel_name if _grid_contexts else None


def current_grid_names() -> dict[Any, Any]:
  """Named axes of the innermost kernel's grid (a `pl.kernel` mesh), each with this
  program's index along it; empty outside kernels and for unnamed grids. Inside a
  nested grid (emit_pipeline) the enclosing kernel's names stay visible."""
  names: dict[Any, Any] = {}
  for ctx in reversed(_grid_contexts):
    for n, i in zip(ctx.grid_names or (), ctx.program_ids):
      if n is not None:
        names.setdefault(n, i)
    if not ctx.nested:
      break
  return names

"""Named kernels: `pallas_call` over NamedArrays, with blocks and grid written by axis name.

This is a thin layer over the core `pallet.pallas_call`: it turns NamedArrays into raw
arrays and named block specs into `BlockSpec`s, and wraps the kernel so it receives
`NamedRef`s over its blocks. Nothing here reaches into the core beyond that public API.

    grid = {"batch": B, "head": H, "seq": S // 64}
    attend = pn.pallas_call(kernel, out_shape=q, grid=grid,
                            block={"batch": None, "head": None, "seq": 64})
    out = attend(q, k, v)                     # q, k, v: NamedArrays; out: a NamedArray

Rules:
  * `block` maps axis names to block sizes; `None` means one position whose axis the
    kernel does not see (Pallas' squeezed dimension). Axes not named are whole.
  * A cut axis takes its block index from the grid axis of the same name. A
    `NamedBlockSpec(block, index_map)` per operand overrides this: `index_map`
    receives `{grid axis name: program id}` and returns `{axis name: block index}`.
  * `out_shape` entries may be `NamedShapeDtype(axes, dtype)` or a NamedArray used as a
    template; those outputs come back as NamedArrays. Raw arrays and
    `jax.ShapeDtypeStruct`s pass through with ordinary `BlockSpec`s.
  * `scratch_shapes` entries may be `NamedShapeDtype`s too; the kernel gets NamedRefs.
  * Inside the kernel `program_id("seq")` / `num_programs("seq")` address the grid by name.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax

from pallet.core import primitives
from pallet.core import specs as specs_lib
from pallet.pallas_call import pallas_call as _core_pallas_call
from pallet.named.array import NamedArray
from pallet.named.axis import Axis, AxisSelector, as_axes, axis_name
from pallet.named.ref import NamedRef

BlockSizes = Mapping[str, "int | None"]


@dataclasses.dataclass(frozen=True)
class NamedBlockSpec:
  """How one NamedArray operand is cut into blocks, by axis name.

  `block`: `{axis name: block size}` (`None`: size 1, hidden from the kernel).
  `index_map`: optional `grid_ids -> {axis name: block index}`, where `grid_ids` maps
  each grid axis name to its program id; axes it leaves out follow the grid axis of
  the same name.
  """
  block: BlockSizes = dataclasses.field(default_factory=dict)
  index_map: Callable[[dict[Any, Any]], Mapping[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class NamedShapeDtype:
  """The named shape and dtype of a kernel output (`jax.ShapeDtypeStruct` with names)."""
  axes: tuple[Axis, ...]
  dtype: Any

  def __init__(self, axes: Any, dtype: Any):
    object.__setattr__(self, "axes", as_axes(axes))
    object.__setattr__(self, "dtype", dtype)


# --- grid names inside the kernel ---------------------------------------------------------

_grid_names: list[tuple[Any, ...]] = []


@contextlib.contextmanager
def _naming_grid(names: tuple[Any, ...]) -> Iterator[None]:
  _grid_names.append(names)
  try:
    yield
  finally:
    _grid_names.pop()


def _grid_position(axis: AxisSelector | int, fn_name: str) -> int:
  if not _grid_names:
    raise RuntimeError(f"pallet.named.{fn_name} may only be called inside a kernel run by "
                       "pallet.named.pallas_call")
  names = _grid_names[-1]
  key = axis if isinstance(axis, int) else axis_name(axis)
  if key not in names:
    raise ValueError(f"pallet.named.{fn_name}({axis!r}): the grid axes are {names}")
  return names.index(key)


def program_id(axis: AxisSelector | int) -> jax.Array:
  """This program's index along the grid axis called `axis`."""
  return primitives.program_id(_grid_position(axis, "program_id"))


def num_programs(axis: AxisSelector | int) -> jax.Array:
  """The number of programs along the grid axis called `axis`."""
  return primitives.num_programs(_grid_position(axis, "num_programs"))


# --- translation to the core API -----------------------------------------------------------


def _named_grid(grid: Any, kernel_name: str) -> tuple[tuple[Any, ...], tuple[int, ...]]:
  """(names, sizes) of the grid; an unnamed grid is named by position 0, 1, ..."""
  if isinstance(grid, Mapping):
    return tuple(axis_name(k) for k in grid), tuple(grid.values())
  if isinstance(grid, Axis):
    grid = (grid,)
  if isinstance(grid, int):
    grid = (grid,)
  grid = tuple(grid)
  if all(isinstance(g, Axis) for g in grid):
    return tuple(g.name for g in grid), tuple(g.size for g in grid)
  if any(isinstance(g, Axis) for g in grid):
    raise TypeError(f"named pallas_call of kernel '{kernel_name}': grid mixes Axis objects "
                    f"and sizes: {grid!r}")
  return tuple(range(len(grid))), grid


def _as_spec(spec: Any, default_block: BlockSizes, where: str) -> NamedBlockSpec:
  if spec is None:
    return NamedBlockSpec(default_block)
  if isinstance(spec, NamedBlockSpec):
    return spec
  if isinstance(spec, Mapping):
    return NamedBlockSpec(spec)
  raise TypeError(f"{where}: a NamedArray operand needs a NamedBlockSpec or a "
                  f"{{axis name: block size}} dict, got {type(spec).__name__}: {spec!r}")


def _block_spec(axes: tuple[Axis, ...], spec: NamedBlockSpec, grid_names: tuple[Any, ...],
                shared: bool, where: str) -> tuple[specs_lib.BlockSpec, tuple[Axis, ...]]:
  """The core BlockSpec for a named operand, and the axes of the block the kernel sees.

  `shared`: the spec is pallas_call's `block=`, which may name axes of other operands.
  """
  names = [ax.name for ax in axes]
  block = {axis_name(k): v for k, v in spec.block.items()}
  for name, size in block.items():
    if name not in names:
      if shared:
        continue
      raise ValueError(f"{where}: block names axis {name!r}, but the operand's axes are "
                       f"{tuple(names)}")
    if size is not None and (not isinstance(size, int) or size < 1):
      raise ValueError(f"{where}: block size for axis {name!r} must be a positive int or "
                       f"None, got {size!r}")
  sizes = [block.get(ax.name, ax.size) for ax in axes]
  custom_keys: set[str] = set()
  if spec.index_map is not None:
    custom_keys = {axis_name(k) for k in spec.index_map({n: 0 for n in grid_names})}
    for name in custom_keys:
      if name not in names:
        raise ValueError(f"{where}: index_map returns a block index for axis {name!r}, but "
                         f"the operand's axes are {tuple(names)}")
  for ax, size in zip(axes, sizes):
    cut = size is None or size < ax.size
    if cut and ax.name not in grid_names and ax.name not in custom_keys:
      raise ValueError(f"{where}: axis {ax.name!r} is cut into blocks of "
                       f"{1 if size is None else size} but the grid has no axis "
                       f"{ax.name!r} (grid axes {grid_names}) and no index_map entry "
                       "gives its block index")

  def index_map(*program_ids):
    ids = dict(zip(grid_names, program_ids))
    chosen = ({axis_name(k): v for k, v in spec.index_map(ids).items()}
              if spec.index_map is not None else {})
    return tuple(chosen[ax.name] if ax.name in chosen
                 else ids[ax.name] if ax.name in ids and (size is None or size < ax.size)
                 else 0
                 for ax, size in zip(axes, sizes))

  block_axes = tuple(ax.resize(size) for ax, size in zip(axes, sizes) if size is not None)
  return specs_lib.BlockSpec(tuple(sizes), index_map), block_axes


def _out_named_axes(o: Any) -> tuple[Axis, ...] | None:
  """Axes of an output or scratch request given by name (None: a raw request)."""
  if isinstance(o, (NamedShapeDtype, NamedArray)):
    return o.axes
  return None


def _raw_out_shape(o: Any) -> Any:
  if isinstance(o, NamedShapeDtype):
    return jax.ShapeDtypeStruct(tuple(ax.size for ax in o.axes), o.dtype)
  if isinstance(o, NamedArray):
    return jax.ShapeDtypeStruct(o.array.shape, o.dtype)
  return o


def _operand_specs(operand_axes: Sequence[tuple[Axis, ...] | None], specs: Any,
                   default_block: BlockSizes, grid_names: tuple[Any, ...], what: str,
                   kernel_name: str) -> tuple[list[Any], list[tuple[Axis, ...] | None]]:
  """Core specs and kernel-side block axes for each operand (None axes: a raw operand)."""
  if specs is None:
    specs = [None] * len(operand_axes)
  elif isinstance(specs, (NamedBlockSpec, specs_lib.BlockSpec)) or isinstance(specs, Mapping):
    specs = [specs] * len(operand_axes)
  specs = list(specs)
  if len(specs) != len(operand_axes):
    raise ValueError(f"named pallas_call of kernel '{kernel_name}': {len(specs)} {what} "
                     f"for {len(operand_axes)} operands")
  core_specs, block_axes = [], []
  for i, (axes, spec) in enumerate(zip(operand_axes, specs)):
    where = f"named pallas_call of kernel '{kernel_name}', {what}[{i}]"
    if axes is None:
      if isinstance(spec, (NamedBlockSpec, Mapping)):
        raise TypeError(f"{where}: the operand is not a NamedArray, so it needs a "
                        "pallet BlockSpec, not a named block spec")
      core_specs.append(specs_lib.no_block_spec if spec is None else spec)
      block_axes.append(None)
      continue
    core, kernel_axes = _block_spec(axes, _as_spec(spec, default_block, where), grid_names,
                                    spec is None, where)
    core_specs.append(core)
    block_axes.append(kernel_axes)
  return core_specs, block_axes


def _kernel_name(kernel: Callable) -> str:
  while hasattr(kernel, "func"):  # functools.partial
    kernel = kernel.func
  return getattr(kernel, "__name__", type(kernel).__name__)


def _raw_scratch(s: Any) -> Any:
  if isinstance(s, NamedShapeDtype):
    return specs_lib.ScratchShape(tuple(ax.size for ax in s.axes), s.dtype)
  return s


def pallas_call(kernel: Callable[..., None], out_shape: Any, *, grid: Any = (),
                block: BlockSizes | None = None, in_specs: Any = None, out_specs: Any = None,
                scratch_shapes: Sequence[Any] = (), **options: Any) -> Callable[..., Any]:
  """`pallet.pallas_call` for NamedArrays: the kernel gets NamedRefs over its blocks.

  `grid`: `{name: size}`, a sequence of Axis, or plain sizes. `block`: default block
  sizes by axis name for every NamedArray operand (see the module docstring);
  `in_specs`/`out_specs`: per operand, a NamedBlockSpec or `{name: size}` dict for
  NamedArrays (None: use `block`), a pallet `BlockSpec` for raw arrays. Other options
  (`interpret`, `backend`, `debug`, `name`, `compiler_params`, ...) go to the core.
  """
  kernel_name = options.get("name") or _kernel_name(kernel)
  grid_names, grid_sizes = _named_grid(grid, kernel_name)
  default_block = dict(block or {})
  single_out = not isinstance(out_shape, (tuple, list))
  outs = (out_shape,) if single_out else tuple(out_shape)

  def launch(*args: Any) -> Any:
    in_axes = [a.axes if isinstance(a, NamedArray) else None for a in args]
    out_axes = [_out_named_axes(o) for o in outs]
    core_in, in_block_axes = _operand_specs(in_axes, in_specs, default_block, grid_names,
                                            "in_specs", kernel_name)
    core_out, out_block_axes = _operand_specs(out_axes, out_specs, default_block, grid_names,
                                              "out_specs", kernel_name)
    scratch_axes = [_out_named_axes(s) for s in scratch_shapes]
    ref_axes = in_block_axes + out_block_axes + scratch_axes

    @functools.wraps(kernel)  # keeps the user's signature for the core's arity check
    def kernel_over_blocks(*refs):
      named_refs = [r if axes is None else NamedRef(r, axes)
                    for r, axes in zip(refs, ref_axes)]
      with _naming_grid(grid_names):
        kernel(*named_refs)
    kernel_over_blocks.__name__ = kernel_name

    raw_outs = tuple(_raw_out_shape(o) for o in outs)
    call = _core_pallas_call(
        kernel_over_blocks, raw_outs[0] if single_out else raw_outs, grid=grid_sizes,
        in_specs=core_in, out_specs=core_out[0] if single_out else core_out,
        scratch_shapes=tuple(_raw_scratch(s) for s in scratch_shapes), **options)
    results = call(*(a.array if isinstance(a, NamedArray) else a for a in args))
    results = (results,) if single_out else tuple(results)
    named_results = tuple(r if axes is None else NamedArray(r, axes)
                          for r, axes in zip(results, out_axes))
    return named_results[0] if single_out else named_results

  return launch

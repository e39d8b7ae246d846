"""Kernels over a mesh of cores: `pl.kernel`, `pl.core_map`, `pltpu.TensorCoreMesh`.

A mesh names the cores a kernel runs on (`{"core": 2}`), and the body asks
`lax.axis_index("core")` which one it is. On pallet one CPU device plays every
core in turn: `pl.kernel` becomes a `pallas_call` whose grid is the mesh, with
named axes (so `lax.axis_index` answers) run in order ("arbitrary"), every
operand passed whole (memory space ANY, as on a TPU, where the body moves data
itself). `core_map` is such a kernel over the refs its body closes over. Cores
that wait on each other (barriers between concurrently running cores) cannot be
played in turn; those operations raise a clear error.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax

from pallet.core import primitives
from pallet.core import specs as specs_lib
from pallet.errors import PalletError
from pallet.pallas_call import pallas_call
from pallet.tpu.params import CoreType, GridDimensionSemantics
from pallet.core.unsupported import describe_call_site


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorCoreMesh:
  """The TensorCores of one TPU device, along one named axis."""
  axis_name: str
  num_cores: int = 1

  @property
  def core_type(self) -> CoreType:
    return CoreType.TC

  @property
  def default_memory_space(self) -> specs_lib.MemorySpace:
    return specs_lib.MemorySpace.ANY

  @property
  def shape(self) -> Mapping[str, int]:
    return collections.OrderedDict({self.axis_name: self.num_cores})

  @property
  def dimension_semantics(self) -> Sequence[GridDimensionSemantics]:
    return [GridDimensionSemantics.PARALLEL]


def create_tensorcore_mesh(axis_name: str, devices: Sequence[Any] | None = None,
                           num_cores: int | None = None) -> TensorCoreMesh:
  """A mesh of `num_cores` TensorCores (default: one, the CPU stand-in's count)."""
  if devices is not None and num_cores is not None:
    raise ValueError("create_tensorcore_mesh: give devices or num_cores, not both")
  if num_cores is None:
    num_cores = getattr(devices[0], "num_cores", 1) if devices else 1
  return TensorCoreMesh(axis_name=axis_name, num_cores=int(num_cores))


def _mesh_axes(mesh: Any, what: str) -> tuple[tuple[Any, int], ...]:
  shape = getattr(mesh, "shape", None)
  if not isinstance(shape, Mapping):
    raise PalletError(f"{what}: mesh {mesh!r} has no named shape (a mapping from axis "
                      f"name to size, as pltpu.create_tensorcore_mesh gives)")
  return tuple((name, int(size)) for name, size in shape.items())


def _in_order(compiler_params: Any, n_axes: int) -> Any:
  """The user's compiler parameters with every mesh axis run in order: cores may
  write to the same (whole) outputs, so their steps must not be vectorized."""
  if compiler_params is None or not dataclasses.is_dataclass(compiler_params):
    return compiler_params
  if "dimension_semantics" not in {f.name for f in dataclasses.fields(compiler_params)}:
    return compiler_params
  return dataclasses.replace(compiler_params, dimension_semantics=("arbitrary",) * n_axes)


def kernel(body: Callable[..., None] | None = None, out_type: Any = None, *,
           mesh: Any, scratch_types: Any = (), compiler_params: Any = None,
           interpret: Any = False, cost_estimate: Any = None, debug: bool = False,
           name: str | None = None, metadata: dict[str, str] | None = None,
           out_shape: Any = None, scratch_shapes: Any = ()) -> Callable[..., Any]:
  """`pl.kernel(body, out_type, mesh=...)(*args)`, or as a decorator
  `@pl.kernel(out_type=..., mesh=...)`. The body gets (*input refs, *output refs,
  *scratch refs), all whole arrays (a dict of scratch types by keyword);
  `out_shape`/`scratch_shapes` are accepted as older spellings of
  `out_type`/`scratch_types`."""
  del cost_estimate, metadata
  out_type = out_shape if out_type is None else out_type
  scratch = specs_lib.scratch_tree(scratch_types or scratch_shapes or ())
  if isinstance(mesh, (list, tuple)) or isinstance(body, (list, tuple)):
    raise PalletError("pl.kernel: several bodies on several meshes (MPMD) need cores "
                      "running concurrently; pallet runs one mesh per kernel")

  def make(fn: Callable[..., None]) -> Callable[..., Any]:
    kernel_name = name or getattr(fn, "__name__", "kernel")
    axes = _mesh_axes(mesh, f"pl.kernel '{kernel_name}'")
    outs = () if out_type is None else out_type
    any_spec = specs_lib.BlockSpec(memory_space=specs_lib.MemorySpace.ANY)

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
      # one spec per argument stands for its whole pytree (nested operands included)
      call = pallas_call(
          fn, outs, grid=axes, in_specs=tuple(any_spec for _ in args), out_specs=any_spec,
          scratch_shapes=scratch, compiler_params=_in_order(compiler_params, len(axes)),
          interpret=interpret, debug=debug, name=kernel_name)
      return call(*args)
    return run

  return make if body is None else make(body)


def core_map(mesh: Any, *, compiler_params: Any = None, interpret: Any = False,
             debug: bool = False, cost_estimate: Any = None, name: str | None = None,
             metadata: dict[str, str] | None = None,
             scratch_shapes: Any = ()) -> Callable[[Callable[[], None]], None]:
  """`@pl.core_map(mesh)` runs a body that takes no arguments once per core of the
  mesh (in order), with `lax.axis_index(axis)` giving the core; the body works on
  refs it closes over (e.g. inside `pl.run_state`). It is a `pl.kernel` with no
  operands of its own: the refs it closes over become the call's operands, written
  back when it returns (pallet/core/closed_over.py), and a body that talks to other
  devices runs like any kernel that does (pallet/distributed/mesh_launch.py)."""
  def run(fn: Callable[..., None]) -> None:
    kernel_name = name or getattr(fn, "__name__", "core_map")
    _mesh_axes(mesh, f"pl.core_map '{kernel_name}'")

    def body(*scratch: Any, **keyword_scratch: Any) -> None:
      fn(*scratch, **keyword_scratch)

    kernel(body, (), mesh=mesh, scratch_types=scratch_shapes,
           compiler_params=compiler_params, interpret=interpret, debug=debug,
           cost_estimate=cost_estimate, name=kernel_name, metadata=metadata)()
    return None
  return run


def run_on_first_core(core_axis_name: str) -> Callable[[Callable[[], Any]], Any]:
  """Decorator: the body runs only on core 0 of `core_axis_name`."""
  def wrapped(fn: Callable[[], Any]) -> Any:
    return primitives.when(jax.lax.axis_index(core_axis_name) == 0)(fn)
  return wrapped


def core_barrier(sem: Any, *, core_axis_name: str) -> None:
  """Waits until every core of the axis arrives. One core: nothing to wait for.
  Several cores are played in turn on pallet, so none could ever arrive first."""
  del sem
  if jax.lax.axis_size(core_axis_name) > 1:
    raise PalletError(f"pltpu.core_barrier over {jax.lax.axis_size(core_axis_name)} "
                      f"cores {describe_call_site()}: pallet runs the cores of a mesh "
                      f"one after another, so a barrier between them cannot be met; use "
                      f"a mesh with num_cores=1")

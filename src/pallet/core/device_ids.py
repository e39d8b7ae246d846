"""`pl.DeviceIdType` and what a remote DMA's or signal's `device_id` names.

A kernel inside `shard_map` runs on every device of the mesh; `device_id` picks
the device an operation reaches, in one of three forms (as in Pallas):

* a tuple of mesh coordinates, one per mesh axis in the mesh's order
  (`DeviceIdType.MESH`, the default), or one scalar on a 1-D mesh;
* a dict `{axis name: index}` (MESH): the named axes move, every other mesh axis
  keeps this device's coordinate; a tuple of names as a key indexes those axes
  jointly (row-major). A key naming an axis of the kernel's own `pl.kernel` mesh
  (a core axis) picks a core;
* one scalar, the device's flat index over the whole mesh, row-major
  (`DeviceIdType.LOGICAL`).

`normalize` turns any of them, while a kernel is traced, into the coordinates
along the mesh axes named explicitly; the other mesh axes stay this device's.
A core coordinate must name the core running the operation: pallet runs the
cores of a `pl.kernel` mesh one after another, so no other core could answer.
`DeviceIdType` and `device_id_type=` are deprecated in JAX; kept so that kernels
passing them still run.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallet import _internals as internals
from pallet.core import checks, primitives
from pallet.errors import PalletError


class DeviceIdType(enum.Enum):
  MESH = "mesh"
  LOGICAL = "logical"


@dataclasses.dataclass(frozen=True)
class Target:
  """The device an operation reaches: `coords[k]` along mesh axis `axes[k]` (int32
  scalars); every other mesh axis is this device's own coordinate."""
  axes: tuple[Any, ...]
  coords: tuple[Any, ...]


def mesh_axes() -> tuple[tuple[Any, int], ...]:
  """(name, size) of the mesh axes a kernel being traced runs over (its enclosing
  `shard_map`'s, in mesh order), without the axes of its own grid."""
  grid_names = set(primitives.current_grid_names())
  return tuple((n, s) for n, s in internals.axis_env() if n not in grid_names)


def normalize(device_id: Any, device_id_type: Any, api: str, site: str) -> Target:
  """`device_id` as a `Target`; `api` and `site` name the call for messages."""
  id_type = _id_type(device_id_type, api, site)
  axes = mesh_axes()
  sizes = dict(axes)
  where = f"{api} in {site}"
  if isinstance(device_id, dict):
    if id_type is not DeviceIdType.MESH:
      raise PalletError(f"{where}: a dict device_id needs device_id_type=MESH, got "
                        f"{id_type}")
    coords: dict[Any, Any] = {}
    for key, index in device_id.items():
      names = key if isinstance(key, tuple) else (key,)
      if all(n in sizes for n in names):
        coords.update(_unravel(_coordinate(index, where), [(n, sizes[n]) for n in names]))
      elif len(names) == 1 and _check_core(key, index, api, where):
        continue
      else:
        raise PalletError(f"{where}: device_id names axis {key!r}, which is neither an axis "
                          f"of the enclosing mesh {[n for n, _ in axes]} nor one of the "
                          f"kernel's own mesh axes {list(primitives.current_grid_names())}")
    ordered = [n for n, _ in axes if n in coords]
    return Target(tuple(ordered), tuple(coords[n] for n in ordered))
  if id_type is DeviceIdType.LOGICAL:
    if isinstance(device_id, (tuple, list)):
      raise PalletError(f"{where}: a LOGICAL device_id is one scalar (the device's flat "
                        f"index over the mesh), got a {type(device_id).__name__}")
    if not axes:
      _no_mesh(where)
    coords = _unravel(_coordinate(device_id, where), list(axes))
    return Target(tuple(n for n, _ in axes), tuple(coords[n] for n, _ in axes))
  ids = list(device_id) if isinstance(device_id, (tuple, list)) else [device_id]
  if not axes:
    _no_mesh(where)
  if len(ids) != len(axes):
    raise PalletError(f"{where}: a MESH device_id gives one coordinate per mesh axis "
                      f"{[n for n, _ in axes]}, got {len(ids)}; name the axes that move "
                      f"with a dict (device_id={{'axis': index}})")
  return Target(tuple(n for n, _ in axes), tuple(_coordinate(i, where) for i in ids))


def _id_type(device_id_type: Any, api: str, site: str) -> DeviceIdType:
  if device_id_type is None:
    return DeviceIdType.MESH
  name = getattr(device_id_type, "name", str(device_id_type)).upper()
  if name not in DeviceIdType.__members__:
    raise PalletError(f"{api} in {site}: device_id_type must be pl.DeviceIdType.MESH or "
                      f".LOGICAL, got {device_id_type!r}")
  return DeviceIdType[name]


def _coordinate(index: Any, where: str) -> jax.Array:
  dtype = getattr(index, "dtype", None)
  dtype = np.asarray(index).dtype if dtype is None else dtype
  if not jnp.issubdtype(dtype, jnp.integer) or jnp.ndim(index) != 0:
    raise PalletError(f"{where}: every device id must be an integer scalar, got "
                      f"{jnp.shape(index)} {dtype}")
  return jnp.asarray(index, jnp.int32)


def _unravel(index: jax.Array, axes: list[tuple[Any, int]]) -> dict[Any, jax.Array]:
  """Row-major coordinates of flat `index` over `axes` (the last axis varies fastest)."""
  coords = {}
  for name, size in reversed(axes):
    coords[name] = jax.lax.rem(index, np.int32(size))
    index = jax.lax.div(index, np.int32(size))
  return coords


def _check_core(name: Any, index: Any, api: str, where: str) -> bool:
  """For a key naming an axis of the kernel's own grid: checks (at run time, where
  traced) that it names the core running the operation; False for other names."""
  cores = primitives.current_grid_names()
  if name not in cores:
    return False
  own = cores[name]
  message = checks.failure_message(
      f"{api}'s device_id", f"it names another core along {name!r} than the one running "
      f"it; pallet runs the cores of a kernel's mesh one after another, so another core "
      f"can never receive it (use num_cores=1, or name the running core, "
      f"lax.axis_index({name!r}))")
  checks.check(_coordinate(index, where) == own, message)
  return True


def check_core_index(core_index: Any, api: str, site: str) -> None:
  """`core_index=` (a core of this device) must name the core running the operation:
  the program's index along the kernel's one mesh axis, or 0 without a mesh."""
  cores = primitives.current_grid_names()
  where = f"{api} in {site}"
  if len(cores) > 1:
    raise PalletError(f"{where}: core_index= is ambiguous in a kernel over several mesh "
                      f"axes {list(cores)}; name the core in a device_id dict")
  name = next(iter(cores), None)
  own = cores[name] if cores else 0
  message = checks.failure_message(
      f"{api}'s core_index", "it names another core than the one running it; pallet runs "
      "the cores of a kernel's mesh one after another, so another core can never receive "
      "it (use num_cores=1)")
  checks.check(_coordinate(core_index, where) == own, message)


def _no_mesh(where: str) -> None:
  raise PalletError(f"{where}: device_id names a device of a mesh, but the kernel runs "
                    f"outside shard_map (no mesh axes): run it inside jax.shard_map over "
                    f"the devices it talks to")

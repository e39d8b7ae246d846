"""Every public class of pallet's Pallas namespaces is constructed like JAX 0.12's.

JAX's own Pallas is imported as the peer. For every public class of
`jax.experimental.pallas`, `.tpu`, `.triton` and `.fuser` that pallet provides, the
constructor signature (parameter names, kinds, defaults, in order), the dataclass
fields, NamedTuple fields and enum members (names and values) must agree. Names
JAX 0.12 lacks are not looked at; names pallet marks as not supported (objects that
raise a clear error when used, `pallet.core.unsupported`) neither.

Deliberate differences are listed below with their reason. A listed difference that
no longer exists fails too, so the list stays true; docs/compatibility.md says the
same in its rows.
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
from typing import Any

import jax
import pytest

from pallet.core.unsupported import Unsupported

NAMESPACES = {
    "jax.experimental.pallas": "pallet",
    "jax.experimental.pallas.tpu": "pallet.tpu",
    "jax.experimental.pallas.triton": "pallet.triton",
    "jax.experimental.pallas.fuser": "pallet.fuser",
}

# (pallet module, name) -> parameters (and fields) pallet adds after JAX's, all with
# defaults, so every call written for JAX means the same on pallet.
EXTRA_PARAMETERS = {
    ("pallet.tpu", "InterpretParams"): (
        ("detect_nans", "detect_int_overflow", "detect_unwritten_outputs", "debug_checks",
         "detect_hangs", "max_loop_iterations"),
        "the switches of pallet's checking mode (docs/checking.md), keyword-only"),
    ("pallet.triton", "CompilerParams"): (
        ("compute_capability", "gpu_arch", "dimension_semantics", "grid_bounds"),
        "pallet's Triton backend compiles ahead of time for a named target, honours "
        "dimension_semantics and bounds run-time grid sizes"),
}

# (pallet module, name) -> why the class is built differently on purpose.
DIFFERENT = {
    ("pallet", "CompilerParams"):
        "JAX's is an abstract Protocol base class; pallet's is a usable backend-neutral "
        "dataclass (dimension_semantics, num_warps, num_stages) that every backend accepts",
    ("pallet", "MemoryRef"):
        "pallet's MemoryRef is a scratch shape: fields shape, dtype, memory_space, with "
        "inner_aval a property; it is also built as MemoryRef(aval, memory_space) as in JAX",
    ("pallet", "MemorySpace"):
        "one enum holds every backend's memory spaces (pl.ANY and pltpu.VMEM alike); "
        "ERROR (checkify) and INDEX (SparseCore scalar prefetch) are not memory pallet has",
    ("pallet.tpu", "MemorySpace"):
        "the same enum as pl.MemorySpace (one enum for every backend's memory spaces)",
    ("pallet", "semaphore"):
        "pallet semaphores are int32 refs, so pl.semaphore is the semaphore memory space, "
        "not a dtype class",
    ("pallet.tpu", "SemaphoreType"):
        "its members are pallet scratch shapes (SemaphoreType.DMA((2,)) works as in JAX) "
        "rather than enum members, since pallet semaphores are int32 refs",
    ("pallet.tpu", "TensorCoreMesh"):
        "num_cores defaults to 1 (the CPU stand-in's core count) where JAX asks the TPU",
}


def _jax_012() -> bool:
  return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)


needs_jax_012 = pytest.mark.skipif(not _jax_012(),
                                   reason="the peer is JAX 0.12's Pallas namespaces")


def _default(value: Any) -> Any:
  if value is inspect.Parameter.empty:
    return "<required>"
  if callable(value) and not isinstance(value, type):
    return "<function>"   # e.g. a default index transform: compared by being one
  if "_HAS_DEFAULT_FACTORY" in repr(value) or repr(value) == "<factory>":
    return "<factory>"
  if type(value).__name__ in ("NoBlockSpec", "_NoBlockSpec"):
    return "no_block_spec"   # each library's own marker object
  return value


def _signature(cls: type, drop: tuple[str, ...] = ()) -> list[tuple] | None:
  try:
    sig = inspect.signature(cls)
  except (TypeError, ValueError):
    return None
  return [(p.name, p.kind.name, _default(p.default)) for p in sig.parameters.values()
          if p.name not in drop]


def _fields(cls: type, drop: tuple[str, ...] = ()) -> dict[str, Any]:
  out: dict[str, Any] = {}
  if dataclasses.is_dataclass(cls):
    out["dataclass fields"] = [(f.name, bool(f.kw_only)) for f in dataclasses.fields(cls)
                               if f.name not in drop]
  if isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields"):
    out["NamedTuple fields"] = list(cls._fields)
  if isinstance(cls, type) and issubclass(cls, enum.Enum):
    out["enum members"] = [(m.name, m.value) for m in cls]
  return out


def _shape(cls: Any, drop: tuple[str, ...] = ()) -> dict[str, Any]:
  """What is compared: the class's constructor, fields and members."""
  if not isinstance(cls, type):
    return {"kind": type(cls).__name__}
  shape = _fields(cls, drop)
  if not issubclass(cls, enum.Enum):
    shape["constructor"] = _signature(cls, drop)
  return shape


def _classes() -> list[tuple[str, str, str]]:
  out = []
  for jax_name, pallet_name in NAMESPACES.items():
    jax_module = importlib.import_module(jax_name)
    for name in sorted(dir(jax_module)):
      if name.startswith("_") or not isinstance(getattr(jax_module, name, None), type):
        continue
      out.append((jax_name, pallet_name, name))
  return out


def _pallet_value(pallet_name: str, name: str) -> Any:
  value = getattr(importlib.import_module(pallet_name), name, None)
  if value is None:
    pytest.skip(f"{pallet_name}.{name} is not provided (docs/compatibility.md says so)")
  if isinstance(value, Unsupported):
    pytest.skip(f"{pallet_name}.{name} is marked not supported")
  return value


@needs_jax_012
@pytest.mark.parametrize("jax_name,pallet_name,name", _classes() if _jax_012() else [])
def test_constructor_and_fields_match_jax(jax_name, pallet_name, name):
  jax_cls = getattr(importlib.import_module(jax_name), name)
  ours = _pallet_value(pallet_name, name)
  key = (pallet_name, name)
  if key in DIFFERENT:
    assert _shape(ours) != _shape(jax_cls), (
        f"{pallet_name}.{name} now matches JAX's; remove it from DIFFERENT")
    return
  extra, _ = EXTRA_PARAMETERS.get(key, ((), ""))
  assert _shape(ours, drop=extra) == _shape(jax_cls), (
      f"{pallet_name}.{name} is built differently from {jax_name}.{name}")
  if extra:
    params = inspect.signature(ours).parameters
    assert all(params[p].default is not inspect.Parameter.empty for p in extra)
    names = list(params)
    assert names[-len(extra):] == list(extra), "pallet's extra parameters come last"


@needs_jax_012
def test_cost_estimate_copies_from_estimate_cost():
  """Library code rebuilds a CostEstimate from pl.estimate_cost's fields, by keyword."""
  import jax.numpy as jnp
  import pallet as pl
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  estimate = pl.estimate_cost(lambda a: jnp.tanh(a @ a), x)
  copied = pl.CostEstimate(**dataclasses.asdict(estimate))
  assert copied == estimate and copied.remote_bytes_transferred == 0
  assert estimate.flops >= 2 * 64 ** 3 and estimate.transcendentals >= 64 * 64
  remote = pl.CostEstimate(flops=1, transcendentals=2, bytes_accessed=3,
                           remote_bytes_transferred=4)
  assert remote.remote_bytes_transferred == 4
  from jax.experimental import pallas as jpl
  assert remote.to_json() == jpl.CostEstimate(1, 2, 3, 4).to_json()


def test_cost_estimate_refuses_non_int_fields_as_jax_does():
  import numpy as np
  import pallet as pl
  with pytest.raises(ValueError, match="bytes_accessed"):
    pl.CostEstimate(flops=1, transcendentals=0, bytes_accessed=2.5)
  with pytest.raises(ValueError, match="flops"):
    pl.CostEstimate(flops=np.int64(1), transcendentals=0, bytes_accessed=2)


# ------------------------------------------------------------------ what changed, at work
def test_named_grid_spec_keeps_names_apart_and_runs():
  """As in JAX, GridSpec(grid=(("i", 2), ...)) stores sizes in `grid` and names in
  `grid_names`; pallas_call still gives the kernel lax.axis_index by name."""
  import jax.numpy as jnp
  import pallet as pl
  from helpers import assert_close, pallas_call, random_array, sds

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + jax.lax.axis_index("i").astype(jnp.float32)

  spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
  grid_spec = pl.GridSpec(grid=(("i", 3),), in_specs=[spec], out_specs=spec)
  assert grid_spec.grid == (3,) and grid_spec.grid_names == ("i",)
  assert grid_spec.in_specs == (spec,)
  x = random_array((12, 8))
  out = pallas_call(kernel, out_shape=sds(x), grid_spec=grid_spec)(x)
  assert_close(out, x + jnp.repeat(jnp.arange(3.0), 4)[:, None])


def test_default_memory_space_and_keyword_only_memory_space():
  import pallet as pl
  from helpers import assert_close, pallas_call, random_array, sds

  x = random_array((16, 8))
  spec = pl.BlockSpec((4, 8), lambda i: (i, 0), memory_space=pl.MemorySpace.DEFAULT)
  out = pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 3),
                    out_shape=sds(x), grid=(4,), in_specs=[spec], out_specs=spec)(x)
  assert_close(out, x * 3)
  # the third positional argument is the pipeline mode, as in JAX
  assert pl.BlockSpec((4, 8), None, pl.Buffered(3)).pipeline_mode == pl.Buffered(3)
  with pytest.raises(TypeError):
    pl.Buffered()   # buffer_count is required, as in JAX

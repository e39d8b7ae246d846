"""A stand-in TPU description (`pltpu.get_tpu_info`, `ChipVersion`, `TpuInfo`, `Tiling`).

TPU kernels ask the chip for its geometry (lanes, sublanes, VMEM size, MXU
width) to pick block sizes. pallet runs them elsewhere, so `get_tpu_info()`
describes a generic chip: a single-core TPU v5e-like part (128 lanes, 8 sublanes,
128 MiB of VMEM). The figures only steer block-size choices; results never depend
on them. `is_tpu_device()` answers truthfully (False).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp

_MIB, _GIB = 2 ** 20, 2 ** 30


class ChipVersion(enum.Enum):
  """TPU generations, named as in JAX."""
  TPU_V2 = "v2"
  TPU_V3 = "v3"
  TPU_V4I = "v4i"
  TPU_V4 = "v4"
  TPU_V5E = "v5e"
  TPU_V5P = "v5p"
  TPU_V6E = "v6e"
  TPU_7 = "7"
  TPU_7X = "7x"
  TPU_8I = "8i"
  TPU_8T = "8t"

  def __str__(self) -> str:
    return self.value

  @property
  def is_lite(self) -> bool:
    return self in (ChipVersion.TPU_V4I, ChipVersion.TPU_V5E, ChipVersion.TPU_V6E)

  @property
  def supports_megacore(self) -> bool:
    return self in (ChipVersion.TPU_V4, ChipVersion.TPU_V5P)

  @property
  def num_physical_tensor_cores_per_chip(self) -> int:
    single = (ChipVersion.TPU_V4I, ChipVersion.TPU_V5E, ChipVersion.TPU_V6E,
              ChipVersion.TPU_8T)
    return 1 if self in single else 2

  @property
  def generation(self) -> int:
    return int(self.value.lstrip("v").rstrip("eipxt"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuInfo:
  """Per-TensorCore hardware figures (multiply by `num_cores` for a chip)."""
  chip_version: ChipVersion
  generation: int
  num_cores: int
  num_lanes: int
  num_sublanes: int
  mxu_column_size: int
  num_mxus: int
  num_accumulators: int
  vmem_capacity_bytes: int
  cmem_capacity_bytes: int
  smem_capacity_bytes: int
  hbm_capacity_bytes: int
  mem_bw_bytes_per_second: int
  bf16_ops_per_second: int
  int8_ops_per_second: int
  fp8_ops_per_second: int
  int4_ops_per_second: int
  sparse_core: Any = None

  @property
  def is_lite(self) -> bool:
    return self.chip_version.is_lite

  @property
  def is_megacore(self) -> bool:
    return self.num_cores > 1

  @property
  def is_split_chip(self) -> bool:
    return self.num_cores == 1 and self.chip_version.num_physical_tensor_cores_per_chip > 1

  def is_matmul_supported(self, lhs_dtype: Any, rhs_dtype: Any) -> bool:
    """Every dtype pair multiplies on pallet's backends (no native-MXU restriction)."""
    del lhs_dtype, rhs_dtype
    return True

  def get_sublane_tiling(self, dtype: Any) -> int:
    """Rows per native tile: 8 for 32/16-bit types, more for packed narrower ones."""
    bits = jnp.dtype(dtype).itemsize * 8
    if self.generation < 7 and bits >= 16:
      return self.num_sublanes
    return self.num_sublanes * max(1, 32 // bits)


# Rough per-core VMEM sizes by generation: the one figure kernels size blocks by.
_VMEM = {2: 16 * _MIB, 3: 16 * _MIB, 4: 32 * _MIB, 5: 128 * _MIB, 6: 128 * _MIB,
         7: 64 * _MIB, 8: 64 * _MIB}


def get_tpu_info_for_chip(chip_version: ChipVersion,
                          num_tensor_cores_per_logical_device: int = 1) -> TpuInfo:
  """A plausible description of `chip_version` (figures are nominal, see module doc)."""
  cores = num_tensor_cores_per_logical_device
  if cores != 1 and not chip_version.supports_megacore:
    raise ValueError(f"{chip_version} has no megacore mode; "
                     f"num_tensor_cores_per_logical_device must be 1, got {cores}")
  gen = chip_version.generation
  return TpuInfo(chip_version=chip_version, generation=gen, num_cores=cores,
                 num_lanes=128, num_sublanes=8,
                 mxu_column_size=128 if gen < 6 else 256, num_mxus=4,
                 num_accumulators=4 if gen >= 7 else 0,
                 vmem_capacity_bytes=_VMEM[gen], cmem_capacity_bytes=0,
                 smem_capacity_bytes=1 * _MIB, hbm_capacity_bytes=16 * _GIB,
                 mem_bw_bytes_per_second=819 * 10 ** 9,
                 bf16_ops_per_second=197 * 10 ** 12, int8_ops_per_second=394 * 10 ** 12,
                 fp8_ops_per_second=0, int4_ops_per_second=0)


def get_tpu_info() -> TpuInfo:
  """The stand-in chip pallet describes itself as: a single-core TPU v5e."""
  return get_tpu_info_for_chip(ChipVersion.TPU_V5E, 1)


def is_tpu_device() -> bool:
  """Whether JAX's default device is a TPU (pallet does not drive one either way)."""
  return jax.devices()[0].platform == "tpu"


class Tiling(enum.Enum):
  """Native memory tilings; `.shape` is the stand-in chip's tile."""
  COMPACT = enum.auto()
  SPARSE_CORE = enum.auto()

  @property
  def shape(self) -> tuple[int, ...]:
    info = get_tpu_info()
    if self is Tiling.COMPACT:
      return (info.num_sublanes, info.num_lanes)
    return (8,)

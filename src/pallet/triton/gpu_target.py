"""The GPU a Triton kernel is compiled for: launch parameters and hardware info.

`CompilerParams` is what `jax.experimental.pallas.triton.CompilerParams` is (JAX 0.12
fields `num_warps`, `num_stages`), plus the target to compile for ahead of time.
Passing it to `pallas_call` selects the Triton backend where a GPU is present
(see `pallet.backends`). `GpuVersion`, `GpuInfo`, `get_gpu_info` and
`is_gpu_device` describe the device the way Pallas' `gpu_info` does, from the
device JAX runs on.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

import jax

from typing import Sequence


@dataclasses.dataclass(frozen=True)
class CompilerParams:
  """Launch parameters of the Triton backend (ignored by the CPU backend).

  `num_warps` and `num_stages` come first, as in Pallas. `compute_capability`
  (e.g. 80, 90) or `gpu_arch` (e.g. "gfx942") pick the target to compile for when
  no GPU is visible (ahead-of-time lowering); by default the target is device 0's.
  `dimension_semantics` ("parallel"/"arbitrary" per grid axis) overrides the
  backend's own split of the grid into launched and looped axes. `grid_bounds` (one
  entry per grid axis, None for static ones) gives the largest size a grid axis
  computed at run time is expected to take: a parallel one launches that many
  programs, which exit early past the actual size (a larger size still runs every
  index: each program then takes several).
  """
  num_warps: int | None = None
  num_stages: int | None = None
  compute_capability: int | None = None
  gpu_arch: str | None = None
  dimension_semantics: Sequence[str] | None = None
  grid_bounds: Sequence[int | None] | None = None

  def __post_init__(self):
    # (a list would make the params unhashable, and kernels are cached by them)
    if isinstance(self.grid_bounds, list):
      object.__setattr__(self, "grid_bounds", tuple(self.grid_bounds))


@dataclasses.dataclass(frozen=True)
class TableCompilerParams(CompilerParams):
  """CompilerParams a library chose from a per-device table (pallet.ops), not the
  user: a `num_stages` whose pipelined buffers need more shared memory than the GPU
  has is lowered until the kernel fits, as the backend does with its own default,
  instead of being an error (a table entry serves a whole family of GPUs)."""
  stages_shrink_to_fit: ClassVar[bool] = True


class GpuVersion(enum.Enum):
  """NVIDIA GPUs by the name their device kind contains (JAX's members, in its order)."""
  A10 = "NVIDIA A10"
  A30 = "NVIDIA A30"
  A100 = "NVIDIA A100"
  H100 = "NVIDIA H100"
  H200 = "NVIDIA H200"
  GH200 = "NVIDIA GH200"
  B200 = "NVIDIA B200"
  GB200 = "NVIDIA GB200"
  B300 = "NVIDIA B300"
  GB300 = "NVIDIA GB300"
  GB10 = "NVIDIA GB10"
  L4 = "NVIDIA L4"
  L40 = "NVIDIA L40"
  T4 = "Tesla T4"
  RTX_4090 = "NVIDIA GeForce RTX 4090"
  RTX_PRO_4500 = "NVIDIA RTX PRO 4500"
  RTX_PRO_5000 = "NVIDIA RTX PRO 5000"
  RTX_PRO_6000 = "NVIDIA RTX PRO 6000"
  THOR = "NVIDIA Thor"
  VR200 = "NVIDIA VR200"

  def __str__(self) -> str:
    return self.value


_COMPUTE_CAPABILITY = {
    GpuVersion.T4: 75, GpuVersion.A10: 86, GpuVersion.A30: 80, GpuVersion.A100: 80,
    GpuVersion.L4: 89, GpuVersion.L40: 89, GpuVersion.RTX_4090: 89,
    GpuVersion.H100: 90, GpuVersion.H200: 90, GpuVersion.GH200: 90,
    GpuVersion.B200: 100, GpuVersion.GB200: 100, GpuVersion.B300: 103,
    GpuVersion.GB300: 103, GpuVersion.VR200: 107, GpuVersion.THOR: 110,
    GpuVersion.RTX_PRO_4500: 120, GpuVersion.RTX_PRO_5000: 120,
    GpuVersion.RTX_PRO_6000: 120, GpuVersion.GB10: 121,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuInfo:
  """A GPU: its version (None where the device kind names no known one), its
  architecture name ("9.0", "gfx942") and compute capability (0 on AMD)."""
  gpu_version: GpuVersion | None
  arch_name: str
  compute_capability: int


def _default_device() -> jax.Device:
  return jax.devices()[0]


def is_gpu_device() -> bool:
  """Whether JAX's default device is a GPU."""
  return _default_device().platform in ("gpu", "cuda", "rocm")


def multiprocessor_count() -> int | None:
  """SMs (NVIDIA) or compute units (AMD) of the default device, where it is a GPU whose
  runtime reports them (jaxlib's `core_count`); None elsewhere."""
  if not is_gpu_device():
    return None
  count = getattr(_default_device(), "core_count", None)
  return count if isinstance(count, int) and count > 0 else None


def gpu_version_of(device_kind: str) -> GpuVersion | None:
  """The GpuVersion a device kind names (the longest match: "A100" before "A10")."""
  matches = [v for v in GpuVersion if v.value in device_kind]
  return max(matches, key=lambda v: len(v.value)) if matches else None


def get_gpu_info_from_version(gpu_version: GpuVersion) -> GpuInfo:
  cc = _COMPUTE_CAPABILITY[GpuVersion(gpu_version)]
  return GpuInfo(gpu_version=GpuVersion(gpu_version), arch_name=f"{cc // 10}.{cc % 10}",
                 compute_capability=cc)


def get_gpu_info() -> GpuInfo:
  """The default device's GpuInfo; a ValueError where it is not a GPU."""
  device = _default_device()
  if not is_gpu_device():
    raise ValueError(f"pallet.triton.get_gpu_info: the default device is "
                     f"{device.platform} ({device.device_kind}), not a GPU")
  version = gpu_version_of(device.device_kind)
  if version is not None:
    return get_gpu_info_from_version(version)
  arch = str(getattr(device, "compute_capability", "") or device.device_kind)
  if arch.startswith("gfx"):
    return GpuInfo(gpu_version=None, arch_name=arch, compute_capability=0)
  try:
    major, minor = arch.split(".")
    return GpuInfo(gpu_version=None, arch_name=arch,
                   compute_capability=int(major) * 10 + int(minor))
  except ValueError:
    raise ValueError(f"pallet.triton.get_gpu_info: cannot tell the architecture of "
                     f"GPU {device.device_kind!r}") from None

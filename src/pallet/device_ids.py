"""`pl.DeviceIdType`: how a remote DMA or semaphore signal names its target device.

Deprecated in JAX (together with the `device_id_type=` parameters); kept so that
kernels passing it still run. MESH ids are coordinates in the device mesh,
LOGICAL ids are flat device indices.
"""
from __future__ import annotations

import enum


class DeviceIdType(enum.Enum):
  MESH = "mesh"
  LOGICAL = "logical"

"""`pltpu.LoweringException`: raised when a backend cannot compile a kernel's body.

Kernels and tests written for JAX catch it around compilation; pallet's backends
derive their own compilation errors from it so that such code keeps working.
"""
from __future__ import annotations


class LoweringException(Exception):
  """A kernel uses something the backend compiling it cannot express."""


LoweringException.__module__ = "pallet.tpu"   # printed as users reach it

"""Checking mode: kernels compiled with checks for out-of-bounds accesses, reads of
uninitialized memory, races between parallel programs and (opt-in) NaN/Inf, int32
overflow, never-written outputs and failed `pl.debug_check`s.

Turned on per call by `interpret=pl.InterpretParams(...)` (Pallas's spelling) or for
the whole program by `PALLET_CHECKS=1`; see docs/checking.md. The pass
(`instrument.py`) rewrites the traced `KernelDescription`, so every backend
compiles the checks in. Unchecked calls never come here.
"""
from pallet.checking.options import CheckOptions, resolve as options
from pallet.checking.run import run

__all__ = ["CheckOptions", "options", "run"]

"""Checking mode: kernels compiled with checks for out-of-bounds accesses, reads of
uninitialized memory, races between parallel programs, in-place aliasing hazards,
never-written outputs, loops that never finish and waits on later programs, and
(opt-in) NaN/Inf, int32 overflow and failed `pl.debug_check`s.

Turned on per call by `interpret=pl.InterpretParams(...)` (Pallas's spelling) or for
the whole program by `PALLET_CHECKS=1`; see docs/checking.md. The pass
(`instrument.py`) rewrites the traced `KernelDescription`, so every backend
compiles the checks in; they report through an output of the kernel (`report.py`).
Unchecked calls never come here.
"""
from pallet.checking.options import CheckOptions, resolve as options
from pallet.checking.run import run

__all__ = ["CheckOptions", "options", "run"]

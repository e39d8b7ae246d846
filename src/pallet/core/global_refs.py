"""`pl.get_global`: a ref that keeps its contents from one kernel launch to the next.

On GPUs this is device memory allocated once per program (used e.g. for
semaphores that several launches share). A pallet launch is a pure XLA
computation whose state ends with it, so there is no such memory: using the
name is a clear error.
"""
from __future__ import annotations

from pallet.core.unsupported import Unsupported

get_global = Unsupported(
    "pl.get_global",
    "a buffer that persists across kernel launches needs device-global memory; a pallet "
    "kernel launch keeps no state after it returns",
    "pass the state in and out of the kernel as an aliased operand "
    "(input_output_aliases) instead")

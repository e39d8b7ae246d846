"""`pltpu.InterpretParams` and the TPU interpret-mode switches.

JAX's TPU interpret mode simulates a TPU on the CPU (memories, DMAs, semaphores,
races). pallet's CPU backend already gives TPU kernels those meanings, so
`pallas_call(..., interpret=InterpretParams(...))` means "run on the CPU backend,
in checking mode" (pallet/checking): `out_of_bounds_reads="raise"` checks every
index, `uninitialized_memory="nan"` poisons fresh memory and reports reads of it,
`detect_races=True` reports programs of parallel grid axes touching the same
element. The fields are accepted with JAX 0.12's names and defaults; the
simulator's other knobs (DMA timing, vector clocks, ...) have no counterpart here.
pallet adds `detect_unwritten_outputs` (output elements no program wrote; on, False
for a call that leaves outputs unwritten on purpose) and opt-in checks: `detect_nans`,
`detect_int_overflow` (int32 add/sub/mul) and `debug_checks` (every failed
`pl.debug_check`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import Any, Callable, Iterator, Literal


class LoggingMode(enum.Flag):
  """Which parts of JAX's interpreter log (accepted, nothing to log here)."""
  BARRIER = enum.auto()
  SEMAPHORE = enum.auto()
  SHARED_MEMORY = enum.auto()


@dataclasses.dataclass(frozen=True, kw_only=True)
class InterpretParams:
  """Parameters of TPU interpret mode; a truthy `interpret=` value for pallas_call."""
  detect_races: bool = False
  on_race: Literal["raise", "warn"] = "raise"
  out_of_bounds_reads: Literal["raise", "uninitialized"] = "raise"
  skip_floating_point_ops: bool = False
  uninitialized_memory: Literal["nan", "zero"] = "nan"
  num_cores_or_threads: int = 1
  vector_clock_size: int | None = None
  logging_mode: LoggingMode | None = None
  dma_execution_mode: Literal["eager", "on_wait"] = "on_wait"
  random_seed: int | None = None
  grid_point_recorder: Callable[..., Any] | None = None
  allow_hbm_allocation_in_run_scoped: bool = False
  buffer_bounds: Literal["logical", "padded"] = "logical"
  # pallet's opt-in checks (not in JAX)
  detect_nans: bool = False
  detect_int_overflow: bool = False
  detect_unwritten_outputs: bool = True   # on unless a call leaves outputs unwritten on purpose
  debug_checks: bool = False
  detect_hangs: bool = True               # loops that never finish, waits on later programs
  max_loop_iterations: int = 1 << 20      # a while loop running longer counts as a hang

  @property
  def num_cores_per_device(self) -> int:
    return self.num_cores_or_threads


@contextlib.contextmanager
def force_tpu_interpret_mode(params: InterpretParams = InterpretParams()) -> Iterator[None]:
  """JAX runs TPU kernels in its interpreter inside this context; pallet runs them on
  its CPU backend anyway (no TPU backend exists), so nothing changes."""
  del params
  yield


def set_tpu_interpret_mode(params: InterpretParams = InterpretParams()) -> None:
  """Global form of `force_tpu_interpret_mode`: nothing to switch in pallet."""
  del params


def reset_tpu_interpret_mode_state() -> None:
  """Clears JAX's simulated shared memory; pallet keeps no state between calls."""

"""The ways a benchmark runs. The CPU suite: jax.numpy, pallet, and the interpret peer.

A variant is a name plus a function turning a Benchmark into an un-jitted program.
pallet and the peer are imported inside the builders, not at module import, so a
broken or missing implementation fails only its own variant.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from pallet.bench.case import Benchmark, Program

REFERENCE = "jnp"


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str
  build: Callable[[Benchmark], Program]
  # Orders of magnitude slower than the rest: timed under runner.PeerPolicy.
  slow_peer: bool = False


def _reference(bench: Benchmark) -> Program:
  return bench.reference


def _pallet_cpu(bench: Benchmark) -> Program:
  import pallet
  import pallet.backends.xla  # noqa: F401 - imported on a first call: not compile time
  import pallet.tpu  # noqa: F401 - kernels with scratch buffers use pl.tpu.VMEM
  # pallet's default backend is the CPU one unless a GPU is present; the CPU suite
  # names it only in that case, so on a CPU machine the call is the plain default.
  kwargs = {} if jax.default_backend() == "cpu" else {"backend": "xla"}
  return bench.build_pallas(pallet, **kwargs)


def _pallas_interpret(bench: Benchmark) -> Program:
  from pallet.bench.peer import peer_pallas
  return bench.build_pallas(peer_pallas(), interpret=True)


JNP = Variant(REFERENCE, _reference)
CPU_VARIANTS: tuple[Variant, ...] = (
    JNP,
    Variant("pallet", _pallet_cpu),
    Variant("interpret", _pallas_interpret, slow_peer=True),
)


def cpu_variant(name: str) -> Variant:
  for v in CPU_VARIANTS:
    if v.name == name:
      return v
  raise ValueError(f"unknown variant {name!r}; expected one of "
                   f"{[v.name for v in CPU_VARIANTS]}")

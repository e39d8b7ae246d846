"""DMAs and semaphores (`pltpu.sync_copy`, `make_async_copy`, `pl.semaphore_*`) as loads
and stores, their semaphores counted while the code is generated.

pallet's meaning of a DMA (docs/semantics.md §16): `.start()` copies at once and adds
the number of copied elements to its semaphore(s); `.wait()` takes them off again. A
copy therefore becomes a load and a store (with barriers, so that every thread of the
program sees what others wrote), and the semaphores need no memory at all where their
counts are known while generating: the generator follows each semaphore (a scratch or
scoped ref, at a static index or one named by a traced value) through the kernel body
and requires every wait to be supplied by signals earlier in the same grid step, in the
same branch or loop iteration. That covers `sync_copy`, a copy started and waited on in
place, several copies counted on one semaphore, and semaphores signalled by static
amounts. A count that differs between the branches of a condition or between loop
iterations, a wait no earlier signal supplies (a copy left for a later grid step:
double buffering across steps), a count left at the end of a step of a grid with
several steps (the next step, maybe another GPU program, would see it), amounts known
only at run time and remote copies are `TritonLoweringError`s naming the line.
"""
from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

from pallet.backends.triton import refs
from pallet.backends.triton.refs import MemoryRef, RegisterRef
from pallet.backends.triton.values import Value, constant
from pallet.errors import TritonLoweringError

# dma_start's operands, as pallet.core.dma flattens them.
_COPY_SLOTS = ("src", "src_t", "dst", "dst_t", "sem", "sem_t", "src_sem", "src_sem_t")
_COPY_PARAMS = {"tree", "add", "shared_sem"}
PRIMITIVES = ("dma_start", "dma_wait", "semaphore_signal", "semaphore_wait", "semaphore_read")
_PAIRING = ("the Triton backend lowers a wait only where signals earlier in the same grid "
            "step, and in the same branch or loop iteration, supply it (a copy started and "
            "waited on in place, sync_copy); waiting for a copy started by an earlier grid "
            "step or loop iteration or under a condition (double buffering across steps)")


class SemaphoreCounts:
  """What each semaphore holds at the point of the program being generated."""

  def __init__(self) -> None:
    self.counts: dict[tuple, int] = {}
    self.labels: dict[tuple, str] = {}
    self.where: dict[tuple, str] = {}     # the last line that changed a count

  def snapshot(self) -> dict[tuple, int]:
    return {k: v for k, v in self.counts.items() if v}

  def restore(self, state: dict[tuple, int]) -> None:
    self.counts = dict(state)

  def describe(self, state: dict[tuple, int]) -> str:
    return ", ".join(f"{self.labels[k]} holds {v}" for k, v in sorted(
        state.items(), key=lambda kv: self.labels[kv[0]])) or "every semaphore at 0"


def operands(eqn: Any, ins: list[Any]) -> dict[str, Any]:
  """dma_start's operands by name (refs, and their transforms as lists)."""
  parts = jax.tree_util.tree_unflatten(eqn.params["tree"], ins)
  if len(parts) != len(_COPY_SLOTS):
    return {}
  return dict(zip(_COPY_SLOTS, parts))


def memory_refs_of_copy(eqn: Any, invars: list[Any]) -> list[Any]:
  """The jaxpr variables of the refs a dma_start reads and writes (not its semaphores)."""
  found = operands(eqn, list(invars))
  return [found[k] for k in ("src", "dst") if k in found]


def _label(gen, ref: Any) -> str:
  m = re.fullmatch(r"scratch(\d+)", ref.name)
  if m:
    gm = gen.kernel.grid_mapping
    slot = len(gm.prefetch_avals) + len(gm.inputs) + len(gm.outputs) + int(m.group(1))
    names = gen.kernel.ref_names
    name = names[slot] if slot < len(names) and names[slot] else ""
    return f"scratch {m.group(1)}" + (f" ('{name}')" if name else "")
  return "a scoped semaphore (pl.run_scoped, sync_copy)"


def _key(gen, sem: Any, transforms: Any) -> tuple:
  """A semaphore's identity: its ref and the index its view selects (static, or the
  name of the traced value; two different names are taken to be different)."""
  if not isinstance(sem, (MemoryRef, RegisterRef)):
    gen.fail("a semaphore that is not a scratch or scoped ref")
  shape, terms = refs.resolve_view(gen, sem.shape, list(transforms or ()))
  if shape or not all(isinstance(t, refs._Fixed) for t in terms):
    gen.fail("a semaphore view that selects more than one semaphore")
  index = tuple(refs._text(t.index) for t in terms)
  identity = sem.var if isinstance(sem, RegisterRef) else sem.pointer
  key = (identity, index)
  gen.semaphores.labels[key] = _label(gen, sem) + (f"[{', '.join(index)}]" if index else "")
  return key


def _size(gen, ref: Any, transforms: Any) -> int:
  shape, _ = refs.resolve_view(gen, ref.shape, list(transforms or ()))
  return int(np.prod(shape, dtype=np.int64))


def _add(gen, key: tuple, amount: int) -> None:
  counts = gen.semaphores
  counts.counts[key] = counts.counts.get(key, 0) + amount
  counts.where[key] = gen.where()


def _take(gen, key: tuple, amount: int, what: str, decrement: bool = True) -> None:
  have = gen.semaphores.counts.get(key, 0)
  if have < amount:
    gen.fail(f"{what} on {gen.semaphores.labels[key]}, which holds {have} at this point: "
             f"{_PAIRING}")
  if decrement:
    gen.semaphores.counts[key] = have - amount
    gen.semaphores.where[key] = gen.where()


def _static_amount(gen, value: Value, what: str) -> int:
  if not (isinstance(value, Value) and value.is_constant):
    gen.fail(f"{what} by an amount known only at run time (the Triton backend counts "
             f"semaphores while generating the kernel, so amounts must be static)")
  return int(value.constant)


def _dma_start(gen, eqn, ins):
  extra = set(eqn.params) - _COPY_PARAMS
  parts = operands(eqn, ins)
  if extra or not parts:
    gen.fail(f"a copy with {sorted(extra) or 'operands'} beyond a local copy between refs "
             f"(remote copies run on the XLA backend)")
  src, dst = parts["src"], parts["dst"]
  for which, ref in (("source", src), ("destination", dst)):
    if not isinstance(ref, MemoryRef):
      gen.fail(f"a copy whose {which} is not a ref in memory")
  # Barriers: the copy's threads read what others stored, and the program's threads
  # then read what the copy stored.
  gen.line("tl.debug_barrier()")
  data = gen._load(src, list(parts["src_t"]), None, None)
  if eqn.params["add"]:
    old = gen._load(dst, list(parts["dst_t"]), None, None)
    data = gen.let(f"{dst.name}_sum", f"{old.expr} + {data.typed}", old.shape, old.dtype)
  gen._store(dst, list(parts["dst_t"]), data, None)
  gen.line("tl.debug_barrier()")
  size = int(np.prod(data.shape, dtype=np.int64))
  if parts["sem"] is not None:
    _add(gen, _key(gen, parts["sem"], parts["sem_t"]), size)
    if eqn.params["shared_sem"]:    # the source semaphore: another view of `sem`
      _add(gen, _key(gen, parts["sem"], parts["src_sem_t"]), size)
  if parts["src_sem"] is not None:
    _add(gen, _key(gen, parts["src_sem"], parts["src_sem_t"]), size)
  return []


def _dma_wait(gen, eqn, ins):
  ref, ref_t, sem, sem_t = jax.tree_util.tree_unflatten(eqn.params["tree"], ins)
  amount = _size(gen, ref, ref_t)
  _take(gen, _key(gen, sem, sem_t), amount, f"a DMA wait for {amount} copied elements")
  return []


def _semaphore_operands(gen, eqn, ins) -> tuple[tuple, Any]:
  if set(eqn.params) - {"tree", "decrement", "message"}:
    gen.fail(f"a semaphore operation with {sorted(set(eqn.params) - {'tree'})} (signalling "
             f"another device or core)")
  n = eqn.params["tree"].num_leaves
  sem, sem_t = jax.tree_util.tree_unflatten(eqn.params["tree"], ins[:n])
  return _key(gen, sem, sem_t), (ins[-1] if len(ins) > n else None)


def _semaphore_signal(gen, eqn, ins):
  key, inc = _semaphore_operands(gen, eqn, ins)
  _add(gen, key, _static_amount(gen, inc, "a semaphore signal"))
  return []


def _semaphore_wait(gen, eqn, ins):
  key, value = _semaphore_operands(gen, eqn, ins)
  amount = _static_amount(gen, value, "a semaphore wait")
  _take(gen, key, amount, f"a semaphore wait for {amount}",
        decrement=eqn.params.get("decrement", True))
  return []


def _semaphore_read(gen, eqn, ins):
  key, _ = _semaphore_operands(gen, eqn, ins)
  # Counts at a run-time index are followed by the value's name; another entry of the
  # same array that holds a count may be the same semaphore at run time.
  for other, count in gen.semaphores.counts.items():
    if count and other != key and other[0] == key[0] and not (
        _static_index(other) and _static_index(key)):
      gen.fail(f"reading {gen.semaphores.labels[key]} while "
               f"{gen.semaphores.labels[other]} holds {count} (with an index known only at "
               f"run time they may be one semaphore, whose count cannot be known while "
               f"generating the kernel)")
  return [constant(gen.semaphores.counts.get(key, 0), np.int32)]


def _static_index(key: tuple) -> bool:
  return all(re.fullmatch(r"-?\d+", i) for i in key[1])


RULES = {"dma_start": _dma_start, "dma_wait": _dma_wait,
         "semaphore_signal": _semaphore_signal, "semaphore_wait": _semaphore_wait,
         "semaphore_read": _semaphore_read}


def branches_agree(gen, eqn: Any, states: list[dict[tuple, int]]) -> None:
  """Every branch of a condition on run-time values must leave the same counts."""
  if any(state != states[0] for state in states):
    _differ(gen, eqn, "between the branches of a condition",
            "; ".join(f"branch {b}: {gen.semaphores.describe(st)}"
                      for b, st in enumerate(states)))


def iteration_keeps_counts(gen, eqn: Any, before: dict[tuple, int],
                           after: dict[tuple, int]) -> None:
  """A loop iteration must leave the counts as it found them (so that every iteration
  sees the same)."""
  if after != before:
    _differ(gen, eqn, "from one loop iteration to the next",
            f"before: {gen.semaphores.describe(before)}; after one iteration: "
            f"{gen.semaphores.describe(after)}")


def _differ(gen, eqn: Any, where: str, states: str) -> None:
  gen.eqn = eqn
  gen.fail(f"semaphore counts that differ {where} ({states}): {_PAIRING}")


def check_step_end(gen) -> None:
  """A grid of several steps must leave no count for the next step: that step may run in
  another GPU program, which would not see it."""
  left = gen.semaphores.snapshot()
  if not left:
    return
  key = sorted(left, key=lambda k: gen.semaphores.labels[k])[0]
  kernel = gen.kernel
  raise TritonLoweringError(
      f"pallet Triton backend: kernel '{kernel.name}' ({kernel.source}): "
      f"{gen.semaphores.labels[key]} holds {left[key]} at the end of a grid step (last "
      f"signalled at {gen.semaphores.where[key]}): a count left for a later grid step to "
      f"wait on (double buffering across grid steps) is not supported by the Triton "
      f"backend, whose grid steps may run as separate GPU programs; wait in the step "
      f"that starts the copy, or run the kernel on the XLA backend (backend=\"xla\")")

"""How a checked call reports a failure: as values, raised on the host after the call.

Checks inside a checked kernel call nothing back. Each records its first failure in
a small int32 row of an extra output, one row per grid step (`RECORD_WIDTH` values:
the failing check's number + 1, or 0, and a detail value). After the call the rows
become one *report*, an int32 vector `[code, detail, *grid indices]` for the first
failing step in grid order (the one a run in grid order meets first); checks made
outside the kernel (never-written outputs, index maps from scalar prefetch) merge
into it. The report is a plain array, so the mechanism is the same on every backend
and on a GPU, and sound under jit, vmap and grad:

* eager calls read it and raise the `KernelCheckError` in Python, once;
* traced calls bind `report_p`, whose implementation raises the same way where
  the value is concrete (eager vmap/grad), and whose lowering (inside `jax.jit`)
  calls back to the host only on a failure. That callback's error reaches the
  caller as JAX's runtime error carrying the report's text when the result is
  materialized, as with `jax.experimental.checkify` run without functionalization;
  JAX's own log line for it is dropped (`_QuietCheckFailures`), so it shows once.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallet import _internals as internals
from pallet.core.checks import CheckInfo, record_failure
from pallet.errors import KernelCheckError

RECORD_WIDTH = 2        # per grid step: [check number + 1 (0: none failed), detail]
NO_DETAIL = -2**31      # a detail value meaning "none"

# (message, info) of each check site, numbered from 0; static (hashable).
Catalog = tuple[tuple[str, CheckInfo], ...]


def clean(grid_rank: int) -> jax.Array:
  """The report of a call where nothing failed."""
  return jnp.zeros((2 + grid_rank,), jnp.int32)


def from_rows(rows: Any, grid: Sequence[int]) -> jax.Array:
  """The report of per-step rows (`grid + (RECORD_WIDTH,)`): the first failing step
  in row-major (grid) order."""
  flat = jnp.reshape(rows, (-1, RECORD_WIDTH))
  failed = flat[:, 0] != 0
  step = jnp.argmax(failed).astype(jnp.int32)
  ids, rest = [], step
  for n in reversed(tuple(grid)):
    ids.insert(0, rest % n)
    rest = rest // n
  row = flat[step]
  return jnp.stack([row[0], row[1], *ids]).astype(jnp.int32)


def single(failed: Any, code: int, detail: Any, ids: Sequence[Any],
           grid_rank: int) -> jax.Array:
  """The report of one check made outside the kernel: check `code` where `failed`."""
  ids = list(ids) + [0] * (grid_rank - len(ids))
  entry = jnp.stack([jnp.asarray(x, jnp.int32).reshape(()) for x in (code, detail, *ids)])
  return jnp.where(failed, entry, clean(grid_rank))


def first(*reports: Any) -> jax.Array:
  """The first of `reports` that failed (they are in the order the checks run)."""
  out = reports[-1]
  for r in reversed(reports[:-1]):
    out = jnp.where(r[0] != 0, r, out)
  return out


def error(report: Any, catalog: Catalog) -> KernelCheckError | None:
  """The KernelCheckError a concrete report stands for (None: nothing failed)."""
  report = np.asarray(report).reshape(-1)
  code = int(report[0])
  if code == 0:
    return None
  message, info = catalog[code - 1]
  detail = int(report[1])
  ids = tuple(int(i) for i in report[2:2 + len(info.grid)])
  return info.error(message, ids, None if detail == NO_DETAIL else detail)


def raise_if_failed(report: Any, catalog: Catalog) -> None:
  """Raises the report's KernelCheckError now, or (traced) where the program runs."""
  if not catalog:
    return
  if internals.is_tracer(report):
    report_p.bind(report, catalog=catalog)
    return
  failure = error(report, catalog)
  if failure is not None:
    raise failure


# ------------------------------------------------------------------ report_p
report_p = Primitive("pallet_check_report")
report_p.multiple_results = True
report_p.def_effectful_abstract_eval(lambda report, *, catalog: ([], {internals.debug_effect}))


def _raise_on_host(report: Any, *, catalog: Catalog) -> None:
  failure = error(report, catalog)
  if failure is not None:
    raise record_failure(failure)


def _impl(report, *, catalog):
  _raise_on_host(report, catalog=catalog)
  return []


report_p.def_impl(_impl)


def _lowered(report, *, catalog):
  lax.cond(report[0] == 0, lambda r: None,
           lambda r: jax.debug.callback(functools.partial(_raise_on_host, catalog=catalog), r),
           report)
  return []


mlir.register_lowering(report_p, mlir.lower_fun(_lowered, multiple_results=True))


def _batch(args, dims, *, catalog):
  (report,), (d,) = args, dims
  report = jnp.moveaxis(report, d, 0)
  failed = report[:, 0] != 0
  report_p.bind(report[jnp.argmax(failed)], catalog=catalog)   # the first failing member
  return [], []


batching.primitive_batchers[report_p] = _batch


def _jvp(primals, tangents, *, catalog):
  report_p.bind(*primals, catalog=catalog)
  return [], []


ad.primitive_jvps[report_p] = _jvp


class _QuietCheckFailures(logging.Filter):
  """JAX logs every exception raised in a host callback before its runtime re-raises
  it; a KernelCheckError reaches the caller anyway (its text is the runtime error's),
  so that log line would show the report twice."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, KernelCheckError)


for _name in ("jax._src.debugging", "jax._src.callback"):
  logging.getLogger(_name).addFilter(_QuietCheckFailures())

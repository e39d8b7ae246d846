"""JAX's errors from inside a kernel body, retold as PalletErrors.

A kernel reads and writes through JAX's own refs, so a mistake there (storing a
value of the wrong dtype or shape, a static slice past the end of a block, a
`pl.ds` whose size is traced) is first seen deep inside JAX, whose message names
neither the kernel nor the parameter nor the user's line. `translate` recognises
those errors while the kernel is being traced and says which kernel, which ref,
what was expected and where.
"""
from __future__ import annotations

import os
import re
import types
from typing import Any, Sequence

from pallet import _internals as internals
from pallet.core import tracebacks
from pallet.errors import PalletError

_DTYPE = re.compile(r"Invalid dtype for `(?P<op>\w+)`\. Ref dtype: (?P<ref>[^.\s]+)\. "
                    r"Value dtype: (?P<value>[^.\s]+)\.")
_SHAPE = re.compile(r"Invalid shape for `(?P<op>\w+)`\. Ref shape: (?P<ref>\([^)]*\))\. "
                    r"Expected shape: (?P<expected>\([^)]*\))\. "
                    r"Value shape: (?P<value>\([^)]*\))\.")
_SLICE = re.compile(r"Out of bound slice: start=(?P<start>-?\d+)(?:, size=(?P<size>\d+), "
                    r"stride=(?P<stride>-?\d+))?, dim=(?P<dim>\d+)")
_INDEX = re.compile(r"Out of bound indexer: idx=(?P<idx>-?\d+), dim=(?P<dim>\d+)")


def _frames(tb: types.TracebackType | None) -> list[tuple[types.FrameType, int]]:
  """(frame, line) of each level of a traceback, innermost first."""
  frames = []
  while tb is not None:
    frames.append((tb.tb_frame, tb.tb_lineno))
    tb = tb.tb_next
  return frames[::-1]


def _user_line(frames) -> str | None:
  for frame, line in frames:
    if tracebacks.is_user_file(frame.f_code.co_filename):
      return f"{os.path.abspath(frame.f_code.co_filename)}:{line}"
  return None


def _is_ref(value: Any) -> bool:
  if isinstance(value, internals.TransformedRef):
    return True
  # kernel refs and buffers made in the kernel are tracers (frames hold other JAX objects
  # that jax.typeof cannot type)
  return internals.is_tracer(value) and isinstance(getattr(value, "aval", None),
                                                   internals.AbstractRef)


def _base(value: Any) -> Any:
  return value.ref if isinstance(value, internals.TransformedRef) else value


def _failing_ref(frames, refs: Sequence[Any], labels: Sequence[str]
                 ) -> tuple[str | None, tuple | None]:
  """(label, shape) of the ref the failing operation was applied to; None where not known."""
  label, ref = _ref_label(frames, refs, labels)
  shape = getattr(getattr(_base(ref), "aval", None), "shape", None)
  return label, (tuple(shape) if shape is not None else None)


def _ref_label(frames, refs: Sequence[Any], labels: Sequence[str]) -> tuple[str | None, Any]:
  """(label, ref) of the ref the failing operation was applied to. The innermost frame
  whose locals hold a ref is JAX's indexing code: a kernel ref (or a view of one) is
  named by its label; another ref (an emit_pipeline block, a run_scoped buffer) by the
  name the user's code gives it."""
  by_id = {id(r): label for r, label in zip(refs, labels)}
  user = next((frame for frame, _ in frames if tracebacks.is_user_file(frame.f_code.co_filename)), None)
  for frame, _ in frames:
    if tracebacks.is_user_file(frame.f_code.co_filename):
      break
    held = [v for v in frame.f_locals.values() if _is_ref(v)]
    if not held:
      continue
    base = _base(held[0])
    if id(base) in by_id:
      return by_id[id(base)], base
    for name, value in (user.f_locals.items() if user is not None else ()):
      if not name.startswith("_") and _is_ref(value) and _base(value) is base:
        return f"ref '{name}'", base
    break
  for frame, _ in frames:
    for value in frame.f_locals.values():
      if id(_base(value)) in by_id:
        return by_id[id(_base(value))], _base(value)
  return None, None


def _parse_shape(text: str) -> tuple[int, ...]:
  """"(8, 128)" -> (8, 128)."""
  return tuple(int(d) for d in re.findall(r"\d+", text))


def translate(error: BaseException, *, kernel: str, source: str, refs: Sequence[Any],
              labels: Sequence[str]) -> PalletError | None:
  """A PalletError telling what `error` (raised tracing kernel `kernel`) means, or
  None for errors this module does not know (they propagate unchanged)."""
  message = str(error)
  frames = _frames(error.__traceback__)
  ref, ref_shape = _failing_ref(frames, refs, labels)
  ref = ref or "a ref"
  line = _user_line(frames) or source
  where = f"kernel '{kernel}' ({source}) at {line}"
  if isinstance(error, ValueError) and (m := _DTYPE.search(message)):
    return PalletError(
        f"{where}: storing a value of dtype {m['value']} into {ref}, whose dtype is "
        f"{m['ref']}; "
        f"expected a {m['ref']} value (convert it with .astype(jnp.{m['ref']}))")
  if isinstance(error, ValueError) and (m := _SHAPE.search(message)):
    hint = ""
    expected, value = _parse_shape(m["expected"]), _parse_shape(m["value"])
    if len(expected) == len(value) and any(e < v for e, v in zip(expected, value)):
      hint = " (a slice reaching past the end of a ref is clipped there, as in NumPy)"
    if m["value"] == "()":
      hint = (" (a scalar does not broadcast into a ref: store "
              f"jnp.full({m['expected']}, value) or jnp.broadcast_to(value, "
              f"{m['expected']}))")
    return PalletError(
        f"{where}: storing a value of shape {m['value']} into {ref} (shape {m['ref']}), "
        f"where the indexed part has shape {m['expected']}; expected a value of shape "
        f"{m['expected']}{hint}")
  if isinstance(error, ValueError) and (m := _SLICE.search(message)):
    extent = (f"start={m['start']}, size={m['size']}, stride={m['stride']}" if m["size"]
              else f"start={m['start']}")
    shape = f" (the ref has shape {ref_shape})" if ref_shape is not None else ""
    return PalletError(
        f"{where}: a static slice of {ref} ({extent}) reaches past the end of a "
        f"dimension of size {m['dim']}{shape}; expected a slice inside the block (for a "
        f"partial last block, read or write with a mask: pl.load/pl.store(..., mask=...))")
  if isinstance(error, ValueError) and (m := _INDEX.search(message)):
    shape = f" (the ref has shape {ref_shape})" if ref_shape is not None else ""
    return PalletError(
        f"{where}: index {m['idx']} of {ref} is past the end of a dimension of size "
        f"{m['dim']}{shape}; expected an index in [0, {m['dim']})")
  if isinstance(error, AssertionError) and message.startswith("DShapedArray"):
    return PalletError(
        f"{where}: {ref} is indexed with pl.ds(start, size) whose size is a traced "
        f"value; expected a static size (a Python int): slice a fixed maximum size and "
        f"mask the lanes past the traced length (pl.load(ref, pl.ds(start, MAX), "
        f"mask=jnp.arange(MAX) < n)); DMAs (pltpu.make_async_copy) take a traced size")
  return None

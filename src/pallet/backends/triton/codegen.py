"""Kernel description -> the Python source of one `@triton.jit` function.

The generated function takes one pointer per scalar-prefetch operand, input
and output (and a workspace pointer when scratch must live in memory, and a
pointer to one int32 flag per run-time check, `pl.debug_check`, which a
failing check sets for the launcher to report). Its body:

  1. decodes the program id into the parallel grid indices (`schedule.py`) and
     loads the grid sizes computed at run time,
  2. loops over the parallel axes of run-time size, taking every so many indices,
  3. loads resident output blocks kept in registers (`refs.RegisterRef`),
  4. loops over the sequential grid axes; each step evaluates the index maps
     (block offsets) and runs the kernel body, one line per jaxpr equation,
     each group preceded by a comment naming the kernel source line,
  5. stores the register-resident outputs.

Array operations are written by `ops.py`, DMAs and semaphores by `dmas.py`; this
module handles refs, control flow (cond -> if, while -> while, fori_loop/scan and
while loops that count up to a fixed bound -> for) and the frame.
"""
from __future__ import annotations

import contextlib
import dataclasses
import linecache
import math
import os
import re
from typing import Any, Iterator, Sequence

import numpy as np

from pallet import _internals as internals
from pallet.backends.triton import dmas, ops, refs
from pallet.backends.triton.refs import ArrayDim, MemoryRef, RegisterRef
from pallet.backends.triton.schedule import Schedule, block_start_range, make_schedule
from pallet.backends.triton.values import (Value, constant, padded, python_literal, signature_dtype,
                                           tl_dtype)
from pallet.errors import TritonLoweringError
from pallet.core.checks import CheckMessage
from pallet.core.grid_mapping import BlockMapping
from pallet.core.tracing import KernelDescription

_CALL_PRIMITIVES = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint",
                    "custom_lin")
_REF_PRIMITIVES = ("get", "swap", "addupdate", "masked_load", "masked_store",
                   "atomic_rmw", "atomic_cas")


@dataclasses.dataclass(frozen=True)
class GeneratedKernel:
  """The generated source and what a launcher needs to call it."""
  source: str
  function_name: str
  parameters: tuple[str, ...]
  signature: dict[str, str]           # parameter -> Triton type ("*fp32")
  constants: tuple[np.ndarray, ...]   # arrays the kernel closes over, passed after the inputs
  written_inputs: tuple[int, ...]     # inputs the kernel stores to, not aliased to an output:
                                      # launchers pass copies (and once more, last)
  workspace_bytes: int                # per program; 0 when there is no workspace
  check_messages: tuple[str, ...]     # one int32 flag each, zeroed before the launch
  schedule: Schedule
  kernel: KernelDescription
  default_num_warps: int              # when the compiler params give none
  # (compute capability, what needs it): the oldest CUDA GPU Triton compiles this for
  cuda_requirement: tuple[int, str] | None = None

  @property
  def launch_grid(self) -> tuple[int, int, int]:
    return (self.schedule.num_programs, 1, 1)


def _is_var(v: Any) -> bool:
  return not hasattr(v, "val")


def _sub_jaxpr(params: dict) -> tuple[Any, tuple]:
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    if key in params:
      j = params[key]
      return (j.jaxpr, tuple(j.consts)) if hasattr(j, "consts") else (j, ())
  raise KeyError("no inner jaxpr")


# ------------------------------------------------------------------ ref analysis
def _whole_access_only(jaxpr: Any, keys: dict[Any, Any], bad: set, reads: set) -> None:
  """Adds to `bad` every ref (by key) that is accessed other than whole, and to
  `reads` every ref whose contents the kernel may read."""
  used = {v for e in jaxpr.eqns for v in e.invars if _is_var(v)}
  used |= {v for v in jaxpr.outvars if _is_var(v)}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    ref_args = [(i, keys[v]) for i, v in enumerate(eqn.invars)
                if _is_var(v) and v in keys]
    if name in ("new_ref", "empty_ref"):
      keys[eqn.outvars[0]] = eqn.outvars[0]
    elif name in ("get", "swap", "addupdate"):
      first = 1 if name == "get" else 2
      leaves = eqn.invars[first:]
      transforms = refs.unflatten_transforms(eqn.params["tree"], list(leaves))
      shape = eqn.invars[0].aval.shape
      if leaves or not refs.is_whole(transforms, shape):
        bad.add(keys.get(eqn.invars[0]))
      if name != "swap" or eqn.outvars[0] in used:
        reads.add(keys.get(eqn.invars[0]))
    elif name == "cond":
      for branch in eqn.params["branches"]:
        sub = dict(keys)
        sub.update({bv: keys[v] for bv, v in zip(branch.jaxpr.invars, eqn.invars[1:])
                    if _is_var(v) and v in keys})
        _whole_access_only(branch.jaxpr, sub, bad, reads)
    elif name == "while":
      nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
      carry = eqn.invars[nc + nb:]
      for j, ins in ((eqn.params["cond_jaxpr"], eqn.invars[:nc] + carry),
                     (eqn.params["body_jaxpr"], eqn.invars[nc:nc + nb] + carry)):
        jj = j.jaxpr if hasattr(j, "jaxpr") else j
        sub = dict(keys)
        sub.update({bv: keys[v] for bv, v in zip(jj.invars, ins) if _is_var(v) and v in keys})
        _whole_access_only(jj, sub, bad, reads)
    elif name == "dma_start":      # copies read and write memory; semaphores are counted
      for v in dmas.memory_refs_of_copy(eqn, eqn.invars):
        if _is_var(v) and v in keys:
          bad.add(keys[v])
          reads.add(keys[v])
    elif name in dmas.PRIMITIVES:
      pass
    elif name == "scan" or name in _CALL_PRIMITIVES:
      inner = internals.scan_layout(eqn.params)[0] if name == "scan" else \
          _sub_jaxpr(eqn.params)[0]
      sub = dict(keys)
      sub.update({bv: keys[v] for bv, v in zip(inner.invars, eqn.invars)
                  if _is_var(v) and v in keys})
      _whole_access_only(inner, sub, bad, reads)
    else:
      bad.update(k for _, k in ref_args)
      reads.update(k for _, k in ref_args)


# ------------------------------------------------------------------ the generator
class KernelGenerator:
  """Writes one kernel's Triton source; `ops` rules call back into it."""

  def __init__(self, kernel: KernelDescription):
    self.kernel = kernel
    self.lines: list[str] = []
    self.depth = 1
    self.counter = 0
    self.helpers: set[str] = set()
    self.cuda_requirement: tuple[int, str] | None = None
    self.workspace_bytes = 0
    self.eqn: Any = None
    self.enclosing: list[Any] = []   # call equations (jit, ...) whose body is being run
    self.last_source: tuple[str, int] | None = None
    self.promoted: set[Any] = set()
    self.constants: list[np.ndarray] = []
    self.largest_tensor = 1
    self.input_pointers: dict[str, int] = {}
    self.written_inputs: set[int] = set()
    self.check_messages: list[str] = []
    self.semaphores = dmas.SemaphoreCounts()

  # -- emission ---------------------------------------------------------------
  def line(self, text: str) -> None:
    self.lines.append("    " * self.depth + text)

  @contextlib.contextmanager
  def block(self, header: str) -> Iterator[None]:
    self.line(header)
    self.depth += 1
    start = len(self.lines)
    try:
      yield
    finally:
      if len(self.lines) == start:
        self.line("pass")
      self.depth -= 1

  def fresh(self, prefix: str) -> str:
    self.counter += 1
    prefix = re.sub(r"\W", "_", prefix).strip("_") or "v"
    return f"{prefix}_{self.counter}"

  def let(self, prefix: str, expr: str, shape: Sequence[int], dtype: Any) -> Value:
    name = self.fresh(prefix)
    self.line(f"{name} = {expr}")
    value = Value(name, tuple(shape), np.dtype(dtype))
    self.largest_tensor = max(self.largest_tensor, math.prod(value.tensor_shape))
    return value

  def assign(self, target: str, value: Value) -> None:
    self.line(f"{target} = {value.typed}")

  def require_helper(self, name: str) -> None:
    self.helpers.add(name)

  def require_cuda_capability(self, capability: int, what: str) -> None:
    """Notes that on CUDA the kernel compiles only for `capability` (89: sm_89) and up."""
    if self.cuda_requirement is None or capability > self.cuda_requirement[0]:
      self.cuda_requirement = (capability, what)

  def where(self) -> str:
    # Inside a call (jnp.sort is a jit) only the call equation knows the user's line.
    for eqn in (self.eqn, *reversed(self.enclosing)):
      src = internals.equation_source(eqn) if eqn is not None else None
      if src:
        return f"{src[0]}:{src[1]}"
    return self.kernel.source

  def fail(self, what: str, *, xla_runs_it: bool = True) -> None:
    """Refuses the equation being generated; `xla_runs_it=False` where the XLA backend
    refuses it too (the message would otherwise point there)."""
    prim = self.eqn.primitive.name if self.eqn is not None else "kernel"
    elsewhere = ""
    if xla_runs_it and self.eqn is not None and internals.runs_on_cpu(self.eqn.primitive):
      elsewhere = "; the XLA backend runs it (backend=\"xla\", the default without a GPU)"
    raise TritonLoweringError(
        f"pallet Triton backend: kernel '{self.kernel.name}' ({self.kernel.source}) at "
        f"{self.where()}: primitive '{prim}': {what} is not supported by the Triton "
        f"backend{elsewhere}")

  def mask_padding(self, v: Value, axes: Sequence[int], identity: str) -> Value:
    """`v` with the power-of-two padding along `axes` replaced by `identity`."""
    checks = [f"({refs._arange(v.shape[a], len(v.shape), a)} < {v.shape[a]})"
              for a in axes if padded((v.shape[a],))[0] != v.shape[a]]
    if not checks:
      return v
    return self.let("unpadded", f"tl.where({' & '.join(checks)}, {v.typed}, {identity})",
                    v.shape, v.dtype)

  def _comment_source(self, eqn: Any) -> None:
    src = internals.equation_source(eqn)
    if src is None or src == self.last_source:
      return
    self.last_source = src
    text = linecache.getline(src[0], src[1]).strip()
    self.line(f"# {os.path.basename(src[0])}:{src[1]}: {text}".rstrip())

  # -- jaxpr evaluation ---------------------------------------------------------
  def read(self, env: dict, v: Any) -> Any:
    if not _is_var(v):
      return constant(np.asarray(v.val).item(), v.aval.dtype, tuple(v.aval.shape)) \
          if np.ndim(v.val) == 0 else self._array_constant(v.val)
    return env[v]

  def _array_constant(self, val: Any) -> Value:
    arr = np.asarray(val)
    if arr.size and np.all(arr == arr.reshape(-1)[0]):
      return constant(arr.reshape(-1)[0].item(), arr.dtype, arr.shape)
    # Triton has no array literals: the array becomes one more kernel argument.
    k = len(self.constants)
    self.constants.append(arr)
    name = f"const{k}"
    strides = _row_major_strides(arr.shape)
    ref = MemoryRef(name, f"{name}_ptr", [ArrayDim(0, s, n, False, False, True)
                                          for s, n in zip(strides, arr.shape)],
                    arr.dtype, tuple(arr.shape))
    return self._load(ref, [], None, None)

  def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}
    for v, c in zip(jaxpr.constvars, consts):
      env[v] = self._const_value(c)
    for v, a in zip(jaxpr.invars, args):
      env[v] = a
    used = {v for e in jaxpr.eqns for v in e.invars if _is_var(v)}
    used |= {v for v in jaxpr.outvars if _is_var(v)}
    for eqn in jaxpr.eqns:
      self.eqn = eqn
      self._comment_source(eqn)
      ins = [self.read(env, v) for v in eqn.invars]
      outs = self.equation(eqn, ins, [v in used for v in eqn.outvars])
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
    return [self.read(env, v) for v in jaxpr.outvars]

  def _const_value(self, c: Any) -> Value:
    arr = np.asarray(c)
    if arr.ndim == 0:
      return constant(arr.item(), arr.dtype)
    return self._array_constant(arr)

  def equation(self, eqn: Any, ins: list[Any], used: list[bool]) -> list[Any]:
    name = eqn.primitive.name
    if name in _REF_PRIMITIVES:
      return getattr(self, f"_ref_{name}")(eqn, ins, used)
    if name in ("cond", "while", "scan", "new_ref", "empty_ref", "multiple_of",
                "max_contiguous", "debug_print", "debug_barrier", "pallet_check"):
      return getattr(self, f"_{name}")(eqn, ins)
    if name in _CALL_PRIMITIVES:
      jaxpr, consts = _sub_jaxpr(eqn.params)
      self.enclosing.append(eqn)
      try:
        return self.run(jaxpr, consts, ins)
      finally:
        self.enclosing.pop()
    if name in dmas.RULES:
      return dmas.RULES[name](self, eqn, ins)
    rule = ops.RULES.get(name)
    if rule is None:
      self.fail("this primitive")
    if ins and all(isinstance(v, Value) and v.is_constant and not v.shape for v in ins) \
        and len(eqn.outvars) == 1 and not eqn.outvars[0].aval.shape:
      return [self._fold(eqn, ins)]
    for v in ins:
      if isinstance(v, (MemoryRef, RegisterRef)):
        self.fail("a ref as an operand")
    outs = rule(self, eqn, *ins)
    return outs

  def _fold(self, eqn: Any, ins: list[Value]) -> Value:
    """Scalar arithmetic on constants, computed now (index math on static numbers)."""
    import jax
    with jax.ensure_compile_time_eval():
      out = eqn.primitive.bind(*[np.asarray(v.constant, v.dtype) for v in ins], **eqn.params)
    aval = eqn.outvars[0].aval
    return constant(np.asarray(out).item(), aval.dtype)

  # -- refs --------------------------------------------------------------------
  def _transforms(self, eqn, ins, first):
    return refs.unflatten_transforms(eqn.params["tree"], ins[first:first + eqn.params["tree"].num_leaves])

  def _ref_get(self, eqn, ins, used):
    ref = ins[0]
    if isinstance(ref, RegisterRef):
      return [ref.value]
    return [self._load(ref, self._transforms(eqn, ins, 1), None, None)]

  def _load(self, ref: MemoryRef, transforms, mask: Value | None, other: Value | None) -> Value:
    pointer, structural, shape = refs.address(self, ref, transforms, ref.name)
    masks = [m for m in (structural, mask.typed if mask is not None else None) if m]
    args = ""
    if masks:
      # (Triton cannot cast an integer 0 to float8: those are filled with 0.0)
      fill = other.typed if other is not None else \
          "0.0" if ref.dtype.name.startswith("float8") else "0"
      args = f", mask={' & '.join(masks)}, other={fill}"
    return self.let(f"{ref.name}_load", f"tl.load({pointer}{args})", shape, ref.dtype)

  def _note_write(self, ref: MemoryRef) -> None:
    if ref.pointer in self.input_pointers:
      self.written_inputs.add(self.input_pointers[ref.pointer])

  def _store(self, ref: MemoryRef, transforms, value: Value, mask: Value | None) -> None:
    self._note_write(ref)
    pointer, structural, shape = refs.address(self, ref, transforms, ref.name, writes=True)
    masks = [m for m in (structural, mask.typed if mask is not None else None) if m]
    val = value.typed if value.shape == shape and not value.is_constant else \
        f"tl.broadcast_to({value.typed}, {list(padded(shape))})" if shape else value.typed
    args = f", mask={' & '.join(masks)}" if masks else ""
    self.line(f"tl.store({pointer}, {val}{args})")

  def _ref_swap(self, eqn, ins, used):
    ref, value = ins[0], ins[1]
    if isinstance(ref, RegisterRef):
      old = ref.value
      if used[0]:
        old = self.let(f"{ref.name}_old", ref.var, ref.shape, ref.dtype)
      self.assign(ref.var, self._full(value, ref.shape, ref.dtype))
      return [old]
    transforms = self._transforms(eqn, ins, 2)
    old = self._load(ref, transforms, None, None) if used[0] else None
    self._store(ref, transforms, value, None)
    return [old]

  def _full(self, value: Value, shape, dtype) -> Value:
    if value.is_constant:
      return constant(value.constant, dtype, tuple(shape))
    return value

  def _ref_addupdate(self, eqn, ins, used):
    ref, value = ins[0], ins[1]
    if isinstance(ref, RegisterRef):
      self.line(f"{ref.var} = {ref.var} + {value.typed}")
      return []
    transforms = self._transforms(eqn, ins, 2)
    old = self._load(ref, transforms, None, None)
    new = self.let(f"{ref.name}_sum", f"{old.expr} + {value.typed}", old.shape, old.dtype)
    self._store(ref, transforms, new, None)
    return []

  def _memory(self, ref: Any) -> MemoryRef:
    if isinstance(ref, RegisterRef):
      self.fail("a register-resident ref used with masks or atomics")
    return ref

  def _ref_masked_load(self, eqn, ins, used):
    ref = self._memory(ins[0])
    n = eqn.params["tree"].num_leaves
    transforms = self._transforms(eqn, ins, 1)
    extra = ins[1 + n:]
    mask, other = extra[0], (extra[1] if eqn.params["has_other"] else None)
    return [self._load(ref, transforms, mask, other)]

  def _ref_masked_store(self, eqn, ins, used):
    ref = self._memory(ins[0])
    n = eqn.params["tree"].num_leaves
    transforms = self._transforms(eqn, ins, 1)
    value, mask = ins[1 + n], ins[2 + n]
    self._store(ref, transforms, value, mask)
    return []

  def _ref_atomic_rmw(self, eqn, ins, used):
    ref = self._memory(ins[0])
    self._note_write(ref)
    n = eqn.params["tree"].num_leaves
    transforms = self._transforms(eqn, ins, 1)
    extra = ins[1 + n:]
    value = extra[0]
    mask = extra[1] if eqn.params["has_mask"] else None
    pointer, structural, shape = refs.address(self, ref, transforms, ref.name, writes=True)
    masks = [m for m in (structural, mask.typed if mask is not None else None) if m]
    args = f", mask={' & '.join(masks)}" if masks else ""
    val = value.typed
    op = eqn.params["op"]
    element = tl_dtype(ref.dtype)
    if op == "xchg" and element in ("tl.float32", "tl.float64"):
      # Triton's interpreter has no float exchange; an exchange moves bits, so exchanging
      # them as integers of the same width is the same operation on every target.
      bits = f"tl.int{element[-2:]}"
      swapped = (f"tl.atomic_xchg(({pointer}).to(tl.pointer_type({bits})), "
                 f"{val}.to({bits}, bitcast=True){args})")
      return [self.let("atomic_xchg", f"{swapped}.to({element}, bitcast=True)", shape,
                       ref.dtype)]
    return [self.let(f"atomic_{op}", f"tl.atomic_{op}({pointer}, {val}{args})", shape,
                     ref.dtype)]

  def _ref_atomic_cas(self, eqn, ins, used):
    ref = self._memory(ins[0])
    self._note_write(ref)
    n = eqn.params["tree"].num_leaves
    transforms = self._transforms(eqn, ins, 1)
    cmp, value = ins[1 + n], ins[2 + n]
    pointer, structural, shape = refs.address(self, ref, transforms, ref.name)
    if structural:
      self.fail("atomic_cas on a view that needs masking (Triton's atomic_cas has no mask)")
    return [self.let("atomic_cas", f"tl.atomic_cas({pointer}, {cmp.typed}, {value.typed})",
                     shape, ref.dtype)]

  def _new_ref(self, eqn, ins):
    (init,) = ins
    shape, dtype = tuple(init.shape), init.dtype
    if eqn.outvars[0] in self.promoted:
      var = self.fresh("scoped")
      self.assign(var, self._full(init, shape, dtype))
      return [RegisterRef("scoped", var, shape, dtype)]
    ref = self.workspace_ref(self.fresh("scoped"), shape, dtype)
    self._store(ref, [], init, None)
    return [ref]

  def _empty_ref(self, eqn, ins):
    """`jax.empty_ref(ty)`: a fresh ref whose contents are unspecified until written (zeros
    where it lives in registers, whatever the workspace holds otherwise)."""
    aval = eqn.outvars[0].aval.inner_aval
    shape, dtype = tuple(aval.shape), np.dtype(aval.dtype)
    if eqn.outvars[0] in self.promoted:
      var = self.fresh("scoped")
      self.line(f"{var} = {refs.zeros_like_ref(shape, dtype)}")
      return [RegisterRef("scoped", var, shape, dtype)]
    return [self.workspace_ref(self.fresh("scoped"), shape, dtype)]

  def workspace_ref(self, name: str, shape: tuple[int, ...], dtype: Any) -> MemoryRef:
    """A per-program buffer in the workspace (scratch that cannot live in registers)."""
    dtype = np.dtype(dtype)
    offset = -(-self.workspace_bytes // 16) * 16
    self.workspace_bytes = offset + max(1, math.prod(shape)) * dtype.itemsize
    pointer = self.let(f"{name}_ptr", f"(workspace_ptr + (pid * WORKSPACE_BYTES + {offset}))"
                       f".to(tl.pointer_type({tl_dtype(dtype)}))", (), np.int64).expr
    strides = _row_major_strides(shape)
    dims = [ArrayDim(0, s, n, False, False, True) for s, n in zip(strides, shape)]
    return MemoryRef(name, pointer, dims, dtype, shape)

  # -- hints and printing ---------------------------------------------------------
  def _multiple_of(self, eqn, ins):
    (x,) = ins
    values = list(eqn.params["values"])
    if x.is_constant:
      return [x]
    return [self.let("multiple_of", f"tl.multiple_of({x.expr}, {values if len(values) > 1 else values[0]})", x.shape, x.dtype)]

  def _max_contiguous(self, eqn, ins):
    (x,) = ins
    values = list(eqn.params["values"])
    if x.is_constant:
      return [x]
    return [self.let("max_contiguous", f"tl.max_contiguous({x.expr}, {values if len(values) > 1 else values[0]})", x.shape, x.dtype)]

  def _debug_print(self, eqn, ins):
    prefix = eqn.params["fmt"].replace("{}", "").strip()
    args = "".join(f", {v.typed}" for v in ins)
    self.line(f"tl.device_print({prefix!r}{args})")
    return []

  def _debug_barrier(self, eqn, ins):
    self.line("tl.debug_barrier()")
    return []

  def _pallet_check(self, eqn, ins):
    """A run-time check: where `ok` is False anywhere, set this check's flag (the
    launcher raises with its message after the kernel ran). A checking-mode check
    (with a CheckInfo) keeps the first failing grid step: the flag is the maximum of
    2**31 - 1 - (row-major step index) over failing programs."""
    ok, payload = ins[0], ins[1:]
    if ok.is_constant and ok.constant:
      return []
    info = eqn.params.get("info")
    k = len(self.check_messages)
    self.check_messages.append(CheckMessage(eqn.params["message"], info))
    mark = "tl.store(checks_ptr + {k}, 1)".format(k=k)
    if info is not None:
      strides = [math.prod(info.grid[a + 1:]) for a in range(len(info.grid))]
      step = " + ".join(f"{v.typed} * {s}" for v, s in zip(payload[:-1], strides)) or "0"
      mark = f"tl.atomic_max(checks_ptr + {k}, 2147483647 - ({step}))"
    if ok.is_constant:
      self.line(mark)
      return []
    flag = ok
    if ok.shape:
      ok = self.mask_padding(ok, range(len(ok.shape)), "True")
      flat = math.prod(ok.tensor_shape)
      flag = self.let("check_ok", f"tl.min(tl.reshape({ok.typed}.to(tl.int32), [{flat}]), "
                      f"axis=0)", (), np.int32)
    with self.block(f"if {flag.typed} == 0:"):
      self.line(mark)
    return []

  # -- control flow ----------------------------------------------------------------
  def _bind_outputs(self, names: list[str], values: list[Any]) -> None:
    for n, v in zip(names, values):
      self.line(f"{n} = {v.typed}")

  def _cond(self, eqn, ins):
    index, operands = ins[0], ins[1:]
    branches = eqn.params["branches"]
    if index.is_constant:
      b = branches[int(np.clip(index.constant, 0, len(branches) - 1))]
      return self.run(b.jaxpr, b.consts, operands)
    names = [self.fresh("cond_out") for _ in eqn.outvars]
    outs = [Value(n, tuple(v.aval.shape), np.dtype(v.aval.dtype))
            for n, v in zip(names, eqn.outvars)]
    order = list(range(len(branches) - 1, -1, -1)) if len(branches) == 2 else \
        list(range(len(branches)))
    before, counts = self.semaphores.snapshot(), []
    for k, b in enumerate(order):
      self.semaphores.restore(before)
      if len(branches) == 2:
        header = f"if {index.typed} != 0:" if k == 0 else "else:"
      else:
        header = (f"if {index.typed} <= {b}:" if k == 0 else
                  "else:" if k == len(order) - 1 else f"elif {index.typed} <= {b}:")
      mark = len(self.lines)
      with self.block(header):
        branch = branches[b]
        self.last_source = None
        results = self.run(branch.jaxpr, branch.consts, operands)
        self._bind_outputs(names, [self._full(r, o.shape, o.dtype) for r, o in zip(results, outs)])
      counts.append(self.semaphores.snapshot())
      if header == "else:" and self.lines[mark + 1:] == ["    " * (self.depth + 1) + "pass"]:
        del self.lines[mark:]     # an empty else branch (pl.when)
    dmas.branches_agree(self, eqn, counts)
    return outs

  def _carry_vars(self, prefix: str, values: list[Value], avals: list[Any]) -> list[Value]:
    out = []
    for v, aval in zip(values, avals):
      name = self.fresh(prefix)
      val = self._full(v, tuple(aval.shape), np.dtype(aval.dtype))
      self.line(f"{name} = {val.typed}")
      out.append(Value(name, tuple(aval.shape), np.dtype(aval.dtype)))
    return out

  def _while(self, eqn, ins):
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cj, bj = eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]
    cond_jaxpr, cond_consts = (cj.jaxpr, cj.consts) if hasattr(cj, "jaxpr") else (cj, ())
    body_jaxpr, body_consts = (bj.jaxpr, bj.consts) if hasattr(bj, "jaxpr") else (bj, ())
    cconsts, bconsts, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
    counted = _counted_loop(cond_jaxpr, body_jaxpr, nc, nb)
    if counted is not None:
      return self._counted_while(eqn, body_jaxpr, body_consts, bconsts, init, *counted)
    carry = self._carry_vars("carry", init, [v.aval for v in eqn.outvars])
    go = self.fresh("keep_going")
    (first,) = self.run(cond_jaxpr, cond_consts, [*cconsts, *carry])
    self.line(f"{go} = {first.typed}")
    before = self.semaphores.snapshot()
    with self.block(f"while {go}:"):
      self.last_source = None
      new = self.run(body_jaxpr, body_consts, [*bconsts, *carry])
      self._bind_outputs([c.expr for c in carry],
                         [self._full(n, c.shape, c.dtype) for n, c in zip(new, carry)])
      (again,) = self.run(cond_jaxpr, cond_consts, [*cconsts, *carry])
      self.line(f"{go} = {again.typed}")
    dmas.iteration_keeps_counts(self, eqn, before, self.semaphores.snapshot())
    return carry

  def _counted_while(self, eqn, body_jaxpr, body_consts, bconsts, init, index: int,
                     bound: int) -> list[Value]:
    """A while loop that counts `index` up to the loop-invariant `bound` (fori_loop
    with a traced trip count) as a `for` over a range. Triton compiles that to
    scf.for, which it optimises better than scf.while: causal flash attention's
    key loop spills 64 bytes of registers on sm_80 as a while loop, none as a for."""
    avals = [v.aval for v in eqn.outvars]
    # Copies, so that the body cannot change them (an init may name a register ref).
    start, end = (v if v.is_constant else self.let(f"loop_{what}", v.expr, (), np.int32)
                  for v, what in ((init[index], "start"), (init[bound], "end")))
    others = [k for k in range(len(init)) if k not in (index, bound)]
    carry = dict(zip(others, self._carry_vars("carry", [init[k] for k in others],
                                              [avals[k] for k in others])))
    step = self.fresh("step")
    carry[bound] = end
    before = self.semaphores.snapshot()
    with self.block(f"for {step} in range({_range_bound(start)}, {_range_bound(end)}):"):
      # (Triton's interpreter counts in Python ints: the index made a tensor.)
      carry[index] = self.let("index", f"tl.cast({step}, tl.int32)", (), np.int32)
      inner = [carry[k] for k in range(len(init))]
      self.last_source = None
      new = self.run(body_jaxpr, body_consts, [*bconsts, *inner])
      self._bind_outputs([carry[k].expr for k in others],
                         [self._full(new[k], carry[k].shape, carry[k].dtype) for k in others])
    dmas.iteration_keeps_counts(self, eqn, before, self.semaphores.snapshot())
    # After `while i < n: i += 1`, i is max(i0, n) (dead code unless the kernel reads it).
    carry[index] = self.let("final_index", f"tl.maximum({start.typed}, {end.typed})", (),
                            avals[index].dtype)
    return [carry[k] for k in range(len(init))]

  def _scan(self, eqn, ins):
    jaxpr, consts, n_consts, n_carry = internals.scan_layout(eqn.params)
    if len(ins) != n_consts + n_carry or len(eqn.outvars) != n_carry:
      self.fail("scan over arrays (xs/ys); only loops with a carry (fori_loop) are")
    length, reverse = eqn.params["length"], eqn.params["reverse"]
    carry = self._carry_vars("carry", ins[n_consts:], [v.aval for v in eqn.outvars])
    step = self.fresh("step")
    before = self.semaphores.snapshot()
    with self.block(f"for {step} in range({length}):"):
      self.last_source = None
      new = self.run(jaxpr, consts, [*ins[:n_consts], *carry])
      self._bind_outputs([c.expr for c in carry],
                         [self._full(n, c.shape, c.dtype) for n, c in zip(new, carry)])
    dmas.iteration_keeps_counts(self, eqn, before, self.semaphores.snapshot())
    del reverse  # the body reads no xs, so the direction does not matter
    return carry


def _counted_loop(cond_jaxpr: Any, body_jaxpr: Any, nc: int, nb: int) -> tuple[int, int] | None:
  """(index, bound) carry positions when a while loop is `while i < n: i += 1` with
  `n` carried unchanged (how fori_loop lowers a traced trip count), else None."""
  if len(cond_jaxpr.eqns) != 1:
    return None
  (test,) = cond_jaxpr.eqns
  carry_in = list(cond_jaxpr.invars[nc:])
  if (test.primitive.name != "lt" or test.outvars[0] is not cond_jaxpr.outvars[0]
      or not all(_is_var(v) and v in carry_in for v in test.invars)):
    return None
  index, bound = (carry_in.index(v) for v in test.invars)
  body_in, body_out = list(body_jaxpr.invars[nb:]), list(body_jaxpr.outvars)
  if index == bound or body_out[bound] is not body_in[bound]:
    return None
  if body_in[index].aval.shape or body_in[index].aval.dtype != np.int32:
    return None                       # Triton's range counts in int32
  increments = [e for e in body_jaxpr.eqns
                if e.primitive.name == "add" and e.outvars[0] is body_out[index]]
  if len(increments) != 1:
    return None
  a, b = increments[0].invars
  if not any(x is body_in[index] and _is_one(y) for x, y in ((a, b), (b, a))):
    return None
  return index, bound


def _is_one(v: Any) -> bool:
  return not _is_var(v) and np.ndim(v.val) == 0 and v.val == 1


def _range_bound(v: Value) -> str:
  return python_literal(v.constant, v.dtype) if v.is_constant else v.expr


def _row_major_strides(shape: Sequence[int]) -> list[int]:
  strides, acc = [], 1
  for n in reversed(shape):
    strides.append(acc)
    acc *= n
  return strides[::-1]


# ------------------------------------------------------------------ the frame
def _identifier(name: str) -> str:
  name = re.sub(r"\W", "_", name)
  return name if name and not name[0].isdigit() else f"k_{name}"


def _param_names(kernel: KernelDescription) -> list[str]:
  gm = kernel.grid_mapping
  names = [f"grid_size{a}" for a in gm.dynamic_axes]
  for i, _ in enumerate(gm.prefetch_avals):
    names.append(f"prefetch{i}")
  for kind, blocks in (("in", gm.inputs), ("out", gm.outputs)):
    for i, b in enumerate(blocks):
      m = re.search(r"\('(\w+)'\)", b.origin)
      base = m.group(1) if m else f"{kind}{i}"
      names.append(base)
  seen: dict[str, int] = {}
  unique = []
  for n in names:
    n = _identifier(n)
    if n in seen or n in ("pid", "workspace", "checks", "tl", "triton", "libdevice"):
      seen[n] = seen.get(n, 0) + 1
      n = f"{n}_{seen[n]}"
    seen.setdefault(n, 0)
    unique.append(n)
  return unique


def _block_ref(gen: KernelGenerator, name: str, pointer: str, b: BlockMapping,
               starts: list[Value | int], ranges: list[tuple[int, int]] | None) -> MemoryRef:
  """A block as a MemoryRef. Edges are masked unless the block provably stays
  inside the array at every grid step (`ranges`, from schedule.block_start_range):
  reads past the edge give zeros and writes there are dropped, never landing in
  other memory."""
  strides = _row_major_strides(b.array_shape)
  dims = []
  for d, (dim, n, s, st) in enumerate(zip(b.dims, b.array_shape, starts, strides)):
    if ranges is None:
      low = dim.kind == "element"
      high = True
    else:
      lo, hi = ranges[d]
      low, high = lo < 0, hi + dim.size > n
    if b.whole:
      low, high = False, False
    dims.append(ArrayDim(s, st, n, low, high, dim.kind != "squeezed"))
  return MemoryRef(name, pointer, dims, np.dtype(b.dtype), b.kernel_shape)


def _block_starts(gen: KernelGenerator, b: BlockMapping, name: str, ids: list[Value],
                  prefetch: list[MemoryRef]) -> list[Value | int]:
  im = b.index_map
  gen.eqn = None
  indices = gen.run(im.jaxpr, im.consts, [*ids, *prefetch])
  starts = []
  for d, (dim, idx) in enumerate(zip(b.dims, indices)):
    # Element offsets count in the array padded by Element(n, padding=(lo, hi)).
    scale, shift = (1, dim.padding[0]) if dim.kind == "element" else (dim.size, 0)
    if idx.is_constant:
      starts.append(int(idx.constant) * scale - shift)
    elif scale == 1 and not shift:
      starts.append(idx)
    else:
      expr = idx.typed if scale == 1 else f"{idx.typed} * {scale}"
      expr = f"{expr} - {shift}" if shift else expr
      starts.append(gen.let(f"{name}_start{d}", expr, (), np.int32))
  return starts


def generate(kernel: KernelDescription) -> GeneratedKernel:
  """The Triton source for `kernel` (see the module docstring for its layout)."""
  gm = kernel.grid_mapping
  schedule = make_schedule(kernel)
  gen = KernelGenerator(kernel)
  # Parameters: grid sizes computed at run time, scalar prefetch, inputs, outputs.
  n_dyn = len(gm.dynamic_axes)
  params = _param_names(kernel)
  size_ptrs = [f"{p}_ptr" for p in params[:n_dyn]]
  params = params[n_dyn:]
  n_pre, n_in, n_out = len(gm.prefetch_avals), len(gm.inputs), len(gm.outputs)
  ptrs = [f"{p}_ptr" for p in params]
  gen.input_pointers = {p: j for j, p in enumerate(ptrs[n_pre:n_pre + n_in])}
  pre_names, in_names, out_names = params[:n_pre], params[n_pre:n_pre + n_in], params[n_pre + n_in:]
  jaxpr = kernel.jaxpr.jaxpr
  g = len(gm.grid)
  ref_invars = jaxpr.invars[g + n_dyn:]
  out_invars = ref_invars[n_pre + n_in:n_pre + n_in + n_out]
  scratch_invars = ref_invars[n_pre + n_in + n_out:]

  # Which refs can live in registers: only ever accessed whole.
  bad: set = set()
  reads: set = set()
  keys = {v: v for v in ref_invars}
  _whole_access_only(jaxpr, keys, bad, reads)
  aliased = {o for _, o in kernel.input_output_aliases}

  def initial_block(i: int, mem: MemoryRef) -> str:
    """What a register-resident output starts as: its memory contents, unless
    the kernel never reads them (then nothing needs loading)."""
    if out_invars[i] in reads or i in aliased:
      return gen._load(mem, [], None, None).expr
    return refs.zeros_like_ref(mem.shape, mem.dtype)

  promoted_outputs = [v not in bad for v in out_invars]
  gen.promoted = {v for v in keys if v not in bad}

  # 1. program id -> parallel grid indices.
  gen.line(f"# {schedule.describe()}")
  for reason in schedule.reasons:
    gen.line(f"#   {reason}")
  gen.line("pid = tl.program_id(0)")
  ids: list[Value] = [None] * g  # type: ignore
  # sizes computed at run time, by axis
  sizes = {a: gen.let(f"n{a}", f"tl.load({ptr})", (), np.int32)
           for a, ptr in zip(gm.dynamic_axes, size_ptrs)}
  strided = dict(schedule.strided)
  lanes: dict[int, Value] = {}    # a program's first index along a strided axis
  stride = 1
  for a in reversed(schedule.parallel):
    size = schedule.programs_along(a)
    expr = "pid" if stride == 1 else f"(pid // {stride})"
    if stride * size < schedule.num_programs:
      expr = f"{expr} % {size}"
    if a in strided:
      lanes[a] = gen.let(f"lane{a}", expr, (), np.int32) if size > 1 else constant(0, np.int32)
    else:
      ids[a] = gen.let(f"i{a}", expr, (), np.int32)
    stride *= size
  for a in schedule.sequential:
    if gm.grid[a] is not None and gm.grid[a] <= 1:
      ids[a] = constant(0, np.int32)

  prefetch = [MemoryRef(n, p, [ArrayDim(0, s, k, False, False, True) for s, k in
                               zip(_row_major_strides(a.shape), a.shape)],
                        np.dtype(a.dtype), tuple(a.shape))
              for n, p, a in zip(pre_names, ptrs[:n_pre], gm.prefetch_avals)]

  # 2. scratch and resident outputs that live in registers.
  scratch_refs: list[Any] = []
  for i, (v, aval) in enumerate(zip(scratch_invars, gm.scratch_avals)):
    shape = tuple(aval.shape)
    if v in gen.promoted:
      var = f"scratch{i}"
      gen.line(f"{var} = {refs.zeros_like_ref(shape, aval.dtype)}")
      scratch_refs.append(RegisterRef(f"scratch{i}", var, shape, np.dtype(aval.dtype)))
    else:
      scratch_refs.append(gen.workspace_ref(f"scratch{i}", shape, aval.dtype))

  has_prefetch = bool(gm.prefetch_avals)

  def output_block(i, step_ids):
    b = gm.outputs[i]
    starts = _block_starts(gen, b, out_names[i], step_ids, prefetch)
    return _block_ref(gen, out_names[i], ptrs[n_pre + n_in + i], b, starts,
                      block_start_range(b, gm.grid, has_prefetch))

  # 3. a parallel axis of run-time size: this program takes every
  # programs_along(a)-th index, starting at its lane (see schedule.py).
  with contextlib.ExitStack() as programs:
    for a, n in schedule.strided:
      programs.enter_context(gen.block(
          f"for i{a} in range({_range_bound(lanes[a])}, {sizes[a].expr}, {n}):  "
          f"# grid axis {a} (parallel, size at run time)"))
      ids[a] = gen.let(f"i{a}", f"tl.cast(i{a}, tl.int32)", (), np.int32)
    hoisted: dict[int, tuple[MemoryRef, RegisterRef]] = {}
    zero_ids = [ids[a] if a in schedule.parallel or ids[a] is not None else constant(0, np.int32)
                for a in range(g)]
    for i in range(n_out):
      if promoted_outputs[i] and schedule.resident_outputs[i]:
        mem = output_block(i, zero_ids)
        reg = RegisterRef(out_names[i], f"{out_names[i]}_block", mem.shape, mem.dtype)
        gen.line(f"{reg.var} = {initial_block(i, mem)}")
        hoisted[i] = (mem, reg)

    # 4. the sequential loops and the kernel body.
    loops = [a for a in schedule.sequential if gm.grid[a] is None or gm.grid[a] > 1]
    with contextlib.ExitStack() as stack:
      for a in loops:
        trips = gm.grid[a] if gm.grid[a] is not None else sizes[a].expr
        stack.enter_context(gen.block(f"for i{a} in range({trips}):  # grid axis {a} (sequential)"))
        # (Triton's interpreter counts in Python ints: the index made a tensor.)
        ids[a] = gen.let(f"i{a}", f"tl.cast(i{a}, tl.int32)", (), np.int32)
      gen.line("# block offsets of this grid step")
      in_refs = []
      for j, b in enumerate(gm.inputs):
        starts = _block_starts(gen, b, in_names[j], ids, prefetch)
        in_refs.append(_block_ref(gen, in_names[j], ptrs[n_pre + j], b, starts,
                                  block_start_range(b, gm.grid, has_prefetch)))
      out_refs: list[Any] = []
      per_step: list[tuple[MemoryRef, RegisterRef]] = []
      for i in range(n_out):
        if i in hoisted:
          out_refs.append(hoisted[i][1])
          continue
        mem = output_block(i, ids)
        if promoted_outputs[i]:
          reg = RegisterRef(out_names[i], f"{out_names[i]}_block", mem.shape, mem.dtype)
          gen.line(f"{reg.var} = {initial_block(i, mem)}")
          per_step.append((mem, reg))
          out_refs.append(reg)
        else:
          out_refs.append(mem)
      gen.line(f"# kernel body ({kernel.source})")
      gen.last_source = None
      gen.run(jaxpr, kernel.jaxpr.consts, [*ids, *sizes.values(), *prefetch, *in_refs,
                                           *out_refs, *scratch_refs])
      gen.eqn = None
      if None in gm.grid or math.prod(gm.grid) > 1:
        dmas.check_step_end(gen)
      for mem, reg in per_step:
        gen._store(mem, [], reg.value, None)
    for i, (mem, reg) in sorted(hoisted.items()):
      gen._store(mem, [], reg.value, None)

  # Assemble the module.
  fn_name = _identifier(kernel.name)
  # Operands first, then results, as XLA hands buffers to the custom call: grid sizes
  # computed at run time, prefetch, inputs, closed-over constants, outputs, workspace,
  # check flags.
  const_ptrs = [f"const{k}_ptr" for k in range(len(gen.constants))]
  parameters = size_ptrs + ptrs[:n_pre + n_in] + const_ptrs + ptrs[n_pre + n_in:]
  dtypes = dict(zip(ptrs, [*gm.prefetch_avals, *gm.inputs, *gm.outputs]))
  dtypes.update(zip(const_ptrs, gen.constants))
  dtypes.update((p, np.zeros((), np.int32)) for p in size_ptrs)
  signature = {p: "*" + signature_dtype(dtypes[p].dtype) for p in parameters}
  if gen.workspace_bytes:
    parameters.append("workspace_ptr")
    signature["workspace_ptr"] = "*i8"
  if gen.check_messages:
    parameters.append("checks_ptr")
    signature["checks_ptr"] = "*i32"
  aliased_inputs = {i for i, _ in kernel.input_output_aliases}
  for j in sorted(gen.written_inputs - aliased_inputs):
    # The launcher's private copy of an input the kernel writes to (the same
    # buffer as the input's pointer; listed so parameters match XLA's buffers).
    name = f"{in_names[j]}_copy_ptr"
    parameters.append(name)
    signature[name] = signature[ptrs[n_pre + j]]
  workspace = -(-gen.workspace_bytes // 16) * 16
  header = [
      "@triton.jit",
      f"def {fn_name}({', '.join(parameters)}):",
      f'    """pallet kernel \'{kernel.name}\' ({kernel.source}), grid {gm.grid}."""',
  ]
  module = ["# Generated by pallet's Triton backend from the kernel at "
            f"{kernel.source}.", "import triton", "import triton.language as tl",
            "from triton.language.extra import libdevice", ""]
  if workspace:
    module += ["# Bytes of per-program workspace (scratch that lives in global memory).",
               f"WORKSPACE_BYTES = tl.constexpr({workspace})"]
  module += ["", ""]
  for h in sorted(gen.helpers):
    module += [ops.HELPERS[h], ""]
  source = "\n".join(module + header + gen.lines) + "\n"
  if any(t.endswith("fp8e4nv") for t in signature.values()):
    gen.require_cuda_capability(89, "holds float8_e4m3fn values")
  return GeneratedKernel(source, fn_name, tuple(parameters), signature,
                         tuple(gen.constants),
                         tuple(sorted(gen.written_inputs - aliased_inputs)), workspace,
                         tuple(gen.check_messages),
                         schedule, kernel,
                         default_num_warps(gen.largest_tensor), gen.cuda_requirement)


def default_num_warps(largest_tensor: int) -> int:
  """Enough warps that the largest tensor spreads to about 64 values per thread
  (more would spill registers), between Triton's usual 4 and 16."""
  warps = 4
  while warps < 16 and largest_tensor > warps * 32 * 64:
    warps *= 2
  return warps

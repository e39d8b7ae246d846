"""The instrumentation pass: a kernel description in, a checked one out.

The kernel's jaxpr is re-traced equation by equation (control flow re-built with
`lax.cond`/`scan`/`while_loop`, so refs stay closed over as in user code) and a
check is inserted before every access it can get wrong. A failing check records
itself (its number in the catalog, and a detail value) in this grid step's row of
the failure record, an extra output; nothing calls back while the kernel runs
(report.py turns the rows into the call's error).

* bounds: each index of each load, store, atomic, gather and dynamic slice;
* shadows: an int32 array per output, scratch or `run_scoped` buffer that needs one
  (see `checking/run.py`) records who wrote each element: 0 (or anything out of
  range, such as poison or garbage) "never written", `1 + p` "stored by parallel
  program p", `1 + P + p` "atomically updated by p", `2P + 1` "given by the caller"
  (aliased outputs). Reads check "written" (uninitialized) and "not by another
  program" (race); stores check "not by another program"; P counts the programs of
  the parallel grid axes, p is the program's index among them;
* alias shadows (aliased operands seen whole): the grid step + 1 that last wrote
  each element of the output, checked by reads of the input (aliasing.py);
* block padding carried through values (padding.py), merge writes (merges.py),
  while loops watched for progress and bounded (loops.py), semaphore and DMA waits
  that cannot be satisfied.

Output shadows are extra outputs with the output's block mapping, each aliased to
an extra (whole-array) input holding its initial value; scratch shadows are extra
scratch buffers (fresh scratch holds poison or zeros: "never written"). The caller
(`checking/run.py`) supplies the initial values and checks the outputs.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

from pallet import _internals as internals
from pallet.core import checks
from pallet.core import primitives
from pallet.core import dynamic_views, ref_views
from pallet.checking import bounds, loops, merges, padding, report
from pallet.checking.options import CheckOptions
from pallet.core.grid_mapping import BlockDimension, BlockMapping
from pallet.core.tracing import KernelDescription

_CALLS = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
          "custom_vjp_call_jaxpr", "remat", "checkpoint")
_READS = ("get", "masked_load", "addupdate", "atomic_rmw", "atomic_cas")
_ELEMENTWISE_INT = ("add", "sub", "mul")
_NOT_PRODUCERS = ("get", "swap", "masked_load", "atomic_rmw", "atomic_cas", "new_ref",
                  "cond", "scan", "while", "pallet_check") + _CALLS


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the checked kernel's extra operands are, for the caller."""
  shadowed_outputs: tuple[int, ...]   # original output indices with a shadow, in order
  shadow_initial: tuple[int, ...]     # each shadow's initial value (0 or `given`)
  given: int                          # shadow value "given by the caller" (2P + 1)
  shared: int                         # shadow value "atomically updated by several"
  output_names: tuple[str, ...]
  catalog: report.Catalog = ()        # the kernel's checks, numbered as the record holds them
  record: bool = False                # the last output is the failure record
  record_has_ids: bool = False        # ... one row with the grid indices (dynamic grids)
  alias_outputs: tuple[int, ...] = () # after the shadows: outputs with an alias shadow (0)


@dataclasses.dataclass
class _Ref:
  name: str
  shadow: Any = None       # the shadow ref, or None
  scratch: bool = False    # a scratch buffer (persists across grid steps)
  plain_stores: dict = dataclasses.field(default_factory=dict)   # line -> store equation
  alias_reads: Any = None   # aliased input seen whole: who wrote each element (step + 1)
  alias_writes: Any = None  # ... and its output, which stamps it
  aliased_to: str = ""
  sending: Any = None      # which DMA (by its semaphore) still copies from each element


def ref_names(kernel: KernelDescription, param_names: Sequence[str] | None) -> list[str]:
  """A name per kernel ref (prefetch, inputs, outputs, scratch), the parameter's where
  the kernel's signature gives one."""
  gm = kernel.grid_mapping
  n = len(gm.prefetch_avals) + len(gm.inputs) + len(gm.outputs) + len(gm.scratch_avals)
  fallback = ([f"scalar prefetch {i}" for i in range(len(gm.prefetch_avals))]
              + [_origin_name(b.origin) for b in gm.inputs]
              + [_origin_name(b.origin) for b in gm.outputs]
              + [f"scratch {i}" for i in range(len(gm.scratch_avals))])
  # The traced description knows which parameter each flat ref is (a `None` argument
  # or a pytree of refs shifts the signature's names against the flat refs).
  if len(kernel.ref_names) >= n:
    return [name or other for name, other in zip(kernel.ref_names[:n], fallback)]
  names = list(param_names or [])
  if len(names) >= n:
    return names[:n]
  return fallback


def _origin_name(origin: str) -> str:
  """"input 1 ('y_ref')" -> "y_ref"."""
  if "('" in origin:
    return origin.split("('", 1)[1].split("')", 1)[0]
  return origin


# ------------------------------------------------------------------ which refs are read
def _literal(v: Any) -> bool:
  return isinstance(v, Literal) or hasattr(v, "val")


def _dropped(v: Any) -> bool:
  return type(v).__name__ == "DropVar"


def _used(jaxpr: Any) -> set:
  """Variables some equation or the result of `jaxpr` reads."""
  used = {v for v in jaxpr.outvars if not _literal(v)}
  for eqn in jaxpr.eqns:
    used.update(v for v in eqn.invars if not _literal(v))
  return used


def _sub_jaxprs(eqn: Any) -> list[tuple[Any, list]] | None:
  """(open jaxpr, the eqn's operands its inputs stand for) for control flow pallet
  re-traces; None for other primitives."""
  name, params = eqn.primitive.name, eqn.params
  ins = list(eqn.invars)
  if name == "cond":
    return [(b.jaxpr, ins[1:]) for b in params["branches"]]
  if name == "scan":
    jaxpr, _, _, _ = internals.scan_layout(params)
    return [(jaxpr, ins)]
  if name == "while":
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    return [(params["cond_jaxpr"].jaxpr, ins[:nc] + ins[nc + nb:]),
            (params["body_jaxpr"].jaxpr, ins[nc:])]
  if name in _CALLS:
    inner = _call_jaxpr(params)
    return None if inner is None else [(inner[0], ins)]
  return None


def _sub_jaxprs_mapped(eqn: Any, refs: dict[Any, int]) -> list[tuple[Any, list]] | None:
  subs = _sub_jaxprs(eqn)
  if subs is None:
    return None
  return [(j, [refs.get(v) if not _literal(v) else None for v in args])
          for j, args in subs]


def _call_jaxpr(params: dict) -> tuple[Any, tuple] | None:
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    j = params.get(key)
    if j is None:
      continue
    if hasattr(j, "consts"):
      return j.jaxpr, tuple(j.consts)
    if hasattr(j, "eqns"):
      return j, ()
  return None


def read_refs(kernel: KernelDescription) -> set[int]:
  """Positions (among the jaxpr's inputs) of the refs the kernel may read."""
  jaxpr = kernel.jaxpr.jaxpr
  out: set[int] = set()
  refs = {v: i for i, v in enumerate(jaxpr.invars)}
  _walk_reads(jaxpr, refs, out)
  return out


def _walk_reads(jaxpr: Any, refs: dict[Any, int], out: set[int]) -> None:
  used = _used(jaxpr)
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    operands = [refs.get(v) if not _literal(v) else None
                for v in eqn.invars]
    if name in ("swap", "masked_store"):
      if name == "swap" and operands[0] is not None and eqn.outvars[0] in used:
        out.add(operands[0])
      continue
    subs = _sub_jaxprs_mapped(eqn, refs)
    if subs is None:
      out.update(p for p in operands if p is not None)
      continue
    for sub, args in subs:
      _walk_reads(sub, {v: p for v, p in zip(sub.invars, args) if p is not None}, out)


def _dma_sources(kernel: KernelDescription) -> tuple[tuple[int, ...], bool]:
  """The scratch buffers (by position among the scratch) that a local DMA copies from,
  and whether it copies from a buffer the kernel allocates (`pl.run_scoped`)."""
  jaxpr, gm = kernel.jaxpr.jaxpr, kernel.grid_mapping
  first_scratch = len(jaxpr.invars) - len(gm.scratch_avals)
  found: set[int] = set()
  _walk_dma_sources(jaxpr, {v: i for i, v in enumerate(jaxpr.invars)}, found)
  return tuple(sorted(i - first_scratch for i in found if i >= first_scratch)), -1 in found


def _walk_dma_sources(jaxpr: Any, refs: dict[Any, int], out: set[int]) -> None:
  """Adds to `out` the positions (in `refs`) of the refs local DMAs copy from, -1 for
  refs made by `new_ref` in the kernel."""
  refs = {**refs, **{eqn.outvars[0]: -1 for eqn in jaxpr.eqns
                     if eqn.primitive.name == "new_ref"}}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dma_start" and not _literal(eqn.invars[0]) \
        and eqn.invars[0] in refs:
      out.add(refs[eqn.invars[0]])
    for sub, args in _sub_jaxprs_mapped(eqn, refs) or ():
      _walk_dma_sources(sub, {v: p for v, p in zip(sub.invars, args) if p is not None}, out)


def mixes_atomics(kernel: KernelDescription) -> bool:
  """Whether some ref is both updated atomically and stored into plainly."""
  jaxpr = kernel.jaxpr.jaxpr
  atomic: set[int] = set()
  plain: set[int] = set()
  _walk_updates(jaxpr, {v: i for i, v in enumerate(jaxpr.invars)}, atomic, plain)
  return bool(atomic & plain)


def _walk_updates(jaxpr: Any, refs: dict[Any, int], atomic: set, plain: set) -> None:
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    target = refs.get(eqn.invars[0]) if eqn.invars and not _literal(eqn.invars[0]) else None
    if name in ("atomic_rmw", "atomic_cas") and target is not None:
      atomic.add(target)
    elif name in ("swap", "masked_store", "addupdate") and target is not None:
      plain.add(target)
    subs = _sub_jaxprs_mapped(eqn, refs)
    for sub, args in subs or ():
      _walk_updates(sub, {v: p for v, p in zip(sub.invars, args) if p is not None},
                    atomic, plain)


# ------------------------------------------------------------------ the pass
def _poison_fill(eqn_in: Any, producers: dict[Any, Any]) -> bool:
  """Whether a new_ref's initial value is the poison of fresh memory (run_scoped,
  pl.empty under checking mode): a broadcast of NaN, the integer minimum or True."""
  eqn = None if _literal(eqn_in) else producers.get(eqn_in)
  if eqn is None or eqn.primitive.name != "broadcast_in_dim":
    return False
  src = eqn.invars[0]
  if not isinstance(src, Literal):
    return False
  value = np.asarray(src.val)
  if np.issubdtype(value.dtype, np.floating):
    return bool(np.isnan(value))
  if np.issubdtype(value.dtype, np.integer):
    return int(value) == np.iinfo(value.dtype).min
  return value.dtype == np.bool_ and bool(value)


def _scoped_name(eqn: Any) -> str:
  """The `run_scoped` body's parameter a buffer is for (pl.run_scoped names its
  allocations with a named scope `pallet_scoped.<name>`)."""
  stack = str(eqn.source_info.name_stack)
  for part in reversed(stack.split("/")):
    if part.startswith("pallet_scoped."):
      return part[len("pallet_scoped."):]
  return "run_scoped buffer"


class _Instrumenter:
  """Re-traces one kernel body with checks (see the module docstring)."""

  def __init__(self, kernel: KernelDescription, opts: CheckOptions, names: list[str],
               parallel: tuple[int, ...], guard: bool, concurrent: bool = False):
    self.kernel, self.opts, self.names, self.parallel = kernel, opts, names, parallel
    self.guard = guard   # make out-of-bounds accesses skip (Triton reads raw memory)
    self.concurrent = concurrent   # programs run at once (a GPU): others may change memory
    gm = kernel.grid_mapping
    self.grid = gm.grid
    self.num_parallel = max(1, math.prod(gm.grid[a] or 1 for a in parallel))
    self.given = 2 * self.num_parallel + 1
    self.in_flight = self.given + 1   # a DMA destination before its wait
    self.shared = self.given + 2      # atomically updated by several programs
    self.refs: dict[int, _Ref] = {}
    self.taints: dict[int, tuple[Any, padding.Taint]] = {}   # id(value) -> (value, taint)
    self.extents: dict[int, list] = {}                        # id(ref) -> extents
    self.outputs: set[int] = set()                            # id(output ref)
    self.quiet = 0      # > 0 inside while-loop conditions (no effects allowed there)
    self.call_line: str | None = None
    self.catalog: list[tuple[str, checks.CheckInfo]] = []
    self.alias_pairs: tuple = ()
    self.merges: dict[int, merges.MergeWrite] = {}   # id(equation) -> its merge write
    self.merge_masks: dict[int, Any] = {}            # id(select_n) -> lanes it writes anew
    self._lanes: Any = None   # (transforms, mask, lanes in bounds) of the last masked access
    self.semaphores: dict[int, int] = {}   # id(semaphore ref) -> its number
    self.sending_scratch: tuple[int, ...] = ()   # scratch buffers DMAs copy from
    self.sends_from_scoped_buffers = False       # ... and `run_scoped` buffers
    self.record: Any = None           # this step's row of the failure record
    self.record_has_ids = False       # one row for the whole grid (sizes known at run time)

  # -- helpers ------------------------------------------------------------------
  def line(self, eqn: Any) -> str:
    if self.call_line:    # inside a jitted function the user called (jnp.take, ...)
      return self.call_line
    src = internals.equation_source(eqn)
    return f"{src[0]}:{src[1]}" if src else self.kernel.source

  def check(self, eqn: Any, kind: str, ok: Any, message: str, ref: str | None,
            detail: Any = None, detail_label: str = "") -> None:
    """Inserts one check: fails with (kind, ref, line, grid index) where `ok` is False."""
    if self.quiet:
      return
    if not internals.is_tracer(ok) and bool(np.all(np.asarray(ok))):
      return
    info = checks.CheckInfo(kind=kind, kernel=self.kernel.name, ref=ref, line=self.line(eqn),
                            grid=tuple(self.grid), detail=detail_label)
    self.fail_where(~jnp.all(ok), message, info, detail)

  def fail_where(self, failed: Any, message: str, info: checks.CheckInfo,
                 detail: Any = None) -> None:
    """Records check number k (its message and info go to the catalog) in this grid
    step's row of the record, unless an earlier check of the step failed already."""
    self.catalog.append((message, info))
    code = jnp.int32(len(self.catalog))
    detail = jnp.int32(report.NO_DETAIL) if detail is None else jnp.asarray(detail, jnp.int32)
    entry = [code, jnp.reshape(detail, ())]
    if self.record_has_ids:
      entry += [jnp.asarray(i, jnp.int32) for i in self.ids]
    row = self.record[...]
    fire = jnp.asarray(failed, jnp.bool_) & (row[0] == 0)
    self.record[...] = jnp.where(fire, jnp.stack(entry), row)

  def info(self, ref: Any) -> _Ref | None:
    return self.refs.get(id(ref))

  # -- the kernel -------------------------------------------------------------------
  def body(self, layout_counts: tuple[int, ...], *args: Any) -> list:
    gm = self.kernel.grid_mapping
    (n_ids, n_pre, n_in, n_shadow, n_record_in, n_out, n_record, n_scratch,
     n_sscratch, n_sending) = layout_counts
    it = iter(args)
    take = lambda n: [next(it) for _ in range(n)]
    ids, pre, ins, _, _, outs, out_shadows, records, scratch, scratch_shadows, sending = (
        take(n_ids), take(n_pre), take(n_in), take(n_shadow), take(n_record_in), take(n_out),
        take(n_shadow), take(n_record), take(n_scratch), take(n_sscratch), take(n_sending))
    self.ids = ids[:len(gm.grid)]
    if records:
      self.record = records[0]
      self.record_has_ids = None in gm.grid
      if not self.record_has_ids:   # each step starts its own row
        self.record[...] = jnp.zeros((report.RECORD_WIDTH,), jnp.int32)
    else:   # a trial trace: are there checks at all?
      self.record = jax.new_ref(jnp.zeros((report.RECORD_WIDTH,), jnp.int32))
    self.stamp, self.atomic_stamp = self._stamps()
    self.flat_step = jnp.int32(0)
    if None not in gm.grid:
      for a, n in enumerate(gm.grid):
        self.flat_step = self.flat_step * jnp.int32(n) + self.ids[a]
    refs = pre + ins + outs + scratch
    for r, name in zip(refs, self.names):
      self.refs[id(r)] = _Ref(name)
    if self.opts.uninitialized:
      for r, mapping in zip(ins + outs, gm.inputs + gm.outputs):
        extents = padding.block_extents(mapping, self.ids, pre)
        if extents is not None:
          self.extents[id(r)] = extents
      self.outputs = {id(r) for r in outs}
    for k, o in enumerate(self.shadowed_outputs):
      self.refs[id(outs[o])].shadow = out_shadows[k]
    for k, (i, o) in enumerate(self.alias_pairs):
      alias = out_shadows[len(self.shadowed_outputs) + k]
      self.refs[id(ins[i])].alias_reads = alias
      self.refs[id(outs[o])].alias_writes = alias
      self.refs[id(ins[i])].aliased_to = self.names[n_pre + n_in + o]
    for k, s in enumerate(self.shadowed_scratch):
      self.refs[id(scratch[s])].shadow = scratch_shadows[k]
      self.refs[id(scratch[s])].scratch = True
    for k, s in enumerate(self.sending_scratch):
      self.refs[id(scratch[s])].sending = sending[k]
    self.eval(self.kernel.jaxpr.jaxpr, self.kernel.jaxpr.consts, [*ids, *refs])
    return []

  def _stamps(self) -> tuple[Any, Any]:
    par = jnp.int32(0)
    for a in self.parallel:
      par = par * jnp.int32(self.grid[a]) + self.ids[a]
    return 1 + par, 1 + self.num_parallel + par

  # -- evaluation -------------------------------------------------------------------
  def eval(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list:
    env: dict[Any, Any] = {}
    producers: dict[Any, Any] = {}
    used = _used(jaxpr)

    def read(v):
      return v.val if _literal(v) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
      env[v] = x
    for v, x in zip(jaxpr.invars, args):
      env[v] = x
    self.merges.update(merges.find(jaxpr))
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      self.used = used
      with internals.equation_context(eqn):
        outs = self.equation(eqn, ins, producers)
      if not eqn.primitive.multiple_results:
        outs = [outs]
      for v, x in zip(eqn.outvars, outs):
        if not _dropped(v):
          env[v] = x
          producers[v] = eqn
    return [read(v) for v in jaxpr.outvars]

  def bind(self, eqn: Any, ins: Sequence[Any]) -> Any:
    outs = internals.bind_equation(eqn, ins, source=False)   # the caller set the context
    return outs if eqn.primitive.multiple_results else outs[0]

  def equation(self, eqn: Any, ins: list, producers: dict) -> Any:
    name = eqn.primitive.name
    merge = self.merges.get(id(eqn))
    if merge is not None and eqn is merge.select:   # the lanes the merge writes anew
      pred = jnp.asarray(ins[merge.pred])
      anew = (pred != merge.case) if pred.dtype != jnp.bool_ else (
          pred if merge.case == 0 else ~pred)
      self.merge_masks[id(eqn)] = jnp.broadcast_to(anew, eqn.outvars[0].aval.shape)
    handler = getattr(self, f"_{name}", None)
    if handler is not None:
      return handler(eqn, ins, producers)
    subs = _sub_jaxprs(eqn)
    if name in _CALLS and subs is not None:
      inner, consts = _call_jaxpr(eqn.params)
      outer, self.call_line = self.call_line, self.call_line or self.line(eqn)
      try:
        outs = self.eval(inner, consts, ins)
      finally:
        self.call_line = outer
      return outs if eqn.primitive.multiple_results else outs[0]
    if self.opts.bounds and name in ("gather", "dynamic_slice", "dynamic_update_slice"):
      self._array_bounds(eqn, ins)
    outs = self.bind(eqn, ins)
    self._padding(eqn, ins, outs)
    for x in ins:     # refs used by primitives pallet does not follow: written, maybe
      r = self.info(x)
      if r is not None and r.shadow is not None and name not in _READS:
        r.shadow[...] = jnp.full(r.shadow.shape, self.given, jnp.int32)
    self._produced(eqn, ins, outs)
    return outs

  # -- edge-block padding ----------------------------------------------------------
  def _taint(self, x: Any) -> padding.Taint | None:
    entry = self.taints.get(id(x))
    return entry[1] if entry is not None and entry[0] is x else None

  def _padding(self, eqn: Any, ins: list, outs: Any) -> None:
    if not self.taints or self.quiet:
      return
    taints = [self._taint(x) for x in ins]
    if not any(t is not None for t in taints):
      return
    results = list(outs) if eqn.primitive.multiple_results else [outs]
    new, ok, ref = padding.propagate(eqn, ins, results, taints)
    if ok is not None:
      self.check(eqn, "uninitialized", ok,
                 f"{eqn.primitive.name} mixes the block padding of '{ref}' (lanes outside "
                 f"the array, past an edge or in a pl.Element window's padding, whose "
                 f"contents are unspecified) into lanes that hold data; mask them first "
                 f"(jnp.where on the element positions)", ref)
    for x, t in zip(results, new):
      if t is not None:
        self.taints[id(x)] = (x, t)

  def _loaded(self, ref: Any, transforms: tuple, value: Any, mask: Any = None) -> None:
    extents = self.extents.get(id(ref))
    if extents is None or self.quiet or id(ref) in self.outputs:
      return
    outside = padding.loaded(extents, transforms, jnp.shape(value))
    if outside is None:
      return
    garbage = outside if mask is None else outside & mask
    self.taints[id(value)] = (value, padding.Taint(garbage, outside, self.info(ref).name))

  def _stored(self, eqn: Any, ref: Any, transforms: tuple, value: Any,
              mask: Any = None) -> None:
    """Padding stored into an output where its array holds data reaches the result."""
    taint = self._taint(value)
    if taint is None or self.quiet or id(ref) not in self.outputs:
      return
    extents = self.extents.get(id(ref))
    outside = None if extents is None else padding.loaded(extents, transforms, jnp.shape(value))
    if extents is not None and outside is None:
      return
    bad = jnp.broadcast_to(taint.garbage, jnp.shape(value))
    if outside is not None:
      bad = bad & ~outside
    if mask is not None:
      bad = bad & mask
    self.check(eqn, "uninitialized", ~bad,
               f"stores the block padding of '{taint.ref}' (lanes outside its array, past "
               f"an edge or in a pl.Element window's padding, whose contents are "
               f"unspecified) into '{self.info(ref).name}' where its array holds data",
               taint.ref)

  # -- produced values: NaN/Inf and int32 overflow (opt-in) -----------------------
  def _produced(self, eqn: Any, ins: list, outs: Any) -> None:
    name = eqn.primitive.name
    if name in _NOT_PRODUCERS or self.quiet:
      return
    results = outs if eqn.primitive.multiple_results else [outs]
    if self.opts.nans:
      for out in results:
        if hasattr(out, "dtype") and jnp.issubdtype(out.dtype, jnp.inexact):
          ok = jnp.isfinite(out)
          for x in ins:   # NaN or Inf coming in is not produced here
            if hasattr(x, "dtype") and jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact):
              x = jnp.asarray(x)
              fx = jnp.isfinite(x) if x.shape == out.shape else jnp.all(jnp.isfinite(x))
              ok = ok | ~jnp.broadcast_to(fx, out.shape)
          self.check(eqn, "nan", ok, f"{name} produced NaN or Inf from finite operands",
                     None)
    if (self.opts.overflow and name in _ELEMENTWISE_INT and len(ins) == 2
        and jnp.asarray(results[0]).dtype == jnp.int32):
      a, b = (jnp.asarray(x, jnp.int32) for x in ins)
      r = results[0]
      if name == "add":
        bad = ((a ^ r) & (b ^ r)) < 0
      elif name == "sub":
        bad = ((a ^ b) & (a ^ r)) < 0
      else:
        safe = jnp.where(a == 0, 1, a)
        bad = (a != 0) & ((lax.div(r, safe) != b) | ((a == -1) & (b == -2**31)))
      self.check(eqn, "overflow", ~bad, f"int32 {name} overflowed", None)

  # -- ref accesses -------------------------------------------------------------------
  def _transforms(self, eqn: Any, leaves: Sequence[Any]) -> tuple:
    return tuple(jax.tree_util.tree_unflatten(eqn.params["tree"], list(leaves)))

  def _bounds(self, eqn: Any, ref: Any, transforms: tuple, mask: Any, verb: str) -> Any:
    """Checks the indices of an access; the conjunction (a boolean scalar) or None
    where statically in bounds."""
    if not self.opts.bounds:
      return None
    conditions = bounds.access_conditions(transforms, mask)
    if mask is not None:   # the lanes in bounds, for _in_bounds on the same access
      lanes = jnp.bool_(True)
      for ok, _, _ in conditions or ():
        lanes = lanes & ok
      self._lanes = (transforms, mask, lanes)
    r = self.info(ref)
    name = r.name if r else None
    all_ok = None
    for ok, detail, what in conditions:
      self.check(eqn, "out_of_bounds", ok,
                 f"{verb} '{name}' (shape {tuple(jax.typeof(ref).shape)}) out of bounds in "
                 f"{what}", name, detail, "offending index")
      ok = jnp.all(ok)
      all_ok = ok if all_ok is None else all_ok & ok
    return all_ok

  def _guarded_always(self, ok: Any, run: Any) -> list:
    """`run()` (no results) only where `ok`, on every backend."""
    lax.cond(ok, lambda: (run(), None)[1], lambda: None)
    return []

  def _guarded(self, ok: Any, run: Any, default: Any) -> Any:
    """`run()` only where `ok` (Triton: an out-of-bounds access would touch raw memory)."""
    if not self.guard or ok is None:
      return run()
    return lax.cond(ok, run, default)

  def _shadow_access(self, eqn: Any, ref: Any, transforms: tuple, mask: Any, *,
                     reads: bool, writes: bool, atomic: bool = False,
                     carried: bool = False, in_bounds: Any = None) -> None:
    """`carried`: a read whose values a merge write only carries back (merges.py).
    `in_bounds`: where the access stays inside the ref; on Triton an access out of
    bounds skips its shadows as it skips the access itself (raw memory there)."""
    if self.guard and in_bounds is not None and self._shadowed(ref):
      access = functools.partial(self._shadow_access, eqn, ref, transforms, mask,
                                 reads=reads, writes=writes, atomic=atomic, carried=carried)
      lax.cond(in_bounds, lambda: (access(), None)[1], lambda: None)
      return
    if self.guard and mask is not None and self.opts.bounds and self._shadowed(ref):
      mask = self._in_bounds(transforms, mask)
    if writes:
      self._check_not_sending(eqn, ref, transforms, mask)
    r = self.info(ref)
    if r is not None and (r.alias_reads is not None or r.alias_writes is not None):
      self._alias_access(eqn, r, transforms, mask, reads, writes)
    if r is None or r.shadow is None:
      return
    if dynamic_views.has_dynamic_size(transforms):
      self._shadow_dynamic(eqn, r, transforms, reads, writes)
      return
    if not bounds.only_indexers(transforms):
      if writes:   # through a bitcast or reshape: give up on this buffer's elements
        r.shadow[...] = jnp.full(r.shadow.shape, self.given, jnp.int32)
      return
    view = internals.TransformedRef(r.shadow, transforms) if transforms else r.shadow
    flat, tree = jax.tree_util.tree_flatten(transforms)
    # Stores to scratch need not look: it is each program's own, a race is reading
    # what another program left there. (Not reading keeps the shadow as carried as
    # the scratch itself, so the grid analysis runs the kernel as it would unchecked.)
    if reads and not writes and internals.equation_from_pallet(eqn):
      return   # pallet's pipelines copy whole blocks in, written or not, as a TPU does
    looks = reads or atomic or (self.opts.races and not r.scratch)
    if looks:   # masked accesses may point past the buffer in masked-off lanes
      old = view[...] if mask is None else primitives.load_p.bind(
          r.shadow, *flat, mask, jnp.full(jnp.shape(mask), self.given, jnp.int32),
          tree=tree, has_other=True)
      self._shadow_checks(eqn, r, old, mask, reads, writes, atomic, carried)
    if writes and not atomic:
      r.plain_stores.setdefault(self.line(eqn), eqn)
    if writes:
      stamp = self.atomic_stamp if atomic else self.stamp
      if atomic:   # a plain store of this program stays visible to others' atomics
        others = (((old > self.num_parallel) & (old < self.given) & (old != stamp))
                  | (old == self.shared))
        stamp = jnp.where(old == self.stamp, old, jnp.where(others, self.shared, stamp))
      new = jnp.broadcast_to(stamp, view.shape).astype(jnp.int32)
      if mask is None:
        view[...] = new
      else:
        primitives.store_p.bind(r.shadow, *flat, new, mask, tree=tree)

  def _shadow_dynamic(self, eqn: Any, r: _Ref, transforms: tuple, reads: bool,
                      writes: bool) -> None:
    """A DMA end whose size is known at run time: the shadow of its window, read and
    written over the static bound with the lanes past the size masked off."""
    shadow = r.shadow[...]
    w = dynamic_views.window(shadow.shape, transforms)
    if w is None:
      return   # refused when the DMA was traced
    mask = dynamic_views.valid_mask(w.view_bounds, w.view_sizes)
    if reads or self.opts.races and not r.scratch:
      self._shadow_checks(eqn, r, dynamic_views.read(shadow, w, w.view_bounds), mask,
                          reads, writes, False)
    if writes:
      stamp = jnp.full(w.view_bounds, self.stamp, jnp.int32)
      r.shadow[...] = dynamic_views.write(shadow, w, w.view_bounds, w.view_sizes, stamp)

  def _shadowed(self, ref: Any) -> bool:
    r = self.info(ref)
    return r is not None and (r.shadow is not None or r.alias_reads is not None
                              or r.alias_writes is not None)

  def _alias_access(self, eqn: Any, r: _Ref, transforms: tuple, mask: Any, reads: bool,
                    writes: bool) -> None:
    """Aliased operands seen whole: a read of the input where another program already
    wrote the output (one buffer on a TPU or GPU) sees new values there."""
    if not bounds.only_indexers(transforms) or self.quiet:
      return
    flat, tree = jax.tree_util.tree_flatten(transforms)
    step = self.flat_step + 1
    if reads and r.alias_reads is not None:
      view = internals.TransformedRef(r.alias_reads, transforms) if transforms else r.alias_reads
      old = view[...] if mask is None else primitives.load_p.bind(
          r.alias_reads, *flat, mask, jnp.zeros(jnp.shape(mask), jnp.int32), tree=tree,
          has_other=True)
      bad = (old != 0) & (old != step)
      if mask is not None:
        bad = bad & mask
      first = jnp.argmax(jnp.reshape(bad, (-1,))) if jnp.ndim(bad) else 0
      writer = jnp.reshape(old, (-1,))[first] - 1 if jnp.ndim(old) else old - 1
      self.check(eqn, "aliasing", ~bad,
                 f"reads '{r.name}', which input_output_aliases makes one buffer with "
                 f"output '{r.aliased_to}', where a program before this one in grid order "
                 f"wrote '{r.aliased_to}': where the buffer is shared this read sees the new "
                 f"values, not the originals pallet gives it", r.name, writer,
                 "writer program (flat step index)")
    if writes and r.alias_writes is not None:
      view = internals.TransformedRef(r.alias_writes, transforms) if transforms else r.alias_writes
      new = jnp.broadcast_to(step, view.shape).astype(jnp.int32)
      if mask is None:
        view[...] = new
      else:
        primitives.store_p.bind(r.alias_writes, *flat, new, mask, tree=tree)

  def _shadow_checks(self, eqn: Any, r: _Ref, old: Any, mask: Any, reads: bool,
                     writes: bool, atomic: bool, carried: bool = False) -> None:
    enabled = mask
    masked = (lambda bad: bad) if mask is None else (lambda bad: bad & enabled)
    valid = ((old >= 1) & (old <= self.given)) | (old == self.shared)
    mine = (old == self.stamp) | (old == self.atomic_stamp) | (old == self.given)
    if self.opts.races and r.scratch and reads:
      other = masked(valid & ~mine)
      self.check(eqn, "race", ~other,
                 f"reads scratch '{r.name}' last written by another program of the "
                 f"parallel grid axes {self.parallel} (scratch does not carry from one "
                 f"parallel program to another)", r.name, self._writer(old, other),
                 "writer program")
    if reads and self.opts.uninitialized and not carried:
      self.check(eqn, "uninitialized", ~masked(~valid),
                 f"reads '{r.name}' where nothing has been written yet (uninitialized "
                 f"memory, or a DMA into it not yet waited for)", r.name)
    if not self.opts.races or r.scratch:
      return
    if atomic:
      plain_other = masked((old >= 1) & (old <= self.num_parallel) & (old != self.stamp))
      # The bug is the plain store: where the kernel has one plain store into this ref
      # (so far), the report points at it rather than at this atomic update.
      stores = list(r.plain_stores.items())
      at, where = (stores[0][1], f" (the plain store at {stores[0][0]}, raced by the atomic "
                   f"update at {self.line(eqn)})") if len(stores) == 1 else (eqn, "")
      self.check(at, "race", ~plain_other,
                 f"atomic update of '{r.name}' where another program of the parallel "
                 f"grid axes {self.parallel} stored plainly{where}", r.name,
                 self._writer(old, plain_other), "writer program")
    else:
      other = masked(valid & ~mine)
      self.check(eqn, "race", ~other,
                 f"{'reads' if reads and not writes else 'writes'} '{r.name}' where "
                 f"another program of the parallel grid axes {self.parallel} wrote",
                 r.name, self._writer(old, other), "writer program")

  def _writer(self, old: Any, bad: Any) -> Any:
    """The parallel program (0-based) that wrote the first offending element."""
    first = jnp.argmax(jnp.broadcast_to(bad, jnp.shape(old)).reshape(-1)) if jnp.ndim(old) else 0
    value = jnp.reshape(old, (-1,))[first] if jnp.ndim(old) else old
    return (value - 1) % self.num_parallel

  def _get(self, eqn, ins, producers):
    if eqn.outvars[0] not in self.used:
      # A dead load (`ref[i].shape` in `ref[i] = jnp.zeros(ref[i].shape)`) reads nothing
      # on any hardware (compilers drop it): nothing to check.
      out = eqn.outvars[0].aval
      return jnp.zeros(out.shape, out.dtype)
    ref, *leaves = ins
    transforms = self._transforms(eqn, leaves)
    ok = self._bounds(eqn, ref, transforms, None, "reads")
    self._shadow_access(eqn, ref, transforms, None, reads=True, writes=False,
                        carried=id(eqn) in self.merges, in_bounds=ok)
    out = eqn.outvars[0].aval
    value = self._guarded(ok, lambda: self.bind(eqn, ins),
                          lambda: jnp.zeros(out.shape, out.dtype))
    self._loaded(ref, transforms, value)
    return value

  def _swap(self, eqn, ins, producers):
    ref, value, *leaves = ins
    transforms = self._transforms(eqn, leaves)
    ok = self._bounds(eqn, ref, transforms, None, "writes")
    self._stored(eqn, ref, transforms, value)
    merge = self.merges.get(id(eqn))
    anew = None if merge is None else self.merge_masks.get(id(merge.select))
    self._shadow_access(eqn, ref, transforms, anew,
                        reads=eqn.outvars[0] in self.used, writes=True, in_bounds=ok)
    out = eqn.outvars[0].aval
    return self._guarded(ok, lambda: self.bind(eqn, ins),
                         lambda: jnp.zeros(out.shape, out.dtype))

  def _addupdate(self, eqn, ins, producers):
    ref, value, *leaves = ins
    transforms = self._transforms(eqn, leaves)
    ok = self._bounds(eqn, ref, transforms, None, "updates")
    self._stored(eqn, ref, transforms, value)
    self._shadow_access(eqn, ref, transforms, None, reads=True, writes=True, in_bounds=ok)
    return self._guarded(ok, lambda: self.bind(eqn, ins), lambda: [])

  def _masked_load(self, eqn, ins, producers):
    tree = eqn.params["tree"]
    ref, leaves = ins[0], ins[1:1 + tree.num_leaves]
    mask = ins[1 + tree.num_leaves]
    transforms = self._transforms(eqn, leaves)
    self._bounds(eqn, ref, transforms, mask, "reads")
    self._shadow_access(eqn, ref, transforms, mask, reads=True, writes=False)
    value = self.bind(eqn, self._safe_mask(ins, 1 + tree.num_leaves, transforms, mask))
    self._loaded(ref, transforms, value, mask)
    return value

  def _masked_store(self, eqn, ins, producers):
    tree = eqn.params["tree"]
    ref, leaves = ins[0], ins[1:1 + tree.num_leaves]
    value, mask = ins[1 + tree.num_leaves:]
    transforms = self._transforms(eqn, leaves)
    self._bounds(eqn, ref, transforms, mask, "writes")
    self._stored(eqn, ref, transforms, value, mask)
    self._shadow_access(eqn, ref, transforms, mask, reads=False, writes=True)
    return self.bind(eqn, self._safe_mask(ins, 2 + tree.num_leaves, transforms, mask))

  def _atomic_rmw(self, eqn, ins, producers):
    tree = eqn.params["tree"]
    ref, leaves = ins[0], ins[1:1 + tree.num_leaves]
    mask = ins[2 + tree.num_leaves] if eqn.params["has_mask"] else None
    transforms = self._transforms(eqn, leaves)
    ok = self._bounds(eqn, ref, transforms, mask, "atomically updates")
    self._shadow_access(eqn, ref, transforms, mask, reads=True, writes=True, atomic=True,
                        in_bounds=ok if mask is None else None)
    if mask is not None:
      return self.bind(eqn, self._safe_mask(ins, 2 + tree.num_leaves, transforms, mask))
    out = eqn.outvars[0].aval
    return self._guarded(ok, lambda: self.bind(eqn, ins),
                         lambda: jnp.zeros(out.shape, out.dtype))

  def _atomic_cas(self, eqn, ins, producers):
    tree = eqn.params["tree"]
    ref, leaves = ins[0], ins[1:1 + tree.num_leaves]
    transforms = self._transforms(eqn, leaves)
    ok = self._bounds(eqn, ref, transforms, None, "atomically updates")
    self._shadow_access(eqn, ref, transforms, None, reads=True, writes=True, atomic=True,
                        in_bounds=ok)
    out = eqn.outvars[0].aval
    return self._guarded(ok, lambda: self.bind(eqn, ins),
                         lambda: jnp.zeros(out.shape, out.dtype))

  def _safe_mask(self, ins: list, at: int, transforms: tuple, mask: Any) -> list:
    """On Triton, lanes out of bounds are masked off too (their error is reported)."""
    if not (self.guard and self.opts.bounds):
      return ins
    ins = list(ins)
    ins[at] = self._in_bounds(transforms, mask)
    return ins

  def _in_bounds(self, transforms: tuple, mask: Any) -> Any:
    """`mask` with the lanes out of bounds off (as `_bounds` found them)."""
    seen = self._lanes
    if seen is not None and seen[0] is transforms and seen[1] is mask:
      return mask & seen[2]
    ok = jnp.bool_(True)
    for c, _, _ in bounds.access_conditions(transforms, mask) or ():
      ok = ok & c
    return mask & ok

  # -- DMAs (TPU kernels) -----------------------------------------------------------
  def _dma_start(self, eqn, ins, producers):
    src, src_t, dst, dst_t, sem, sem_t, *_ = jax.tree_util.tree_unflatten(
        eqn.params["tree"], ins)
    src_t, dst_t = tuple(src_t or ()), tuple(dst_t or ())
    ok_src = self._bounds(eqn, src, src_t, None, "copies from")
    ok_dst = self._bounds(eqn, dst, dst_t, None, "copies into")
    self._shadow_access(eqn, src, src_t, None, reads=True, writes=False)
    self._check_not_sending(eqn, dst, dst_t, None, "copies into")
    self._mark_sending(src, src_t, self._semaphore_code(sem, sem_t))
    r = self.info(dst)
    if r is not None and r.shadow is not None and dynamic_views.has_dynamic_size(dst_t):
      shadow = r.shadow[...]
      w = dynamic_views.window(shadow.shape, dst_t)
      flight = jnp.full(w.view_bounds, self.in_flight, jnp.int32)
      r.shadow[...] = dynamic_views.write(shadow, w, w.view_bounds, w.view_sizes, flight)
    elif r is not None and r.shadow is not None and bounds.only_indexers(dst_t):
      view = internals.TransformedRef(r.shadow, dst_t) if dst_t else r.shadow
      view[...] = jnp.full(view.shape, self.in_flight, jnp.int32)
    ok = ok_src if ok_dst is None else (ok_dst if ok_src is None else ok_src & ok_dst)
    return self._guarded(ok, lambda: self.bind(eqn, ins), lambda: [])

  def _dma_wait(self, eqn, ins, producers):
    ref, ref_t, sem, sem_t = jax.tree_util.tree_unflatten(eqn.params["tree"], ins)
    ref_t = tuple(ref_t or ())
    self._sent(self._semaphore_code(sem, sem_t))
    r = self.info(ref)
    if r is not None and r.shadow is not None and dynamic_views.has_dynamic_size(ref_t):
      shadow = r.shadow[...]
      w = dynamic_views.window(shadow.shape, ref_t)
      old = dynamic_views.read(shadow, w, w.view_bounds)
      landed = jnp.where(old == self.in_flight, self.stamp, old)
      r.shadow[...] = dynamic_views.write(shadow, w, w.view_bounds, w.view_sizes, landed)
    elif r is not None and r.shadow is not None and bounds.only_indexers(ref_t):
      view = internals.TransformedRef(r.shadow, ref_t) if ref_t else r.shadow
      old = view[...]
      view[...] = jnp.where(old == self.in_flight, self.stamp, old)
    size = primitives.view_aval(jax.typeof(ref), ref_t).size
    return self._wait(eqn, ins, sem, sem_t, size, "a DMA wait")

  # A DMA reads its source until its wait: a store into the source before then races
  # with the copy (on a TPU the copy may send the new values). Each element of a
  # scratch buffer that DMAs copy from holds the code of the semaphore of the copy still
  # reading it (0: none); a wait on that semaphore ends it.
  def _semaphore_code(self, sem: Any, sem_t: Any) -> Any:
    """1 + a number for the semaphore element `sem` seen through `sem_t`, or None."""
    if not any(r.sending is not None for r in self.refs.values()):
      return None
    sem_t = tuple(sem_t or ())
    if not bounds.only_indexers(sem_t):
      return None   # a view this check does not follow: no check
    shape = jnp.shape(sem)
    number = self.semaphores.setdefault(id(sem), len(self.semaphores))
    positions = jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape)
    flat = ref_views.read(positions, sem_t)
    if jnp.shape(flat) != ():
      return None
    return 1 + number * (1 << 20) + flat

  def _sending_view(self, ref: Any, transforms: tuple) -> tuple[Any, Any] | None:
    """(the `sending` buffer of `ref`, its window of `transforms`) or None."""
    r = self.info(ref)
    if r is None or r.sending is None or dynamic_views.has_dynamic_size(transforms) \
        or not bounds.only_indexers(transforms):
      return None
    return r, internals.TransformedRef(r.sending, transforms) if transforms else r.sending

  def _mark_sending(self, src: Any, src_t: tuple, code: Any) -> None:
    found = self._sending_view(src, src_t)
    if found is not None and code is not None:
      found[1][...] = jnp.full(found[1].shape, code, jnp.int32)

  def _sent(self, code: Any) -> None:
    if code is None:
      return
    for r in self.refs.values():
      if r.sending is not None:
        old = r.sending[...]
        r.sending[...] = jnp.where(old == code, 0, old)

  def _check_not_sending(self, eqn: Any, ref: Any, transforms: tuple, mask: Any,
                         what: str = "writes") -> None:
    found = self._sending_view(ref, transforms)
    if found is None or self.quiet:
      return
    r, view = found
    pending = view[...] > 0
    if mask is not None:
      pending = pending & jnp.broadcast_to(mask, pending.shape)
    self.check(eqn, "race", ~pending,
               f"{what} '{r.name}' while a DMA started earlier still copies from it (its "
               f"wait has not happened): on a TPU the copy may send the new values",
               r.name)

  def _semaphore_wait(self, eqn, ins, producers):
    *flat, value = ins
    sem, sem_t = jax.tree_util.tree_unflatten(eqn.params["tree"], flat)
    return self._wait(eqn, ins, sem, sem_t, value, "semaphore_wait")

  def _wait(self, eqn: Any, ins: list, sem: Any, sem_t: Any, amount: Any, what: str) -> Any:
    """A wait on a semaphore that holds less than it takes: in grid order every program
    before this one has run, so only a later one (or none) could signal it."""
    if not self.opts.hangs or self.quiet:
      return self.bind(eqn, ins)
    from pallet.core import dma
    flat, tree = jax.tree_util.tree_flatten((sem, sem_t))
    held = dma.semaphore_read_p.bind(*flat, tree=tree)
    ok = held >= jnp.asarray(amount, jnp.int32)
    r = self.info(sem)
    name = r.name if r else None
    self.check(eqn, "deadlock", ok,
               f"{what} on {repr(name) if name else 'a semaphore'} takes more than it "
               f"holds: nothing before this program in grid order signalled it enough, so "
               f"on a TPU it waits for a later program (or none) and deadlocks", name, held,
               "the semaphore holds")
    return self._guarded_always(ok, lambda: self.bind(eqn, ins))

  # -- buffers made inside the kernel ---------------------------------------------------
  def _new_ref(self, eqn, ins, producers):
    ref = self.bind(eqn, ins)
    if self.opts.uninitialized and _poison_fill(eqn.invars[0], producers):
      shadow = jax.new_ref(jnp.zeros(jnp.shape(ins[0]), jnp.int32))
      self.refs[id(ref)] = _Ref(_scoped_name(eqn), shadow, scratch=True)
    if self.sends_from_scoped_buffers:   # a `run_scoped` buffer a DMA may copy from
      r = self.refs.setdefault(id(ref), _Ref(_scoped_name(eqn), scratch=True))
      r.sending = jax.new_ref(jnp.zeros(jnp.shape(ins[0]), jnp.int32))
    return ref

  # -- pl.debug_check ---------------------------------------------------------------
  def _pallet_check(self, eqn, ins, producers):
    """`pl.debug_check`s and pallet's own sanity checks report like the others."""
    if eqn.params.get("info") is not None:
      return self.bind(eqn, ins)
    message = eqn.params["message"]
    kind = "debug_check" if message.startswith("pl.debug_check failed") else ""
    self.check(eqn, kind, ins[0], message, None)
    return []

  # -- values: gathers and dynamic slices clamp silently ----------------------------
  def _array_bounds(self, eqn: Any, ins: list) -> None:
    name, params = eqn.primitive.name, eqn.params
    if name == "gather":
      mode = str(params.get("mode", ""))
      if "PROMISE" in mode.upper():
        return
      conditions = bounds.gather_conditions(jnp.shape(ins[0]), ins[1],
                                            params["dimension_numbers"],
                                            params["slice_sizes"])
    elif name == "dynamic_slice":
      conditions = bounds.dynamic_slice_conditions(jnp.shape(ins[0]), ins[1:],
                                                   params["slice_sizes"], "dynamic_slice")
    else:
      conditions = bounds.dynamic_slice_conditions(jnp.shape(ins[0]), ins[2:],
                                                   jnp.shape(ins[1]), "dynamic_update_slice")
    for ok, detail, what in conditions:
      self.check(eqn, "out_of_bounds", ok, f"{name} out of bounds: {what}", None, detail,
                 "offending index")

  # -- control flow -------------------------------------------------------------------
  def _cond(self, eqn, ins, producers):
    index, operands = ins[0], ins[1:]
    branches = [functools.partial(self._run_branch, b, operands)
                for b in eqn.params["branches"]]
    outs = lax.switch(index, branches)
    return list(outs)

  def _run_branch(self, closed: Any, operands: list) -> tuple:
    return tuple(self.eval(closed.jaxpr, closed.consts, operands))

  def _scan(self, eqn, ins, producers):
    params = eqn.params
    jaxpr, consts, num_consts, num_carry = internals.scan_layout(params)
    const_ins = ins[:num_consts]
    carry, xs = ins[num_consts:num_consts + num_carry], ins[num_consts + num_carry:]

    def body(c, x):
      outs = self.eval(jaxpr, consts, [*const_ins, *c, *x])
      return outs[:num_carry], outs[num_carry:]

    carry_out, ys = lax.scan(body, list(carry), list(xs), length=params["length"],
                             reverse=params["reverse"], unroll=params["unroll"])
    return [*carry_out, *ys]

  def _while(self, eqn, ins, producers):
    params = eqn.params
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
    cj, bj = params["cond_jaxpr"], params["body_jaxpr"]

    def cond_fun(c):
      self.quiet += 1
      try:
        return self.eval(cj.jaxpr, cj.consts, [*cond_consts, *c])[0]
      finally:
        self.quiet -= 1

    def body_fun(c):
      return self.eval(bj.jaxpr, bj.consts, [*body_consts, *c])

    if not self.opts.hangs or self.quiet:
      return list(lax.while_loop(cond_fun, body_fun, list(init)))
    return self._watched_while(eqn, ins, cond_fun, body_fun, list(init))

  def _watched_while(self, eqn, ins, cond_fun, body_fun, init):
    """The loop, stopped (and reported) when an iteration changes nothing it could
    act on next (it would repeat forever) or, unless it is counted, past
    `opts.loop_bound` iterations."""
    uses = loops.ref_uses(eqn)
    watched = [ins[k] for k in sorted(uses.reads & uses.writes)]
    progress_known = loops.snapshottable(watched)
    bounded = not loops.counted(eqn)
    if not progress_known and not bounded:
      return list(lax.while_loop(cond_fun, body_fun, init))
    bound = self.opts.loop_bound

    # Programs that run one after another: one iteration that changes nothing
    # repeats forever. Running at once (a GPU), another program may still write what
    # this one waits for: only `bound` such iterations in a row count.
    patience = bound if self.concurrent else 1
    steering = loops.steering_carry(eqn)

    def cond(c):
      state, count, idle = c
      go = cond_fun(state) & (idle < patience)
      return (go & (count < bound)) if bounded else go

    def body(c):
      state, count, idle = c
      before = [r[...] for r in watched] if progress_known else []
      new = body_fun(state)
      if not progress_known:
        return new, count + 1, idle
      after = [r[...] for r in watched]
      same = loops.unchanged([*(state[k] for k in steering), *before],
                             [*(new[k] for k in steering), *after])
      return new, count + 1, jnp.where(same, idle + 1, 0)

    state, count, idle = lax.while_loop(cond, body, (init, jnp.int32(0), jnp.int32(0)))
    stuck = idle >= patience
    if progress_known:
      waited = uses.waited_on() or (uses.read_sites[0] if uses.read_sites else None)
      if waited is not None:
        at, k = waited
        r = self.info(ins[k])
        name = r.name if r else None
        self.check(at, "deadlock", ~stuck,
                   f"this program waits in a loop on {repr(name) if name else 'memory'} "
                   f"and an iteration changed nothing it could act on: nothing before it "
                   f"in grid order wrote the value it waits for, so on a TPU or GPU it "
                   f"waits for a later program (or none) and deadlocks where that program "
                   f"is scheduled after it", name, count, "iterations")
      else:
        self.check(eqn, "hang", ~stuck,
                   "while_loop iteration changed neither its carry nor any memory it "
                   "reads: it would loop forever", None, count, "iterations")
    if bounded:
      self.quiet += 1
      try:
        going = cond_fun(state)
      finally:
        self.quiet -= 1
      self.check(eqn, "hang", ~(going & (count >= bound) & ~stuck),
                 f"while_loop ran {bound} iterations and its condition still holds: it "
                 f"may never finish (checking mode stops loops past {bound} iterations; "
                 f"InterpretParams(max_loop_iterations=...) sets the bound)", None, count,
                 "iterations")
    return list(state)


# ------------------------------------------------------------------ building the kernel
def _whole_mapping(b: BlockMapping, origin: str) -> BlockMapping:
  """An int32 input holding a shadow's initial value, seen whole (never read)."""
  ndim = len(b.array_shape)
  n_args = len(b.index_map.in_avals)
  index_map = jax.make_jaxpr(lambda *_: tuple(jnp.int32(0) for _ in range(ndim)))(
      *b.index_map.in_avals) if n_args else jax.make_jaxpr(
          lambda: tuple(jnp.int32(0) for _ in range(ndim)))()
  return BlockMapping(origin=origin, array_shape=b.array_shape, dtype=jnp.dtype(jnp.int32),
                      dims=tuple(BlockDimension("blocked", s) for s in b.array_shape),
                      index_map=index_map, memory_space=b.memory_space, whole=True)


def _record_mapping(gm: Any) -> tuple[BlockMapping, bool]:
  """The failure record's output: one row per grid step (each step's own block), or
  with sizes known only at run time one row for the grid, holding the grid indices
  too; (mapping, whether it is that one row)."""
  n = len(gm.grid)
  arg_avals = ([jax.core.ShapedArray((), jnp.int32)] * n
               + [internals.AbstractRef(a) for a in gm.prefetch_avals])
  if None in gm.grid:
    width = report.RECORD_WIDTH + n
    index_map = jax.make_jaxpr(lambda *_: (jnp.int32(0),))(*arg_avals)
    return BlockMapping(origin="check record", array_shape=(width,),
                        dtype=jnp.dtype(jnp.int32),
                        dims=(BlockDimension("blocked", width),), index_map=index_map,
                        memory_space=None, whole=True), True
  index_map = jax.make_jaxpr(lambda *a: (*a[:n], jnp.int32(0)))(*arg_avals)
  dims = (BlockDimension("squeezed", 1),) * n + (BlockDimension("blocked", report.RECORD_WIDTH),)
  return BlockMapping(origin="check record", array_shape=(*gm.grid, report.RECORD_WIDTH),
                      dtype=jnp.dtype(jnp.int32), dims=dims, index_map=index_map,
                      memory_space=None, whole=False), False


def instrument(kernel: KernelDescription, opts: CheckOptions, names: list[str],
               parallel: tuple[int, ...], shadowed_outputs: tuple[int, ...],
               shadowed_scratch: tuple[int, ...], guard: bool, concurrent: bool = False,
               alias_pairs: tuple[tuple[int, int], ...] = ()
               ) -> tuple[KernelDescription, Layout]:
  """The checked kernel and where its extra operands are. `alias_pairs`: aliased
  (input, output) pairs seen whole, whose reads are checked against earlier programs'
  writes (see aliasing.py)."""
  args = (kernel, opts, names, parallel, shadowed_outputs, shadowed_scratch, guard,
          concurrent, alias_pairs)
  checked, layout = _instrument(*args, with_record=True)
  if layout.catalog:
    return checked, layout
  # No check survived tracing (all known to pass): no record to carry.
  return _instrument(*args, with_record=False)


def _instrument(kernel: KernelDescription, opts: CheckOptions, names: list[str],
                parallel: tuple[int, ...], shadowed_outputs: tuple[int, ...],
                shadowed_scratch: tuple[int, ...], guard: bool, concurrent: bool,
                alias_pairs: tuple[tuple[int, int], ...],
                with_record: bool) -> tuple[KernelDescription, Layout]:
  gm = kernel.grid_mapping
  if None in gm.grid:   # steps are told apart by their flat index
    alias_pairs = ()
  alias_outputs = tuple(o for _, o in alias_pairs)
  n_ids = len(gm.grid) + len(gm.dynamic_axes)
  tool = _Instrumenter(kernel, opts, names, parallel, guard, concurrent)
  tool.shadowed_outputs, tool.shadowed_scratch = shadowed_outputs, shadowed_scratch
  if opts.races:
    tool.sending_scratch, tool.sends_from_scoped_buffers = _dma_sources(kernel)
  tool.alias_pairs = alias_pairs
  shadowed_outputs_all = shadowed_outputs + alias_outputs
  n_out_names = names[len(gm.prefetch_avals) + len(gm.inputs):]
  aliased = {o for _, o in kernel.input_output_aliases}
  shadow_outputs = tuple(gm.outputs[o].replace(origin=f"shadow of {gm.outputs[o].origin}",
                                               dtype=jnp.dtype(jnp.int32))
                         for o in shadowed_outputs_all)
  shadow_inputs = tuple(_whole_mapping(gm.outputs[o], f"initial shadow of output {o}")
                        for o in shadowed_outputs_all)
  record_outputs, record_inputs, record_has_ids = (), (), False
  if with_record:
    mapping, record_has_ids = _record_mapping(gm)
    record_outputs = (mapping,)
    if record_has_ids:   # one row kept across the grid: starts as the caller's zeros
      record_inputs = (mapping.replace(origin="initial check record"),)
  shadow_scratch = tuple(jax.core.ShapedArray(gm.scratch_avals[s].shape, jnp.int32)
                         for s in shadowed_scratch + tool.sending_scratch)
  new_gm = gm.replace(inputs=gm.inputs + shadow_inputs + record_inputs,
                      outputs=gm.outputs + shadow_outputs + record_outputs,
                      scratch_avals=gm.scratch_avals + shadow_scratch)
  ref_avals = ([internals.AbstractRef(a) for a in gm.prefetch_avals]
               + [internals.AbstractRef(b.kernel_aval) for b in new_gm.inputs]
               + [internals.AbstractRef(b.kernel_aval) for b in new_gm.outputs]
               + [internals.AbstractRef(a) for a in new_gm.scratch_avals])
  id_avals = [jax.core.ShapedArray((), jnp.int32)] * n_ids
  counts = (n_ids, len(gm.prefetch_avals), len(gm.inputs), len(shadowed_outputs_all),
            len(record_inputs), len(gm.outputs), len(record_outputs), len(gm.scratch_avals),
            len(shadowed_scratch), len(tool.sending_scratch))
  with internals.vma_checks_off():
    jaxpr = jax.make_jaxpr(functools.partial(tool.body, counts))(*id_avals, *ref_avals)
  n_in, n_out = len(gm.inputs), len(gm.outputs)
  aliases = kernel.input_output_aliases + tuple(
      (n_in + k, n_out + k) for k in range(len(shadowed_outputs_all)))
  if record_inputs:
    aliases += ((n_in + len(shadow_inputs), n_out + len(shadow_outputs)),)
  checked = kernel.replace(jaxpr=jaxpr, grid_mapping=new_gm, input_output_aliases=aliases)
  layout = Layout(shadowed_outputs=shadowed_outputs,
                  shadow_initial=tuple(tool.given if o in aliased else 0
                                       for o in shadowed_outputs),
                  alias_outputs=alias_outputs,
                  given=tool.given, shared=tool.shared,
                  output_names=tuple(n_out_names[:len(gm.outputs)]),
                  catalog=tuple(tool.catalog) if with_record else (),
                  record=with_record, record_has_ids=record_has_ids)
  return checked, layout

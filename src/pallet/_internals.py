"""Every JAX internal that pallet touches, named in one place.

pallet builds on public JAX wherever it can (`jax.ref`, `jax.extend.core`,
`jax.interpreters.*`). What is left, the state-discharge machinery, the ref
indexers and a few effect objects, lives behind this module, so that a JAX upgrade
is a one-file change. Supported: jax 0.10.2 and 0.12.x.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Callable, Iterator, Sequence

import jax
from jax._src import api_util as _api_util
from jax._src import core as _core
from jax._src import debugging as _debugging
from jax._src import dispatch as _dispatch
from jax._src import linear_util as _linear_util
from jax._src import traceback_util as _traceback_util
from jax._src.interpreters import partial_eval as _partial_eval
from jax._src.state import discharge as _discharge
from jax._src.state import indexing as _indexing
from jax._src.state import primitives as _state_primitives
from jax._src.state import types as _state_types
from jax._src.state import utils as _state_utils
from jax.extend.core import ClosedJaxpr as _ClosedJaxpr

# --- ref indexing: JAX's own indexer objects, so `ref[...]` and `pl.ds` agree ----
Slice = _indexing.Slice
NDIndexer = _indexing.NDIndexer
TransformedRef = _state_types.TransformedRef
ReshapeTransform = _state_types.ReshapeTransform   # `ref.reshape(...)`: `.shape` is the new shape
BitcastTransform = _state_types.BitcastTransform   # `ref.bitcast(dtype)` (TPU packing)
AbstractRef = jax.ref.AbstractRef

# --- effects --------------------------------------------------------------------
ReadEffect = _state_types.ReadEffect
WriteEffect = _state_types.WriteEffect
debug_effect = _debugging.debug_effect
# a ref made inside a jaxpr (as `jax.new_ref` makes one): its effects stay inside
internal_ref_effect = _core.internal_mutable_array_effect

# --- tracebacks: pallet's frames hidden as JAX hides its own ------------------------
api_boundary = _traceback_util.api_boundary   # filters a traceback passing through it
hide_from_tracebacks = _traceback_util.register_exclusion   # (a directory)

# --- lowering with devices known (automatic partitioning, pallet/distributed/partitioning.py) ---
def require_devices_during_lowering(primitive: Any) -> None:
  """jit then lowers programs using `primitive` with their devices and mesh known,
  which a custom-partitioned lowering needs."""
  _dispatch.prim_requires_devices_during_lowering.add(primitive)

# --- tracing a function of flat arguments into a jaxpr -----------------------------
def trace_jaxpr(fn: Callable[..., Sequence[Any]], avals: Sequence[Any],
                traced_for: str) -> Any:
  """`jax.make_jaxpr(fn)(*avals)` for `fn` of flat arguments returning a flat sequence
  of arrays, traced directly: make_jaxpr goes through `jit`'s argument handling and
  caches, about 0.25 ms per trace that a first call pays for the kernel and each of
  its index maps."""
  debug = _api_util.debug_info(traced_for, fn, tuple(avals), {})
  flat = _linear_util.wrap_init(lambda *args: list(fn(*args)), debug_info=debug)
  jaxpr, _, consts = _partial_eval.trace_to_jaxpr_dynamic(flat, list(avals))
  if jaxpr.debug_info is not None:   # results named as make_jaxpr names them
    jaxpr = jaxpr.replace(debug_info=jaxpr.debug_info._replace(
        result_paths=tuple(f"result[{i}]" for i in range(len(jaxpr.outvars)))))
  return _ClosedJaxpr(jaxpr, consts)


# --- state discharge: turning a jaxpr over refs into a pure function --------------
transform_array = _discharge.transform_array
transform_swap_array = _discharge.transform_swap_array   # (old view, x with the view written)
bitcast_value = _state_utils.bitcast   # a value as `ref.bitcast(dtype)` would show its bytes


_NEW_DISCHARGE_API = "ctx" in inspect.signature(
    _discharge._get_discharge_rule).parameters


_STRIPS_MEMORY_SPACES = "strip_memory_space" in inspect.signature(
    _discharge.discharge_state).parameters


def discharge_state(closed_jaxpr: Any, *, load: Callable | None = None,
                    store: Callable | None = None) -> Any:
  """Pure version of a jaxpr over refs: ref inputs become values, final values are appended.

  Memory spaces are dropped from the values (where JAX can): a ref a kernel made with
  `jax.empty_ref(ty, pltpu.VMEM)` would otherwise become a value whose type names a
  memory space JAX's primitives refuse; on the CPU every memory space is one memory.

  `load(x, transforms)` -> view and `store(x, transforms, value)` -> (old view, new x)
  replace JAX's discharge of a ref's loads and stores while this runs (JAX's own rules
  are restored afterwards, so JAX's Pallas behaves as it does without pallet); each
  returns None to leave an access to JAX's rule.
  pallet's meaning of such accesses is in pallet/core/discharge.py."""
  with _state_rules(load, store):
    if _STRIPS_MEMORY_SPACES:
      return _discharge.discharge_state(closed_jaxpr, strip_memory_space=True)
    return _discharge.discharge_state(closed_jaxpr)


@contextlib.contextmanager
def _state_rules(load: Callable | None, store: Callable | None) -> Iterator[None]:
  """JAX's discharge rules of get and swap replaced by adapters calling `load` and
  `store`; the rules' leading arguments differ between JAX versions, then come the
  ref's value, the stored value (swap) and the flat transforms."""
  rules = _discharge._discharge_rules
  prims = (_state_primitives.get_p, _state_primitives.swap_p)
  previous = {p: rules[p] for p in prims}

  def adapter(prim: Any, fn: Callable, n_values: int) -> Callable:
    jax_rule = previous[prim]

    def rule(*args: Any, tree: Any) -> Any:
      n = tree.num_leaves
      first = len(args) - n - n_values
      transforms = jax.tree_util.tree_unflatten(tree, args[len(args) - n:])
      x, *value = args[first:len(args) - n]
      out = fn(x, transforms, *value)
      if out is None:
        return jax_rule(*args, tree=tree)
      if prim is _state_primitives.get_p:
        return (None,) * (n + 1), out
      old, new_x = out
      return (new_x, None) + (None,) * n, old
    return rule

  for prim, fn, n_values in zip(prims, (load, store), (1, 2)):
    if fn is not None:
      rules[prim] = adapter(prim, fn, n_values)
  try:
    yield
  finally:
    rules.update(previous)


def with_leading_inputs(closed_jaxpr: Any, avals: Sequence[Any],
                        as_outputs: bool = False) -> Any:
  """`closed_jaxpr` with new inputs of `avals` in front (unused; with `as_outputs`
  also returned first), built without tracing it again."""
  jaxpr = closed_jaxpr.jaxpr
  new = [_core.Var(a) for a in avals]
  shift = len(new)
  # effects name their ref by input position in some JAX versions, by variable in others
  effects = {e.replace(input_index=e.input_index + shift)
             if isinstance(getattr(e, "input_index", None), int) else e for e in jaxpr.effects}
  changes = dict(invars=[*new, *jaxpr.invars], effects=effects)
  if as_outputs:
    changes["outvars"] = [*new, *jaxpr.outvars]
  debug = getattr(jaxpr, "debug_info", None)
  if debug is not None:
    changes["debug_info"] = _with_argument_names(debug, len(new), len(changes.get(
        "outvars", jaxpr.outvars)))
  return closed_jaxpr.replace(jaxpr=jaxpr.replace(**changes))


def _with_argument_names(debug: Any, n_new: int, n_out: int) -> Any:
  names = getattr(debug, "arg_names", None)
  paths = getattr(debug, "result_paths", None)
  changes = {}
  if names is not None:
    changes["arg_names"] = ("",) * n_new + tuple(names)
  if paths is not None and not callable(paths) and len(paths) != n_out:
    changes["result_paths"] = ("",) * (n_out - len(paths)) + tuple(paths)
  return debug._replace(**changes) if changes else debug


def register_discharge_rule(primitive: Any) -> Callable:
  """Registers `rule(in_avals, out_avals, *args, **params)` across JAX versions.

  The rule returns `(new_invals, outvals)` as JAX expects: one entry per input
  (the updated value of a ref input, or None).
  """
  def register(rule: Callable) -> Callable:
    if _NEW_DISCHARGE_API:
      def adapted(ctx, *args, **params):
        return rule(ctx.in_avals, ctx.out_avals, *args, **params)
    else:
      adapted = rule
    _discharge.register_discharge_rule(primitive)(adapted)
    return rule
  return register


def consts_as_inputs(closed_jaxpr: Any) -> Any:
  """The open jaxpr of `closed_jaxpr` taking its constants as leading inputs (effects
  on closed-over refs then name those inputs)."""
  return _pe.convert_constvars_jaxpr(closed_jaxpr.jaxpr)


def input_effects(jaxpr: Any) -> set:
  """`jaxpr`'s effects, those on its inputs named by input position."""
  return set(_core.positional_effects(jaxpr))


def is_tracer(x: Any) -> bool:
  return isinstance(x, _core.Tracer)


def is_staging_tracer(x: Any) -> bool:
  """Whether `x` is a value being staged into a jaxpr (jit, make_jaxpr), as opposed to
  one carrying a transformation (grad/jvp tangents, vmap batches). Autotune tunes only
  under the former."""
  from jax._src.interpreters import partial_eval as pe
  return isinstance(x, pe.DynamicJaxprTracer)


# --- vmap of a function over refs (emit_pipeline): its batch axis becomes a grid axis ---
# A pipeline called under `jax.vmap` steps out of vmap's trace and runs over the whole
# (batched) refs, looping over the batch itself, as Pallas's batching rule does.
from jax._src.interpreters import batching as _batching


def current_vmap() -> Any | None:
  """The `jax.vmap` trace that the code running now is traced under, or None."""
  trace = _core.trace_ctx.trace
  return trace if isinstance(trace, _batching.BatchTrace) else None


def is_vmapped(x: Any) -> bool:
  """Whether `x` is a value batched by some `jax.vmap`."""
  return isinstance(x, _batching.BatchTracer)


def vmap_axis(vmap: Any) -> tuple[Any, Any]:
  """(size, name) of a vmap trace's batch axis; the name is None when unnamed."""
  return vmap.axis_data.size, vmap.axis_data.name


def unbatched(vmap: Any, x: Any) -> tuple[Any, int | None]:
  """(the whole value, its batch dimension or None) of `x` under the vmap trace `vmap`."""
  return vmap.to_batch_info(x)


def outside_vmap(vmap: Any) -> Any:
  """A context in which operations are traced as by the code that called vmap."""
  return _core.set_current_trace(vmap.parent_trace)


# --- Triton backend: where an equation came from, for comments and error messages ---
from jax._src import source_info_util as _source_info_util


_PALLET_DIR = __import__("os").path.dirname(__file__)
_BENCH_DIR = __import__("os").path.join(_PALLET_DIR, "bench", "")   # user code to pallet


def _from_pallet(file_name: str) -> bool:
  return file_name.startswith(_PALLET_DIR) and not file_name.startswith(_BENCH_DIR)


def equation_source(eqn: Any) -> tuple[str, int] | None:
  """(file, line) of the user code that produced `eqn` (outside JAX and pallet), or None."""
  for frame in _source_info_util.user_frames(eqn.source_info.traceback):
    if not _from_pallet(frame.file_name):
      return frame.file_name, frame.start_line
  return None


_JAX_PALLAS = ("jax._src.pallas", "jax.experimental.pallas")
_jax_pallas_primitives: dict[frozenset[str], frozenset[Any]] = {}


def jax_pallas_primitives() -> frozenset[Any]:
  """The primitives JAX's own Pallas defines, among the modules this process has loaded
  (none unless the program imported `jax.experimental.pallas`): a kernel pallet traces
  that binds one called JAX's Pallas where it meant pallet. Read from the loaded
  modules, never imported; JAX primitives its modules merely import are left out."""
  loaded = frozenset(n for n in list(sys.modules) if n.startswith(_JAX_PALLAS))
  if loaded not in _jax_pallas_primitives:
    def primitives_of(names):
      return {v for n in names if (m := sys.modules.get(n)) is not None
              for v in list(vars(m).values()) if isinstance(v, _core.Primitive)}
    elsewhere = [n for n in list(sys.modules)
                 if n.startswith("jax") and not n.startswith(_JAX_PALLAS)]
    _jax_pallas_primitives.clear()
    _jax_pallas_primitives[loaded] = frozenset(
        primitives_of(loaded) - primitives_of(elsewhere)) if loaded else frozenset()
  return _jax_pallas_primitives[loaded]


def equation_from_pallet(eqn: Any) -> bool:
  """Whether pallet's own code (pipelines, DMA helpers), not the user's, bound `eqn`."""
  for frame in _source_info_util.user_frames(eqn.source_info.traceback):
    return _from_pallet(frame.file_name)
  return False


def equation_files(eqn: Any) -> list[str]:
  """The files of every frame (innermost first) of the code that bound `eqn`."""
  traceback = eqn.source_info.traceback
  code, _ = traceback.raw_frames() if traceback else ([], [])
  return [c.co_filename for c in code]


def equation_context(eqn: Any) -> Any:
  """A context in which binds carry `eqn`'s source information and context, as in
  `jax.core.eval_jaxpr` (checking mode re-traces kernel equations through it)."""
  import contextlib
  stack = contextlib.ExitStack()
  name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
  stack.enter_context(_source_info_util.user_context(eqn.source_info.traceback,
                                                     name_stack=name_stack))
  stack.enter_context(eqn.ctx.manager)
  return stack


def bind_equation(eqn: Any, args: Sequence[Any], params: dict | None = None, *,
                  source: bool = True) -> list[Any]:
  """`eqn`'s primitive applied to `args` (with `params` in place of its own), as a list
  of results. With `source`, in the equation's source context, so that what it binds
  names the user's line (about 5 us an equation: analyses that evaluate every
  equation of a body on each first call go without). jax 0.10's `get_bind_params`
  returns (subfuns, params) for call primitives, 0.12's the params alone."""
  bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
  subfuns, bound = bind_params if isinstance(bind_params, tuple) else ((), bind_params)
  if not source:
    outs = eqn.primitive.bind(*subfuns, *args, **bound)
  else:
    with equation_context(eqn):
      outs = eqn.primitive.bind(*subfuns, *args, **bound)
  return list(outs) if eqn.primitive.multiple_results else [outs]


def cache_weakly(cls: type) -> None:
  """JAX's own caches keyed by primitive parameters (abstract evaluation) hold
  instances of `cls` weakly, as they hold jaxprs: evicting a kernel from pallet's
  bounded caches then frees it."""
  from jax._src import util as _util
  _util.weakref_cache_key_types.add(cls)


def runs_on_cpu(prim: Any) -> bool:
  """Whether XLA on the CPU can run primitive `prim` (a lowering, or a state discharge
  rule into ones that have one): error messages point users at the XLA backend."""
  from jax._src.interpreters import mlir as _mlir
  return (prim in _mlir._lowerings or prim in _mlir._platform_specific_lowerings["cpu"]
          or prim in _discharge._discharge_rules)


# --- Triton backend: scan's parameters changed shape between JAX 0.10 and 0.12 ----
def scan_layout(params: dict) -> tuple[Any, tuple, int, int]:
  """(open jaxpr, consts, num_consts, num_carry) of a `scan` equation."""
  body = params["jaxpr"]
  jaxpr, consts = (body.jaxpr, tuple(body.consts)) if hasattr(body, "consts") else (body, ())
  if "num_consts" in params:
    return jaxpr, consts, params["num_consts"], params["num_carry"]
  n_in = len(jaxpr.invars)
  const_ids, carry_ids, _ = params["ft_in"].update(list(range(n_in))).unpack()
  return jaxpr, consts, len(list(const_ids)), len(list(carry_ids))

# --- concrete evaluation at trace time (XLA backend planning) ---------------------
# Index maps and reset predicates are evaluated on numbers while a kernel is being
# traced, possibly under jit/grad; `jax.ensure_compile_time_eval` does not escape
# every trace (linearize) in jax 0.12, this evaluates with the eager trace.
eval_context = _core.eval_context

# --- settings that jitted functions must see: part of JAX's trace context --------
from jax._src import config as _config


def trace_context_state(name: str, help: str) -> Any:
  """A thread-local setting (`state.value`; `with state(v):`) that JAX keys its jit
  caches on, so a function jitted under one value is traced again under another.
  Its default is the environment variable `name.upper()` (a string), else None."""
  return _config.string_or_object_state(name, None, help, include_in_jit_key=True,
                                        include_in_trace_context=True)


def trace_context() -> tuple:
  """Every setting JAX keys its jit caches on (x64, default matmul precision, dtype and
  rank promotion, default device, meshes, pallet's own trace settings, ...): what a
  cache of traced kernels must key on too."""
  return _config.trace_context()

# --- named grids: `lax.axis_index(name)` of a grid axis is that axis's program id ----
# The kernel is traced with the grid names in JAX's axis environment (so
# `lax.axis_size` answers) and a staging rule for axis_index_p that asks pallet
# for the program id first: nested jaxprs (cond, loops) capture it like any
# other traced value, so backends never see axis_index.
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import parallel as _parallel


def axis_env() -> tuple[tuple[Any, int], ...]:
  """(name, size) of every named axis in scope (shard_map's mesh axes in mesh order,
  vmap's named axes, a kernel's named grid), in the order they were bound."""
  return tuple(_core.get_axis_env().axis_sizes.items())


def extend_axis_env(name_size_pairs: list[tuple[Any, int]]) -> Any:
  return _core.extend_axis_env_nd(name_size_pairs)


def register_axis_index_substitution(lookup: Callable[[Any], Any]) -> None:
  """`lookup(axis_name)` returns the value `lax.axis_index(axis_name)` stands for
  while a pallet kernel is traced, or None to leave it to JAX."""
  previous = _pe.custom_staging_rules.get(_parallel.axis_index_p)

  def rule(trace, source_info, *tracers, axis_name, **params):
    value = lookup(axis_name)
    if value is not None:
      return trace.to_jaxpr_tracer(value, source_info)
    if previous is not None:
      return previous(trace, source_info, *tracers, axis_name=axis_name, **params)
    return trace.default_process_primitive(_parallel.axis_index_p, tracers,
                                           dict(axis_name=axis_name, **params), source_info)
  _pe.custom_staging_rules[_parallel.axis_index_p] = rule

# --- pallet's on/off settings (debug checks, poison buffers) ---------------------
# Read while kernels are traced, so they must be part of JAX's jit cache key: a
# function jitted with checks off is traced again when checks are switched on.
from jax._src import config as _jax_config


def bool_trace_setting(name: str, help: str) -> Any:
  """A JAX boolean state named `name` (default from the environment variable
  `name.upper()`), part of the jit key and trace context."""
  return _jax_config.bool_state(name, False, help, include_in_jit_key=True,
                                include_in_trace_context=True)


def jax_flag(name: str) -> bool:
  """The value of one of JAX's own boolean config flags; False where this JAX has
  no flag of that name."""
  return bool(getattr(jax.config, name, False))


def set_setting(state: Any, value: Any) -> None:
  """Sets a state's process-wide value (what `jax.config.update` does by name)."""
  state._set(value)

# --- shard_map and explicit sharding: an aval's varying manual axes and sharding ----
# JAX records in `aval.manual_axis_type.varying` which shard_map axes a value varies
# over (checked when `check_vma=True`), and in `aval.sharding` how an Explicit mesh
# splits it. pallet's executor runs on plain avals; these helpers move between them.
from jax.sharding import ManualAxisType


def varying_axes(x: Any) -> frozenset:
  """The mesh axes `x` (a value, aval or ShapeDtypeStruct) varies over; empty if none."""
  aval = x if isinstance(x, (_core.AbstractValue, jax.ShapeDtypeStruct)) else jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  return frozenset() if mat is None else frozenset(mat.varying)


def check_vma_enabled() -> bool:
  """True while tracing a `shard_map` body with `check_vma=True`."""
  return bool(_config._check_vma.value)


def vma_checks_off() -> Any:
  """Context in which kernels are traced: a kernel body sees plain blocks (its refs
  carry no varying axes), so JAX's vma checks have nothing to compare there."""
  return _config._check_vma(False)


def mesh_axes_indexed(jaxpr: Any) -> frozenset:
  """Mesh axes whose `lax.axis_index` a kernel reads (in nested jaxprs too): its
  outputs vary over them whatever its operands do."""
  names = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive is _parallel.axis_index_p:
      name = eqn.params["axis_name"]
      names.update(name if isinstance(name, tuple) else (name,))
    for sub in _core.jaxprs_in_params(eqn.params):
      names |= mesh_axes_indexed(sub)
  return frozenset(names)


def pvary(x: Any, axes: frozenset) -> Any:
  """`x` marked as varying over `axes` too (a no-op cast: same value on each device)."""
  missing = tuple(sorted(axes - varying_axes(x)))
  return _core.pvary(x, missing) if missing else x


def on_mesh_of(aval: Any, operands: Any, varying: frozenset, spec: tuple = ()) -> Any:
  """`aval` on the mesh of the first operand that has one, laid out as `spec`
  (replicated where it says nothing), varying over `varying` (the mesh a value varies
  over must be named in its type)."""
  mesh = next((o.sharding.mesh for o in operands
               if not getattr(getattr(o, "sharding", None), "mesh", _EMPTY_MESH).empty),
              None)
  if mesh is None:
    return aval
  spec = (*spec, *[None] * (aval.ndim - len(spec)))
  return aval.update(sharding=jax.sharding.NamedSharding(mesh, jax.P(*spec)),
                     manual_axis_type=ManualAxisType(varying=varying) if varying
                     else _core.empty_mat)


_EMPTY_MESH = _core._empty_sharding(0).mesh


def plain_aval(aval: Any) -> Any:
  """`aval` without varying axes and without a mesh sharding: what the executor sees."""
  return aval.update(manual_axis_type=_core.empty_mat,
                     sharding=_core._empty_sharding(len(aval.shape)))


def is_sharded(x: Any) -> bool:
  """Whether `x`'s type splits a dimension over (Explicit) mesh axes."""
  aval = x if isinstance(x, _core.AbstractValue) else jax.typeof(x)
  spec = getattr(getattr(aval, "sharding", None), "spec", ())
  return any(s is not None for s in spec)


def jaxlib_triton_kernel_call() -> Any:
  """jaxlib's Triton kernel-call module (serializes a compiled kernel into the
  custom call that launches it), or None where this jaxlib has none (no GPU plugin)."""
  try:
    from jax._src.lib import gpu_triton
  except ImportError:
    return None
  return gpu_triton if hasattr(gpu_triton, "TritonKernel") else None


# --- user-defined high-level types (JAX's hijax): pallet/core/hitypes.py -------------
try:
  from jax._src import hijax as _hijax
  HiType = _hijax.HiType
except (ImportError, AttributeError):   # a JAX without hijax: no value is hi-typed
  HiType = None


def hi_ref(ty: Any, lo_refs: Sequence[Any]) -> Any:
  """A ref of hi type `ty` made of its lo refs (what JAX hands a kernel for a hi ref)."""
  return _core.Ref(AbstractRef(ty), ty.raise_val(*lo_refs))


def lo_refs(ref: Any) -> list[Any]:
  """The lo refs a (plain, untransformed) ref of a hi type is made of."""
  return list(jax.typeof(ref).inner_aval.lower_val(ref._refs))


def trace_lowering(fn: Callable[..., Any], avals: Sequence[Any]) -> tuple[Any, list]:
  """(jaxpr, consts) of `fn` traced over `avals` in a trace that lowers as it goes:
  every operation on a hi-typed value or ref becomes its type's lo operations."""
  from jax._src import api_util, linear_util
  wrapped = linear_util.wrap_init(fn, debug_info=api_util.debug_info(
      "pallet hi-typed kernel", fn, tuple(avals), {}))
  jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(avals), lower=True)
  return jaxpr, list(consts)

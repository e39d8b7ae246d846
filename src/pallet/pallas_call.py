"""`pallas_call`: the user-facing launcher and the `pallas_call` primitive's rules.

`pallas_call(kernel, out_shape, ...)(*args)` resolves the specs into a
`GridMapping`, traces the kernel once into a `KernelDescription` and binds
`pallas_call_p`. The primitive's rules follow it: abstract evaluation, the
lowering (handed to the chosen backend), batching (a new leading grid axis) and
differentiation (through the kernel's discharged, pure form).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallet import backends
from pallet import _internals as internals
from pallet.core import checks
from pallet.core import bounded_slices
from pallet import checking
from pallet.core import closed_over
from pallet.core import dma
from pallet.core import grid_analysis
from pallet.core import gc_pause
from pallet.distributed import mesh_launch
from pallet.distributed import plain_call
from pallet.core import grid_mapping as gm_lib
from pallet.core import aliased_refs
from pallet.core import hitypes
from pallet.core import specs as specs_lib
from pallet.core import spec_trees
from pallet.core import static_bounds
from pallet.core import trace_cache
from pallet.core import tracebacks
from pallet.core import tracing
from pallet.core.grid_mapping import BlockDimension, GridMapping
from pallet.errors import PalletError

_DIMENSION_SEMANTICS = ("parallel", "arbitrary", "sequential", "core_parallel",
                        "subcore_parallel")
# Splitting an axis across (sub)cores means its steps run in any order: parallel.
_PARALLEL_SEMANTICS = ("parallel", "core_parallel", "subcore_parallel")


@tracebacks.api_boundary
def pallas_call(kernel: Callable[..., None], out_shape: Any, *,
                grid_spec: specs_lib.GridSpec | None = None, grid: Any = (),
                in_specs: Any = specs_lib.no_block_spec,
                out_specs: Any = specs_lib.no_block_spec,
                scratch_shapes: Sequence[Any] | dict[str, Any] = (),
                input_output_aliases: dict[int, int] | None = None,
                debug: bool = False, interpret: bool = False, name: str | None = None,
                compiler_params: Any = None, cost_estimate: Any = None,
                backend: str | None = None,
                metadata: dict[str, str] | None = None) -> Callable[..., Any]:
  """Returns a function that runs `kernel` over `grid` on its arguments.

  Same signature and meaning as `jax.experimental.pallas.pallas_call`; see
  docs/semantics.md. `backend` picks a backend by name ("xla", "triton"); the
  default is "triton" where a GPU is present and "xla" otherwise. A dict of
  `scratch_shapes` reaches the kernel as keyword arguments. `interpret=True`
  runs on the CPU backend (or, with backend="triton", the generated Triton code
  under Triton's interpreter). `metadata` is accepted and kept with the kernel
  (Pallas serialises it into the HLO for tools; pallet has no such consumer).
  """
  name = name or tracing.kernel_name(kernel)
  if isinstance(out_shape, list):   # results come back as a tuple, as in Pallas
    out_shape = tuple(out_shape)
  num_scalar_prefetch = 0
  if grid_spec is not None:
    grid, in_specs, out_specs = grid_spec.named_grid(), grid_spec.in_specs, grid_spec.out_specs
    scratch_shapes = grid_spec.scratch_shapes
    num_scalar_prefetch = grid_spec.num_scalar_prefetch
  grid, grid_names = gm_lib.split_grid_names(grid, name)
  grid, dynamic_sizes = gm_lib.normalize_grid(grid, name)
  # Alias keys count every operand of the call, scalar-prefetch ones included (as in Pallas).
  aliases = tuple(sorted((int(k), int(v)) for k, v in (input_output_aliases or {}).items()))
  dimension_semantics = _dimension_semantics(compiler_params, grid, name)

  @tracebacks.api_boundary
  @functools.wraps(kernel)
  def launch(*args):
    # Resolved per call: a `pallet.default_backend(...)` block around the call counts.
    try:
      backend_name, run_interpret = backends.resolve(backend, interpret, compiler_params)
      check_options = checking.options(interpret)
    except ValueError as e:
      raise PalletError(f"pallas_call of kernel '{name}': {e}") from None
    # hi-typed operands and results (JAX's hijax) run as their lo arrays: core/hitypes.py
    lowered = hitypes.lower_call(kernel, name, args, out_shape, in_specs, out_specs,
                                 num_scalar_prefetch, aliases)
    call = (kernel, args, out_shape, in_specs, out_specs) if lowered is None else (
        lowered.kernel, lowered.args, lowered.out_shape, lowered.in_specs, lowered.out_specs)
    with _checking_trace(check_options, poison=interpret is True), gc_pause.paused():
      results = _launch(call[0], name, *call[1:3], grid, dynamic_sizes, *call[3:],
                        specs_lib.scratch_tree(scratch_shapes), num_scalar_prefetch, aliases,
                        debug, backend_name, run_interpret, compiler_params,
                        dimension_semantics, grid_names, metadata, check_options)
    return results if lowered is None else lowered.raise_results(results)
  return launch


@contextlib.contextmanager
def _checking_trace(options: Any, poison: bool) -> Iterator[None]:
  """Checking mode traces kernels with fresh memory poisoned (and pl.debug_check on
  where asked), as the checks expect; see pallet/checking. `interpret=True` poisons
  too, as Pallas's interpreter does: unwritten outputs and the padding past an
  array's edge read as NaN there, so a kernel that depends on them shows it."""
  with contextlib.ExitStack() as stack:
    if poison or options is not None and options.uninitialized:
      stack.enter_context(checks.enable_poison_buffers(True))
    if options is not None and options.debug_checks:
      stack.enter_context(checks.enable_debug_checks(True))
    yield


def _dimension_semantics(params: Any, grid: tuple[int, ...], name: str):
  semantics = getattr(params, "dimension_semantics", None)
  if semantics is None:
    return None
  semantics = tuple(str(getattr(s, "value", s)).lower() for s in semantics)
  if len(semantics) != len(grid) or any(s not in _DIMENSION_SEMANTICS for s in semantics):
    raise PalletError(f"pallas_call of kernel '{name}': dimension_semantics {semantics} "
                      f"must give one of {_DIMENSION_SEMANTICS} per grid axis {grid}")
  return tuple("parallel" if s in _PARALLEL_SEMANTICS else "arbitrary" for s in semantics)


def _as_aval(x: Any, what: str, name: str, backend: str) -> jax.core.ShapedArray:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise PalletError(f"pallas_call of kernel '{name}': {what} must be an array or a "
                      f"jax.ShapeDtypeStruct, got {type(x).__name__}: {x!r}")
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    # Refs of typed keys run as JAX arrays of keys: the XLA backend takes them as is.
    if backend != "xla":
      raise PalletError(f"pallas_call of kernel '{name}': {what} is an array of typed PRNG "
                        f"keys ({x.dtype}{list(x.shape)}), which the {backend} backend "
                        f"cannot hold: pass jax.random.key_data(key) and seed with it in "
                        f"the kernel (pltpu.prng_seed), or run on the default XLA backend")
    return jax.core.ShapedArray(tuple(x.shape), x.dtype)
  # float64 is float32 (int64 int32, ...) unless jax_enable_x64 is on, as for JAX's arrays
  return jax.core.ShapedArray(tuple(x.shape), jax.dtypes.canonicalize_dtype(x.dtype))


def _as_operand(x: Any) -> Any:
  """Python and NumPy scalars become (weakly typed) 0-d arrays, as in Pallas, and NumPy
  arrays JAX arrays: both of JAX's dtype for them (float32 for float64 unless
  jax_enable_x64 is on)."""
  if isinstance(x, (bool, int, float, complex, np.generic, np.ndarray)):
    return jnp.asarray(x)
  return x


def _launch(kernel, name, args, out_shape, grid, dynamic_sizes, in_specs, out_specs, scratch_shapes,
            num_scalar_prefetch, aliases, debug, backend_name, interpret,
            compiler_params, dimension_semantics, grid_names, metadata, check_options=None):
  args = jax.tree_util.tree_map(_as_operand, tuple(args))
  if len(args) < num_scalar_prefetch:
    raise PalletError(f"pallas_call of kernel '{name}' expects {num_scalar_prefetch} "
                      f"scalar-prefetch operands first, but was called with {len(args)} "
                      f"operands")
  prefetch_args, args = args[:num_scalar_prefetch], args[num_scalar_prefetch:]
  flat_args, _ = jax.tree_util.tree_flatten(args)
  in_avals = [_as_aval(a, f"input {i}", name, backend_name) for i, a in enumerate(flat_args)]
  # A scalar-prefetch operand may be a pytree of arrays (megablox's group metadata).
  flat_prefetch, prefetch_tree = jax.tree_util.tree_flatten(tuple(prefetch_args))
  prefetch_avals = tuple(_as_aval(a, f"scalar prefetch operand {i}", name, backend_name)
                         for i, a in enumerate(flat_prefetch))
  flat_out_shapes, out_tree = jax.tree_util.tree_flatten(out_shape)
  out_avals = [_as_aval(o, f"out_shape[{i}]", name, backend_name)
               for i, o in enumerate(flat_out_shapes)]
  # Scratch shapes may be pytrees; None entries are empty (the kernel gets None there).
  is_scratch = lambda x: isinstance(x, specs_lib.ScratchShape)
  flat_scratch_paths = jax.tree_util.tree_flatten_with_path(scratch_shapes, is_leaf=is_scratch)[0]
  scratch_avals = tuple(_as_aval(s, f"scratch_shapes{jax.tree_util.keystr(path)}", name,
                                         backend_name)
                        for path, s in flat_scratch_paths)

  # The kernel is called as kernel(*prefetch refs, *input refs, *output refs, *scratch
  # refs, **keyword scratch refs), with pytree inputs and outputs handed over as pytrees
  # of refs; the flat refs come in that order (a dict's keys sorted, as JAX flattens it).
  outs_for_kernel = tuple(out_shape) if isinstance(out_shape, (tuple, list)) else (out_shape,)
  positional_scratch, keyword_scratch = specs_lib.scratch_arguments(scratch_shapes)
  positional = (*prefetch_args, *args, *outs_for_kernel, *positional_scratch)
  kernel_args_tree = jax.tree_util.tree_structure((positional, keyword_scratch),
                                                  is_leaf=is_scratch)

  def build():
    _check_kernel_arity(kernel, name, len(positional), len(prefetch_args), len(args),
                        len(outs_for_kernel), len(positional_scratch), tuple(keyword_scratch))
    mapping = _grid_mapping(kernel, name, args, out_shape, grid, in_specs, out_specs,
                            in_avals, out_avals, scratch_avals, prefetch_avals,
                            prefetch_tree, num_scalar_prefetch, dimension_semantics)
    description = closed_over.lift(aliased_refs.merge(tracing.trace_kernel(
        kernel, name, mapping, kernel_args_tree, source=tracing.kernel_source(kernel),
        input_output_aliases=_check_aliases(aliases, len(prefetch_avals), in_avals,
                                            out_avals, name),
        compiler_params=compiler_params, debug=debug, grid_names=grid_names,
        metadata=metadata, poison_buffers=checks.poison_buffers_enabled())))
    bounded_slices.check_static(description)
    static_bounds.check(description)
    return description

  # Everything the traced description depends on (docs/caching.md): the call's
  # arguments, the settings read while tracing (JAX's whole trace context: x64,
  # default matmul precision, promotion rules, ...), the mesh axes in scope
  # (`lax.axis_size` and remote device ids resolve on them) and where it runs. The
  # kernel's own Python code is keyed by content (trace_cache.freeze_callable).
  key = (name, grid, grid_names, kernel_args_tree, tuple(in_avals), tuple(out_avals),
         scratch_avals, prefetch_avals, in_specs, out_specs, aliases, compiler_params,
         dimension_semantics, debug, metadata, checks.debug_checks_enabled(),
         checks.poison_buffers_enabled(), internals.trace_context(), internals.axis_env(),
         backend_name, interpret, check_options)
  with internals.vma_checks_off():
    description = trace_cache.lookup(kernel, key, build)
  if debug:
    print(f"--- pallet kernel '{name}' ({description.source}), grid {grid} ---")
    print(description.jaxpr)
  flat_prefetch = [jnp.asarray(p) for p in flat_prefetch]
  sizes = [jnp.asarray(d, jnp.int32) for d in dynamic_sizes]
  bounded_slices.check(description, flat_prefetch)
  flat_args = [*flat_args, *closed_over.operands(description)]
  bind = functools.partial(pallas_call_p.bind, name=name, backend=backend_name,
                           interpret=interpret)
  if mesh_launch.talks_to_devices(description):
    # The whole mesh in lockstep, on the XLA backend (see pallet/distributed/mesh_launch.py).
    backend_name = "xla"
    bind = functools.partial(mesh_launch.launch, bind=functools.partial(
        pallas_call_p.bind, name=name, backend=backend_name, interpret=interpret))
    check_options = mesh_launch.checks_that_apply(check_options, name)
  if check_options is None:
    results = bind(*sizes, *flat_prefetch, *flat_args, kernel=description)
  else:
    results = checking.run(description, check_options, gm_lib.kernel_parameter_names(kernel),
                           bind, sizes, flat_prefetch, flat_args, backend_name,
                           concurrent=backend_name != "xla" and not interpret)
  results = closed_over.write_back(description, results)
  results = [_annotated(r, o, i, name, description.source)
             for i, (r, o) in enumerate(zip(results, flat_out_shapes))]
  return jax.tree_util.tree_unflatten(out_tree, results)


def _annotated(result: Any, out_shape: Any, i: int, name: str, source: str) -> Any:
  """Applies Pallas's `ShapeDtypeStruct(..., manual_axis_type=ManualAxisType(varying=...))`
  inside `shard_map(check_vma=True)`: the output varies over those axes too. Fewer axes
  than the operands vary over would claim equal values pallet cannot check: an error."""
  if getattr(out_shape, "manual_axis_type", None) is None or not internals.check_vma_enabled():
    return result
  wanted, inferred = internals.varying_axes(out_shape), internals.varying_axes(result)
  if not inferred <= wanted:
    raise PalletError(f"pallas_call of kernel '{name}' ({source}): out_shape[{i}] is "
                      f"annotated as varying over mesh axes {sorted(wanted)}, but it must "
                      f"vary over {sorted(inferred)}: an output varies over every axis its "
                      f"operands vary over and every axis whose axis_index the kernel "
                      f"reads (leave out manual_axis_type to get that)")
  return internals.pvary(result, wanted)


def _grid_mapping(kernel, name, args, out_shape, grid, in_specs, out_specs, in_avals,
                  out_avals, scratch_avals, prefetch_avals, prefetch_tree, n_pre,
                  dimension_semantics) -> GridMapping:
  """Resolves the specs against the operands (all spec validation happens here)."""
  param_names = gm_lib.kernel_parameter_names(kernel) or []

  def origin(kind, i, offset):
    pname = param_names[offset + i] if offset + i < len(param_names) else None
    return f"{kind} {i}" + (f" ('{pname}')" if pname else "")

  def where(kind, i, offset, spec_name):
    return f"pallas_call of kernel '{name}', {spec_name} for {origin(kind, i, offset)}"

  def operand_name(kind, offset, tree):
    def named(path):   # "input 1 ('w_ref').scale": the argument, then inside it
      if isinstance(tree, (tuple, list)) and isinstance(path[0], jax.tree_util.SequenceKey):
        return origin(kind, path[0].idx, offset) + jax.tree_util.keystr(path[1:])
      return f"{kind} {jax.tree_util.keystr(path)}"
    return named

  in_spec_list = spec_trees.match_specs(in_specs, args, what="in_specs", kernel_name=name,
                                        operand_name=operand_name("input", n_pre, args))
  out_spec_list = spec_trees.match_specs(
      out_specs, out_shape, what="out_specs", kernel_name=name,
      operand_name=operand_name("output", n_pre + len(args), out_shape))
  inputs = tuple(
      gm_lib.block_mapping(s, a, origin("input", i, n_pre), grid, prefetch_avals,
                           where("input", i, n_pre, f"in_specs[{i}]"), prefetch_tree,
                           kernel_name=name)
      for i, (s, a) in enumerate(zip(in_spec_list, in_avals)))
  outputs = tuple(
      gm_lib.block_mapping(s, a, origin("output", i, n_pre + len(in_avals)), grid,
                           prefetch_avals,
                           where("output", i, n_pre + len(in_avals), f"out_specs[{i}]"),
                           prefetch_tree, output=True, kernel_name=name)
      for i, (s, a) in enumerate(zip(out_spec_list, out_avals)))
  return GridMapping(grid=grid, inputs=inputs, outputs=outputs,
                     scratch_avals=scratch_avals, prefetch_avals=prefetch_avals,
                     dimension_semantics=dimension_semantics)


def _check_aliases(aliases, n_prefetch, in_avals, out_avals, name):
  """Validates `{operand index: output index}`; returns pairs over the non-prefetch inputs."""
  resolved = []
  for k, o in aliases:
    i = k - n_prefetch
    if not (0 <= i < len(in_avals) and 0 <= o < len(out_avals)):
      raise PalletError(f"pallas_call of kernel '{name}': input_output_aliases entry "
                        f"{k}: {o} is out of range ({n_prefetch} scalar-prefetch operands "
                        f"+ {len(in_avals)} inputs, {len(out_avals)} outputs; scalar-"
                        f"prefetch operands cannot be aliased)")
    if (in_avals[i].shape, in_avals[i].dtype) != (out_avals[o].shape, out_avals[o].dtype):
      raise PalletError(f"pallas_call of kernel '{name}': input_output_aliases {k}: {o} "
                        f"pairs input {in_avals[i].str_short()} with output "
                        f"{out_avals[o].str_short()}; shapes and dtypes must match")
    resolved.append((i, o))
  return tuple(resolved)


def _check_kernel_arity(kernel, name, n_refs, n_prefetch, n_in, n_out, n_scratch,
                        keywords=()):
  """Python's own TypeError would name neither the kernel nor what pallas_call passes."""
  if gm_lib.accepts_call(kernel, n_refs, keywords):
    return
  params = gm_lib.kernel_parameter_names(kernel)
  parts = [f"{n_in} inputs", f"{n_out} outputs"]
  if n_prefetch:
    parts.insert(0, f"{n_prefetch} scalar-prefetch operands")
  if n_scratch:
    parts.append(f"{n_scratch} scratch buffers")
  if keywords:
    raise gm_lib.PalletSignatureError(
        f"kernel '{name}' takes parameters ({', '.join(params or [])}) but pallas_call "
        f"passes {n_refs} refs by position ({', '.join(parts)}) and the scratch_shapes "
        f"dict's refs by keyword ({', '.join(keywords)})")
  required, total = gm_lib.positional_arity_range(kernel)
  arity = str(required) if required == total else (
      f"{required} to {total}" if total is not None else f"at least {required}")
  raise gm_lib.PalletSignatureError(
      f"kernel '{name}' takes {arity} positional parameters ({', '.join(params or [])}) "
      f"but pallas_call passes {n_refs} refs: {', '.join(parts)}")


# =================================================================== the primitive
pallas_call_p = Primitive("pallas_call")
pallas_call_p.multiple_results = True


def _pallas_call_abstract_eval(*avals, kernel, name, backend, interpret):
  # Inside shard_map an output varies over every mesh axis some operand varies over:
  # each device's kernel reads its own operands (see docs/distributed.md).
  varying = _union_varying(avals)
  if internals.check_vma_enabled():
    varying |= _mesh_axes_indexed(kernel)
  specs = _explicit_out_specs(kernel, avals)
  return [internals.on_mesh_of(jax.core.ShapedArray(b.array_shape, b.dtype), avals, varying,
                               spec)
          for b, spec in zip(kernel.grid_mapping.outputs, specs)]


def _explicit_out_specs(kernel: tracing.KernelDescription, avals) -> list[tuple]:
  """On an Explicit mesh: an output dimension tiled by a grid axis that could run
  split (see partitioning.py) takes the sharding of an input dimension tiled the same
  way, so the result stays sharded like its operands; otherwise it is replicated."""
  gm = kernel.grid_mapping
  specs = [[None] * len(b.array_shape) for b in gm.outputs]
  n_pre = len(gm.dynamic_axes) + len(gm.prefetch_avals)
  inputs = avals[n_pre:]
  if not any(internals.is_sharded(a) for a in inputs):
    return specs
  used = set()
  for axis in _split_candidates(kernel):
    entries = [a.sharding.spec[d] for i, d in axis.dims.items()
               if i < len(inputs) and d < len(inputs[i].sharding.spec)
               for a in [inputs[i]] if a.sharding.spec[d] is not None]
    if not entries:
      continue
    names = entries[0] if isinstance(entries[0], tuple) else (entries[0],)
    if used & set(names):
      continue
    used |= set(names)
    for i, d in axis.dims.items():
      if i >= len(inputs):
        specs[i - len(inputs)][d] = entries[0]
  return specs


@trace_cache.kernel_cache
def _split_candidates(kernel: tracing.KernelDescription) -> tuple:
  from pallet.distributed import partitioning
  return tuple(partitioning.split_candidates(kernel)[0])


@trace_cache.kernel_cache
def _mesh_axes_indexed(kernel: tracing.KernelDescription) -> frozenset:
  return internals.mesh_axes_indexed(kernel.jaxpr.jaxpr)


def _union_varying(values: Sequence[Any]) -> frozenset:
  return frozenset().union(*(internals.varying_axes(v) for v in values))


pallas_call_p.def_abstract_eval(_pallas_call_abstract_eval)


def _pallas_call_impl(*args, **params):
  # Under `jax.disable_jit()` the jit below would call straight back into this
  # rule; a kernel always runs compiled, so jit is re-enabled for the call itself.
  with jax.disable_jit(False):
    return _compiled_call(params["kernel"], params["name"], params["backend"],
                          params["interpret"])(*args)


@trace_cache.kernel_cache
def _compiled_call(kernel, name, backend, interpret):
  return jax.jit(lambda *args: pallas_call_p.bind(
      *args, kernel=kernel, name=name, backend=backend, interpret=interpret))


pallas_call_p.def_impl(_pallas_call_impl)


def _pallas_call_lowering(ctx, *args, kernel, name, backend, interpret):
  # -- automatic partitioning hook (pallet/distributed/partitioning.py): a jit over several devices
  # runs the kernel shard-locally where its grid lines up with the shardings.
  from pallet.distributed import partitioning
  if partitioning.multi_device(ctx):
    lowered = partitioning.lower(ctx, args, lambda k, a: pallas_call_p.bind(
        *a, kernel=k, name=name, backend=backend, interpret=interpret), kernel, backend)
    if lowered is not None:
      return lowered
  # -- end of the partitioning hook
  # Backends see plain per-device avals: varying axes and mesh shardings are the
  # caller's business (the lowered HLO is the same, and the kernel body is traced
  # without them, as one program instance sees only its blocks).
  ctx = ctx.replace(avals_in=[internals.plain_aval(a) for a in ctx.avals_in],
                    avals_out=[internals.plain_aval(a) for a in ctx.avals_out])
  with internals.vma_checks_off(), gc_pause.paused():
    return backends.get(backend, kernel).lower(ctx, *args, kernel=kernel,
                                               interpret=interpret)


mlir.register_lowering(pallas_call_p, _pallas_call_lowering)
# (partitioning hook) the lowering above needs the devices and mesh of a multi-device jit.
internals.require_devices_during_lowering(pallas_call_p)


# ------------------------------------------------------------------ batching
_NOT_MAPPED = None  # how JAX's batching rules mark an unbatched operand

def _pallas_call_batching(args, dims, *, kernel, name, backend, interpret):
  """vmap adds a leading parallel grid axis; batched operands get a squeezed block dim."""
  gm = kernel.grid_mapping
  # leading operands: traced grid sizes, then scalar prefetch; batched ones need a loop
  n_pre = len(gm.dynamic_axes) + len(gm.prefetch_avals)
  if any(d is not _NOT_MAPPED for d in dims[:n_pre]) or _carries_state(kernel):
    return _batch_by_loop(args, dims, kernel=kernel, name=name, backend=backend,
                          interpret=interpret)
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
  aliased_inputs = {i for i, _ in kernel.input_output_aliases}
  new_args, batched = list(args[:n_pre]), []
  for i, (a, d) in enumerate(zip(args[n_pre:], dims[n_pre:])):
    if d is _NOT_MAPPED and i in aliased_inputs:
      a, d = jax.lax.broadcast(a, (size,)), 0
    if d is not _NOT_MAPPED:
      a = _batch_axis_first(a, d)
    new_args.append(a)
    batched.append(d is not _NOT_MAPPED)
  new_inputs = tuple(_batched_block(b, size, is_batched)
                     for b, is_batched in zip(gm.inputs, batched))
  new_outputs = tuple(_batched_block(b, size, True) for b in gm.outputs)
  semantics = None if gm.dimension_semantics is None else ("parallel", *gm.dimension_semantics)
  new_gm = gm.replace(grid=(size, *gm.grid), inputs=new_inputs, outputs=new_outputs,
                      dimension_semantics=semantics)
  new_kernel = kernel.replace(grid_mapping=new_gm, jaxpr=_with_leading_index(kernel.jaxpr))
  outs = pallas_call_p.bind(*new_args, kernel=new_kernel, name=name, backend=backend,
                            interpret=interpret)
  return outs, [0] * len(outs)


_INDEX = jax.core.ShapedArray((), jnp.int32)


def _batch_axis_first(a: Any, d: int) -> Any:
  """`jnp.moveaxis(a, d, 0)` as one lax op: jnp's is a jitted function, traced anew for
  every shape on a first call."""
  if d == 0:
    return a
  return jax.lax.transpose(a, (d, *[k for k in range(jnp.ndim(a)) if k != d]))


def _with_leading_index(closed_jaxpr: Any) -> Any:
  """The same jaxpr with one more (ignored) int32 input in front (not traced again:
  the kernel body is the bulk of a first call's tracing)."""
  return internals.with_leading_inputs(closed_jaxpr, [_INDEX])


def _batched_block(block, size, is_batched):
  # index map (b, *ids) -> (b, *block indices), or the block indices when unbatched
  new_jaxpr = internals.with_leading_inputs(block.index_map, [_INDEX], as_outputs=is_batched)
  if not is_batched:
    return block.replace(index_map=new_jaxpr)
  return block.replace(index_map=new_jaxpr, array_shape=(size, *block.array_shape),
                       dims=(BlockDimension("squeezed", 1), *block.dims))


def _carries_state(kernel: tracing.KernelDescription) -> bool:
  """Whether grid steps hand state to later ones beyond the outputs: DMAs and
  semaphores, or writes to scalar-prefetch refs (SMEM on a TPU; paged attention keeps
  flags there). Each batch element must then start afresh, not where the last ended."""
  return dma.uses_dmas(kernel.jaxpr.jaxpr) or grid_analysis.writes_prefetch(kernel)


def _batch_by_loop(args, dims, **params):
  """Fallback when scalar-prefetch operands are batched, or the kernel carries state
  from step to step (see `_carries_state`): one launch per batch element."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
  moved = [a if d is _NOT_MAPPED else _batch_axis_first(a, d)
           for a, d in zip(args, dims)]
  is_batched = [d is not _NOT_MAPPED for d in dims]

  def one(i):
    sliced = [a[i] if b else a for a, b in zip(moved, is_batched)]
    return pallas_call_p.bind(*sliced, **params)

  outs = jax.lax.map(one, jnp.arange(size))
  return outs, [0] * len(outs)


batching.primitive_batchers[pallas_call_p] = _pallas_call_batching


# ------------------------------------------------------------------ differentiation
def _pallas_call_jvp(primals, tangents, *, kernel, name, backend, interpret):
  """Derivatives come from the kernel's pure (discharged) form, so `jax.grad` works.

  Tangents are computed by XLA from the same kernel description, which JAX can then
  transpose for reverse mode. On the XLA backend that computation yields the primal
  too; any other backend still runs the primal itself.
  """
  with gc_pause.paused():
    return _jvp(primals, tangents, kernel=kernel, name=name, backend=backend,
                interpret=interpret)


def _jvp(primals, tangents, *, kernel, name, backend, interpret):
  from pallet.backends.xla import differentiable_function
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  avals = tuple(jax.core.ShapedArray(jnp.shape(p), jnp.result_type(p)) for p in primals)
  with internals.vma_checks_off():   # planning traces the kernel body
    fn = differentiable_function(kernel, avals)
  also = _mesh_axes_indexed(kernel) if internals.check_vma_enabled() else frozenset()
  if also or _union_varying(primals) or any(internals.is_sharded(p) for p in primals):
    # Inside shard_map or on an Explicit mesh: tangents behind a primitive boundary
    # that sees plain per-device arrays (see plain_call.py).
    primal_out = pallas_call_p.bind(*primals, kernel=kernel, name=name, backend=backend,
                                    interpret=interpret)
    specs = tuple(tuple(jax.typeof(o).sharding.spec) if internals.is_sharded(o) else ()
                  for o in primal_out)
    return list(primal_out), plain_call.linear_call(fn, primals, tangents, also,
                                                    specs if any(specs) else None)
  primal_out, tangent_out = jax.jvp(fn, tuple(primals), tuple(tangents))
  if backend != "xla":
    primal_out = pallas_call_p.bind(*primals, kernel=kernel, name=name, backend=backend,
                                    interpret=interpret)
  loop = _float_while_loop(kernel)
  if loop is not None:
    primal_avals = tuple(jax.core.ShapedArray(p.shape, p.dtype) for p in primals)
    tangent_out = [_reverse_mode_guard_p.bind(t, fn=fn, kernel=kernel, loop=loop,
                                              primal_avals=primal_avals)
                   for t in tangent_out]
  return list(primal_out), list(tangent_out)


ad.primitive_jvps[pallas_call_p] = _pallas_call_jvp


def _float_while_loop(kernel: tracing.KernelDescription) -> Any:
  """The first `while` equation of the kernel (a while_loop, or a fori_loop whose trip
  count is traced) that carries floating-point values or refs, or None."""
  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "while" and any(
          jnp.issubdtype(getattr(v.aval, "dtype", jnp.int32), jnp.inexact)
          for v in (*eqn.invars, *eqn.outvars)):
        return eqn
      for param in eqn.params.values():
        for sub in (param if isinstance(param, (tuple, list)) else (param,)):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns") and (found := walk(sub)) is not None:
            return found
    return None
  return walk(kernel.jaxpr.jaxpr)


# Tangents of a kernel with such a loop pass through this identity; its transpose runs
# before JAX reaches the loop in reverse mode, and tells in the kernel's terms when
# JAX cannot transpose the loop (forward mode is unaffected).
_reverse_mode_guard_p = Primitive("pallet_reverse_mode_guard")
_reverse_mode_guard_p.def_impl(lambda t, **_: t)
_reverse_mode_guard_p.def_abstract_eval(lambda aval, **_: aval)
mlir.register_lowering(_reverse_mode_guard_p, lambda ctx, t, **_: [t])
batching.primitive_batchers[_reverse_mode_guard_p] = (
    lambda args, dims, **params: (_reverse_mode_guard_p.bind(*args, **params), dims[0]))


def _reverse_mode_guard_transpose(ct, t, *, fn, kernel, loop, primal_avals):
  del t
  try:
    jax.eval_shape(functools.partial(_pullback_of_zeros, fn), *primal_avals)
  except ValueError as e:
    if "Reverse-mode differentiation does not work" not in str(e):
      raise
    src = internals.equation_source(loop)
    line = f"{src[0]}:{src[1]}" if src else kernel.source
    raise PalletError(
        f"kernel '{kernel.name}' ({kernel.source}) at {line}: reverse-mode "
        f"differentiation (jax.grad, jax.vjp) cannot go through this lax.while_loop or "
        f"lax.fori_loop, whose trip count is only known at run time; expected a static "
        f"trip count (fori_loop with Python int bounds, which runs as a scan), or use "
        f"forward mode (jax.jvp, jax.jacfwd)") from None
  return [ct]


def _pullback_of_zeros(fn, *primals):
  out, pullback = jax.vjp(fn, *primals)
  return pullback(jax.tree_util.tree_map(jnp.zeros_like, out))


ad.primitive_transposes[_reverse_mode_guard_p] = _reverse_mode_guard_transpose
ad.primitive_jvps[_reverse_mode_guard_p] = (
    lambda primals, tangents, **params: (_reverse_mode_guard_p.bind(*primals, **params),
                                         _reverse_mode_guard_p.bind(
                                             ad.instantiate_zeros(tangents[0]), **params)))

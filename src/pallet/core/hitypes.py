"""User-defined high-level types (JAX's `hijax.HiType`) as operands of `pallas_call` and
of `pltpu.emit_pipeline`.

A hi-typed value (say a pair of arrays) is one operand to the user but several ordinary
arrays to everything below: its type lowers it (`lo_ty`, `lower_val`), raises it back
(`raise_val`), cuts a block spec into one per lo array (`lower_block_spec`) and reads or
writes a block through a ref (`ref_get_to_lojax`, `ref_swap_to_lojax`). pallet meets
such a type at its two boundaries in one step, as Pallas lowers a hi `pallas_call`:

- a `pallas_call` lowers each hi operand and `out_shape` entry to its lo arrays, with
  the type's lo block specs, and runs on those; the kernel gets a hi ref made of the
  lo refs, and is traced in a lowering trace, so each read or write of a hi ref becomes
  the type's lo reads and writes at once (the kernel's jaxpr, and so every backend and
  checking mode, only ever see lo refs); results are raised back to hi values.
- a pipeline over hi refs is the pipeline over their lo refs, with the lo block specs;
  its body gets hi refs made of the lo block buffers.

Without hijax in JAX no value is hi-typed and none of this applies.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
from jax.extend.core import Primitive

from pallet import _internals as internals
from pallet.core import specs as specs_lib
from pallet.core import spec_trees
from pallet.errors import PalletError


def is_hi_type(aval: Any) -> bool:
  return internals.HiType is not None and isinstance(aval, internals.HiType)


def _value_type(x: Any) -> Any:
  """The hi type of an operand value, or None for an ordinary one."""
  if internals.HiType is None or x is None:
    return None
  try:
    aval = jax.typeof(x)
  except TypeError:   # not a JAX value: pallas_call reports it as such
    return None
  return aval if is_hi_type(aval) else None


def _ref_type(ref: Any) -> Any:
  """The hi type a ref holds, or None (views of hi refs are refused where met)."""
  if internals.HiType is None or isinstance(ref, internals.TransformedRef):
    return None
  aval = jax.typeof(ref)
  inner = getattr(aval, "inner_aval", None)
  return inner if is_hi_type(inner) else None


# ------------------------------------------------------------------ values across a call
# Lowering and raising a value are operations of their own: on concrete values they run
# at once; under jax.jit they are staged and lowered when JAX lowers the jitted program.
_lower_p = Primitive("pallet_hi_lower")
_lower_p.multiple_results = True
_lower_p.is_high = lambda *avals, ty: True
_lower_p.to_lojax = lambda x, *, ty: list(ty.lower_val(x))
_lower_p.def_abstract_eval(lambda aval, *, ty: list(ty.lo_ty()))

_raise_p = Primitive("pallet_hi_raise")
_raise_p.is_high = lambda *avals, ty: True
_raise_p.to_lojax = lambda *los, ty: ty.raise_val(*los)
_raise_p.def_abstract_eval(lambda *avals, ty: ty)


# ------------------------------------------------------------------ one operand tree
@dataclasses.dataclass(frozen=True)
class _Tree:
  """An operand tree whose hi-typed leaves are lowered: per leaf its hi type (None for
  an ordinary leaf) and spec. A hi leaf becomes a tuple of its lo leaves in the lo
  tree, and its spec the tuple of the type's lo specs."""
  treedef: Any
  types: tuple[Any, ...]
  specs: tuple[Any, ...]
  where: str

  def lo_specs(self) -> Any:
    return self.treedef.unflatten([_lo_specs(t, s, self.where) if t is not None else s
                                   for t, s in zip(self.types, self.specs)])

  def lo_values(self, leaves: Sequence[Any], lower: Callable[[Any, Any], Any]) -> Any:
    return self.treedef.unflatten([tuple(lower(x, t)) if t is not None else x
                                   for x, t in zip(leaves, self.types)])

  def raise_refs(self, lo_tree: Any) -> Any:
    """The tree the user sees: each hi leaf's lo refs made one hi ref of its block."""
    leaves = self.treedef.flatten_up_to(lo_tree)
    return self.treedef.unflatten([
        internals.hi_ref(_block_type(t, s, self.where), r) if t is not None else r
        for r, t, s in zip(leaves, self.types, self.specs)])


def _lo_specs(ty: Any, spec: Any, where: str) -> tuple[Any, ...]:
  n = len(ty.lo_ty())
  if spec is None or spec is specs_lib.no_block_spec:
    return (specs_lib.no_block_spec,) * n
  lower = getattr(ty, "lower_block_spec", None)
  if lower is None:
    raise PalletError(f"{where}: the hi type {ty} has a BlockSpec but no "
                      f"lower_block_spec method to cut it into one per lo array")
  lo = tuple(lower(spec))
  if len(lo) != n:
    raise PalletError(f"{where}: {type(ty).__name__}.lower_block_spec gave {len(lo)} "
                      f"block specs for its {n} lo arrays")
  return lo


def _block_type(ty: Any, spec: Any, where: str) -> Any:
  """The hi type of one block: the whole type for a whole-array spec, else the type
  with the block's shape (its squeezed dimensions dropped)."""
  if not isinstance(spec, specs_lib.BlockSpec) or spec.block_shape is None:
    return ty
  shape = []
  for d in spec.block_shape:
    if d is None or isinstance(d, specs_lib.Squeezed):
      continue
    shape.append(int(getattr(d, "block_size", d)))
  if tuple(shape) == tuple(ty.shape):
    return ty
  if not hasattr(ty, "update"):
    raise PalletError(f"{where}: a block of the hi type {ty} needs the type's "
                      f"update(shape=...) method to give the block's type")
  return ty.update(shape=tuple(shape))


def _lower_value(x: Any, ty: Any) -> list[Any]:
  return _lower_p.bind(x, ty=ty)


def _lo_shapes(ty: Any, _: Any) -> list[jax.ShapeDtypeStruct]:
  return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ty.lo_ty()]


# ------------------------------------------------------------------ pallas_call
@dataclasses.dataclass(frozen=True)
class LoweredCall:
  """A pallas_call with its hi-typed operands and results lowered (see the module)."""
  kernel: Callable[..., None]
  args: tuple[Any, ...]
  out_shape: Any
  in_specs: Any
  out_specs: Any
  raise_results: Callable[[Any], Any]


def lower_call(kernel: Callable[..., None], name: str, args: Sequence[Any], out_shape: Any,
               in_specs: Any, out_specs: Any, num_scalar_prefetch: int,
               aliases: Sequence[Any]) -> LoweredCall | None:
  """The call over lo values, or None where no operand or result is hi-typed."""
  if internals.HiType is None:
    return None
  prefetch, operands = tuple(args[:num_scalar_prefetch]), tuple(args[num_scalar_prefetch:])
  in_leaves, in_tree = jax.tree_util.tree_flatten(operands)
  out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
  in_types = [_value_type(x) for x in in_leaves]
  out_types = [o if is_hi_type(o) else None for o in out_leaves]
  if not any(t is not None for t in in_types + out_types):
    return None
  where = f"pallas_call of kernel '{name}'"
  if any(_value_type(x) is not None for x in jax.tree_util.tree_leaves(prefetch)):
    raise PalletError(f"{where}: a scalar-prefetch operand is hi-typed; only inputs and "
                      f"outputs may be")
  if aliases:
    raise PalletError(f"{where}: input_output_aliases with hi-typed operands are not "
                      f"supported")
  single = not isinstance(out_shape, tuple)
  ins = _Tree(in_tree, tuple(in_types), tuple(spec_trees.match_specs(
      in_specs, operands, what="in_specs", kernel_name=name,
      operand_name=lambda p: f"input {jax.tree_util.keystr(p)}")), where)
  outs = _Tree(out_tree, tuple(out_types), tuple(spec_trees.match_specs(
      out_specs, out_shape, what="out_specs", kernel_name=name,
      operand_name=lambda p: f"output {jax.tree_util.keystr(p)}")), where)
  lo_out_shape = outs.lo_values(out_leaves, _lo_shapes)
  lo_out_specs = outs.lo_specs()
  n_in, n_out = len(operands), 1 if single else len(out_shape)

  def lo_kernel(*refs: Any, **keyword_refs: Any) -> None:
    def hi_kernel(pre, in_refs, out_refs, rest, kw):
      hi_outs = outs.raise_refs(out_refs[0] if single else tuple(out_refs))
      result = kernel(*pre, *ins.raise_refs(tuple(in_refs)),
                      *((hi_outs,) if single else hi_outs), *rest, **kw)
      if result is not None:
        raise PalletError(f"kernel '{name}' returned a value ({type(result).__name__}); "
                          f"kernels write their results into output refs and return None")
    split = (refs[:num_scalar_prefetch], refs[num_scalar_prefetch:num_scalar_prefetch + n_in],
             refs[num_scalar_prefetch + n_in:num_scalar_prefetch + n_in + n_out],
             refs[num_scalar_prefetch + n_in + n_out:], keyword_refs)
    run_lowering(hi_kernel, *split)

  lo_kernel.__wrapped__ = kernel   # the user's signature, name and source
  lo_kernel.__name__ = getattr(kernel, "__name__", name)

  def raise_results(results: Any) -> Any:
    leaves = out_tree.flatten_up_to(results[0] if single else results)
    return out_tree.unflatten([_raise_p.bind(*r, ty=t) if t is not None else r
                               for r, t in zip(leaves, out_types)])

  return LoweredCall(
      kernel=lo_kernel, args=prefetch + ins.lo_values(in_leaves, _lower_value),
      out_shape=(lo_out_shape,) if single else lo_out_shape,
      in_specs=ins.lo_specs(), out_specs=(lo_out_specs,) if single else lo_out_specs,
      raise_results=raise_results)


def run_lowering(fn: Callable[..., None], *args: Any) -> None:
  """Runs `fn(*args)` (pytrees of refs and values) traced in a lowering trace and
  inlined here: its hi-typed operations become lo ones before any of pallet sees them."""
  leaves, tree = jax.tree_util.tree_flatten(args)

  def flat(*leaves):
    fn(*jax.tree_util.tree_unflatten(tree, leaves))
    return []

  jaxpr, consts = internals.trace_lowering(flat, [jax.typeof(x) for x in leaves])
  jax.core.eval_jaxpr(jaxpr, consts, *leaves)


# ------------------------------------------------------------------ pipelines
@dataclasses.dataclass(frozen=True)
class LoweredPipeline:
  """A pipeline's operands with hi-typed refs replaced by their lo refs."""
  refs: tuple[Any, ...]
  in_specs: tuple[Any, ...]
  out_specs: tuple[Any, ...]
  trees: tuple[_Tree, ...]

  def raise_blocks(self, blocks: Sequence[Any]) -> list[Any]:
    """The body's block refs (one tree per operand) with hi refs made of lo buffers."""
    return [t.raise_refs(b) for t, b in zip(self.trees, blocks)]


def lower_pipeline(refs: Sequence[Any], in_specs: tuple[Any, ...], out_specs: tuple[Any, ...],
                   site: str) -> LoweredPipeline | None:
  """The pipeline over lo refs, or None where no operand ref is hi-typed."""
  if internals.HiType is None or len(refs) != len(in_specs) + len(out_specs):
    return None   # (a count mismatch is reported by the pipeline itself)
  trees = []
  for i, (tree, spec) in enumerate(zip(refs, in_specs + out_specs)):
    what = "input" if i < len(in_specs) else "output"
    where = f"emit_pipeline in {site}, {what} {i if i < len(in_specs) else i - len(in_specs)}"
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_view)
    for leaf in leaves:
      if (_is_view(leaf) and not isinstance(leaf.ref, internals.TransformedRef)
          and _ref_type(leaf.ref) is not None):
        raise PalletError(f"{where}: a view (ref.at[...]) of a hi-typed ref is not "
                          f"supported as a pipeline operand; pass the whole ref")
    spec_leaves = ([spec] * len(leaves) if spec_trees.is_spec(spec) else
                   treedef.flatten_up_to(spec))
    trees.append(_Tree(treedef, tuple(_ref_type(r) for r in leaves), tuple(spec_leaves),
                       where))
  if not any(t is not None for tree in trees for t in tree.types):
    return None
  lo_refs = tuple(t.lo_values(t.treedef.flatten_up_to(r), lambda r, _: internals.lo_refs(r))
                  for t, r in zip(trees, refs))
  lo_specs = tuple(t.lo_specs() for t in trees)
  return LoweredPipeline(lo_refs, lo_specs[:len(in_specs)], lo_specs[len(in_specs):],
                         tuple(trees))


def _is_view(x: Any) -> bool:
  return isinstance(x, internals.TransformedRef)

"""Per-primitive block spec rules: pull (outputs' blocks -> inputs' blocks), push
(inputs' blocks -> outputs' blocks) and eval (compute one block of the output from
blocks of the inputs inside a kernel).

Rules are keyed by primitive name so pallet's own primitives and both supported JAX
versions share one table. A rule that cannot express a case raises `UnfusibleError`.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallet.fuser import blocks
from pallet.fuser.blocks import BlockIndexTransform, is_squeezed, dim_size, ref_axis, ref_shape
from pallet.errors import UnfusibleError, UnfusibleValueError
from pallet.core.primitives import Slice
from pallet.core.specs import BlockSpec, BoundedSlice, Element, no_block_spec

PULL: dict[str, Callable] = {}
PUSH: dict[str, Callable] = {}
EVAL: dict[str, Callable] = {}


@dataclasses.dataclass
class RuleContext:
  """What a rule knows about the equation it handles."""
  eqn: Any
  avals_in: tuple
  avals_out: tuple
  scalar_values: Callable[[], list] | None = None   # values of the equation's index operands

  @property
  def name(self) -> str:
    return self.eqn.primitive.name

  def fail(self, reason: str) -> UnfusibleError:
    return UnfusibleError(self.name, reason, self.eqn)

  def fail_value(self, reason: str) -> UnfusibleValueError:
    return UnfusibleValueError(self.name, reason, self.eqn)

  def scalars(self) -> list:
    if self.scalar_values is None:
      raise self.fail("its index operands are not scalars known before the kernel runs")
    return self.scalar_values()


@dataclasses.dataclass
class EvalContext:
  """What an eval rule knows at one grid step."""
  eqn: Any
  program_ids: tuple
  scalar_prefetch: Any
  in_block_specs: tuple
  out_block_specs: tuple
  scalar_prefetch_for_maps: Any = None
  handler: Any = None

  def out_block_indices(self) -> tuple:
    """The block index of each output at this grid step."""
    with blocks.scalar_prefetch_context(self.scalar_prefetch_for_maps):
      return tuple(None if s is no_block_spec else tuple(s.index_map(*self.program_ids))
                   for s in self.out_block_specs)


def _transform(t: BlockIndexTransform, block_shape: Sequence[Any],
               index_fn: Callable[[tuple], tuple]) -> BlockIndexTransform:
  return t.replace(block_shape=tuple(block_shape),
                   block_index_transform=lambda *bi: tuple(index_fn(tuple(t.block_index_transform(*bi)))))


def _spec(spec: Any, block_shape: Sequence[Any], index_fn: Callable[[tuple], tuple]) -> BlockSpec:
  def index_map(*args: Any) -> tuple:
    return tuple(index_fn(tuple(spec.index_map(*args))))
  return BlockSpec(tuple(block_shape), index_map, memory_space=spec.memory_space,
                   pipeline_mode=spec.pipeline_mode)


def _register(names: Sequence[str], table: dict) -> Callable:
  def deco(fn: Callable) -> Callable:
    for name in names:
      table[name] = fn
    return fn
  return deco


def _out_shape(spec: Any) -> tuple:
  return tuple(spec.block_shape)


# ------------------------------------------------------------------ elementwise
ELEMENTWISE = (
    "abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp clz conj "
    "convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 "
    "expm1 floor ge gt igamma imag integer_pow is_finite le lgamma log log1p logistic lt "
    "max min mul ne neg nextafter not or population_count pow real reduce_precision rem "
    "round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin "
    "sinh sqrt square sub tan tanh xor multiple_of max_contiguous").split()


@_register(ELEMENTWISE, PULL)
def _elementwise_pull(ctx: RuleContext, t: BlockIndexTransform | None, **_: Any) -> list:
  if t is None:
    return [None] * len(ctx.avals_in)
  out_shape = ctx.avals_out[0].shape
  result = []
  for aval in ctx.avals_in:
    if aval.ndim == 0:
      result.append(None)
      continue
    same = [a == o for a, o in zip(aval.shape, out_shape)]
    if all(same):
      result.append(t)
      continue
    shape = tuple(b if s else (None if is_squeezed(b) else 1)
                  for b, s in zip(t.block_shape, same))
    result.append(_transform(t, shape, lambda idx, same=same: tuple(
        i if s else 0 for i, s in zip(idx, same))))
  return result


@_register(ELEMENTWISE, EVAL)
def _elementwise_eval(ctx: EvalContext, *args: Any, **params: Any) -> Any:
  spec = ctx.out_block_specs[0]
  if spec is not no_block_spec:   # operands pulled with unit blocks along broadcast dims
    shape = ref_shape(spec.block_shape)
    args = [jnp.broadcast_to(a, shape) if _unit_broadcast(jnp.shape(a), shape) else a
            for a in args]
  return ctx.eqn.primitive.bind(*args, **params)


def _unit_broadcast(shape: tuple, target: tuple) -> bool:
  return (len(shape) == len(target) and shape != target
          and all(s in (1, t) for s, t in zip(shape, target)))


@_register(ELEMENTWISE, PUSH)
def _elementwise_push(ctx: RuleContext, *specs: Any, **_: Any) -> Any:
  out_shape = ctx.avals_out[0].shape
  chosen = None
  for spec, aval in zip(specs, ctx.avals_in):
    if spec is no_block_spec or spec is None:
      continue
    if aval.shape != out_shape:
      raise ctx.fail_value(f"an operand of shape {aval.shape} with a block spec is broadcast "
                     f"to {out_shape}")
    if chosen is not None and chosen is not spec and (
        blocks.canonical(chosen.block_shape) != blocks.canonical(spec.block_shape)
        or chosen.index_map is not spec.index_map):
      raise ctx.fail_value("its operands arrive with different block specs")
    chosen = spec
  return no_block_spec if chosen is None else chosen


# ------------------------------------------------------------------ broadcast_in_dim
@_register(["broadcast_in_dim"], PULL)
def _broadcast_pull(ctx: RuleContext, t: Any, *, shape: Sequence[int],
                    broadcast_dimensions: Sequence[int], **_: Any) -> list:
  operand = ctx.avals_in[0]
  rest = [None] * (len(ctx.avals_in) - 1)
  if t is None or operand.ndim == 0:
    return [None, *rest]
  same = [operand.shape[d] == shape[o] for d, o in enumerate(broadcast_dimensions)]
  block = tuple(t.block_shape[o] if s else (None if is_squeezed(t.block_shape[o]) else 1)
                for o, s in zip(broadcast_dimensions, same))
  return [_transform(t, block, lambda idx: tuple(
      idx[o] if s else 0 for o, s in zip(broadcast_dimensions, same))), *rest]


@_register(["broadcast_in_dim"], EVAL)
def _broadcast_eval(ctx: EvalContext, x: Any, *rest: Any, shape: Sequence[int],
                    broadcast_dimensions: Sequence[int], **params: Any) -> Any:
  out_spec = ctx.out_block_specs[0]
  if out_spec is no_block_spec:
    return ctx.eqn.primitive.bind(x, *rest, shape=shape,
                                  broadcast_dimensions=broadcast_dimensions, **params)
  out_block = out_spec.block_shape
  target = ref_shape(out_block)
  in_spec = ctx.in_block_specs[0]
  if jnp.ndim(x) == 0 or in_spec is no_block_spec:
    return jnp.broadcast_to(x, target)
  dims = [ref_axis(out_block, o) for d, o in enumerate(broadcast_dimensions)
          if not is_squeezed(in_spec.block_shape[d])]
  return lax.broadcast_in_dim(x, target, dims)


@_register(["broadcast_in_dim"], PUSH)
def _broadcast_push(ctx: RuleContext, spec: Any, *rest: Any, shape: Sequence[int],
                    broadcast_dimensions: Sequence[int], **_: Any) -> Any:
  if spec is no_block_spec:
    return no_block_spec
  operand = ctx.avals_in[0]
  source = {o: d for d, o in enumerate(broadcast_dimensions)}
  keep = {o: d for o, d in source.items() if operand.shape[d] == shape[o]}
  block = tuple(spec.block_shape[keep[o]] if o in keep else shape[o] for o in range(len(shape)))
  return _spec(spec, block, lambda idx: tuple(idx[keep[o]] if o in keep else 0
                                              for o in range(len(shape))))


# ------------------------------------------------------------------ transpose / squeeze
@_register(["transpose"], PULL)
def _transpose_pull(ctx: RuleContext, t: Any, *, permutation: Sequence[int]) -> list:
  if t is None:
    return [None]
  n = len(permutation)
  block = [None] * n
  for i, p in enumerate(permutation):
    block[p] = t.block_shape[i]
  inverse = [permutation.index(d) for d in range(n)]
  return [_transform(t, block, lambda idx: tuple(idx[inverse[d]] for d in range(n)))]


@_register(["transpose"], EVAL)
def _transpose_eval(ctx: EvalContext, x: Any, *, permutation: Sequence[int]) -> Any:
  out_spec, in_spec = ctx.out_block_specs[0], ctx.in_block_specs[0]
  if out_spec is no_block_spec:
    return lax.transpose(x, permutation)
  kept = [i for i, b in enumerate(out_spec.block_shape) if not is_squeezed(b)]
  return lax.transpose(x, [ref_axis(in_spec.block_shape, permutation[i]) for i in kept])


@_register(["transpose"], PUSH)
def _transpose_push(ctx: RuleContext, spec: Any, *, permutation: Sequence[int]) -> Any:
  if spec is no_block_spec:
    return no_block_spec
  return _spec(spec, [spec.block_shape[p] for p in permutation],
               lambda idx: tuple(idx[p] for p in permutation))


@_register(["squeeze"], PULL)
def _squeeze_pull(ctx: RuleContext, t: Any, *, dimensions: Sequence[int]) -> list:
  if t is None:
    return [None]
  ndim = ctx.avals_in[0].ndim
  dims = {d % ndim for d in dimensions}

  def expand(values: Sequence[Any], fill: Any) -> tuple:
    it = iter(values)
    return tuple(fill if d in dims else next(it) for d in range(ndim))
  return [_transform(t, expand(t.block_shape, None), lambda idx: expand(idx, 0))]


def _reshape_to_out(ctx: EvalContext, x: Any, **params: Any) -> Any:
  spec = ctx.out_block_specs[0]
  if spec is no_block_spec:
    return ctx.eqn.primitive.bind(x, **params)
  return jnp.reshape(x, ref_shape(spec.block_shape))


EVAL["squeeze"] = _reshape_to_out


@_register(["squeeze"], PUSH)
def _squeeze_push(ctx: RuleContext, spec: Any, *, dimensions: Sequence[int]) -> Any:
  if spec is no_block_spec:
    return no_block_spec
  ndim = ctx.avals_in[0].ndim
  dims = {d % ndim for d in dimensions}
  return _spec(spec, [b for d, b in enumerate(spec.block_shape) if d not in dims],
               lambda idx: tuple(i for d, i in enumerate(idx) if d not in dims))


# ------------------------------------------------------------------ reshape
def _groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
  """Splits a reshape into groups of source dims and destination dims of equal size
  (unit dims form groups of their own)."""
  groups: list[tuple[list[int], list[int]]] = []
  a = [d for d, s in enumerate(src) if s != 1]
  b = [d for d, s in enumerate(dst) if s != 1]
  i = j = 0
  while i < len(a) and j < len(b):
    gi, gj = [a[i]], [b[j]]
    pa, pb = src[a[i]], dst[b[j]]
    i, j = i + 1, j + 1
    while pa != pb:
      if pa < pb:
        pa *= src[a[i]]; gi.append(a[i]); i += 1
      else:
        pb *= dst[b[j]]; gj.append(b[j]); j += 1
    groups.append((gi, gj))
  groups += [([d], []) for d, s in enumerate(src) if s == 1]
  groups += [([], [d]) for d, s in enumerate(dst) if s == 1]
  return groups


def _regroup(ctx: RuleContext, src_shape: Sequence[int], dst_shape: Sequence[int],
             src_block: Sequence[Any]) -> tuple[tuple, Callable[[tuple], tuple]]:
  """The destination block of a reshape given a source block, and the index map between."""
  plans = []
  dst_block: list[Any] = [None] * len(dst_shape)
  for gs, gd in _groups(src_shape, dst_shape):
    if not gd:
      plans.append(("drop", gs, gd, None))
      continue
    if not gs:
      dst_block[gd[0]] = 1
      plans.append(("unit", gs, gd, None))
      continue
    if len(gs) == 1 and len(gd) == 1:   # a squeezed dim becomes a unit block
      dst_block[gd[0]] = 1 if is_squeezed(src_block[gs[0]]) else src_block[gs[0]]
      plans.append(("copy", gs, gd, None))
      continue
    sizes = [src_shape[d] for d in gs]
    bsz = [src_block[d] for d in gs]
    if any(not (is_squeezed(b) or blocks.is_plain(b)) for b in bsz):
      raise ctx.fail(f"block dims {bsz} of dims of sizes {sizes} that the reshape merges "
                     "or splits must be plain block sizes")
    counts = [dim_size(b) for b in bsz]
    k = len(sizes) - 1
    while k >= 0 and counts[k] == sizes[k]:
      k -= 1
    if any(c != 1 for c in counts[:max(k, 0)]):
      raise ctx.fail(f"the block {tuple(bsz)} of dims of sizes {tuple(sizes)} is "
                     "non-contiguous, so it is not one block after the reshape")
    total = math.prod(counts)
    out_sizes = [dst_shape[d] for d in gd]
    remaining, out_counts = total, []
    for size in reversed(out_sizes):
      if remaining % size == 0:
        out_counts.append(size); remaining //= size
      elif size % remaining == 0:
        out_counts.append(remaining); remaining = 1
      else:
        raise ctx.fail(f"a block of {total} elements does not tile dims of sizes "
                       f"{tuple(out_sizes)}")
    if remaining != 1:
      raise ctx.fail(f"a block of {total} elements is larger than dims of sizes "
                     f"{tuple(out_sizes)}")
    out_counts.reverse()
    all_squeezed = all(is_squeezed(b) for b in bsz)
    for d, c in zip(gd, out_counts):
      dst_block[d] = None if all_squeezed and len(gd) == 1 else c
    plans.append(("regroup", gs, gd, (sizes, bsz, out_sizes, out_counts)))

  def index_fn(idx: tuple) -> tuple:
    out: list[Any] = [0] * len(dst_shape)
    for kind, gs, gd, data in plans:
      if kind == "copy":
        out[gd[0]] = idx[gs[0]]
      elif kind == "regroup":
        sizes, bsz, out_sizes, out_counts = data
        offset = 0
        for d, size, b in zip(gs, sizes, bsz):
          offset = offset * size + blocks.element_offset(b, idx[d])
        for pos in reversed(range(len(gd))):
          element = offset % out_sizes[pos]
          offset = offset // out_sizes[pos]
          out[gd[pos]] = element // out_counts[pos]
    return tuple(out)
  return tuple(dst_block), index_fn


@_register(["reshape"], PULL)
def _reshape_pull(ctx: RuleContext, t: Any, *, new_sizes: Sequence[int], dimensions: Any,
                  **_: Any) -> list:
  if t is None:
    return [None] * len(ctx.avals_in)
  if dimensions is not None:
    raise ctx.fail("reshape with `dimensions` (a transposing reshape)")
  block, index_fn = _regroup(ctx, ctx.avals_out[0].shape, ctx.avals_in[0].shape, t.block_shape)
  return [_transform(t, block, index_fn)] + [None] * (len(ctx.avals_in) - 1)


EVAL["reshape"] = lambda ctx, x, *rest, **params: _reshape_to_out(ctx, x, *rest, **params)


@_register(["reshape"], PUSH)
def _reshape_push(ctx: RuleContext, spec: Any, *rest: Any, new_sizes: Sequence[int],
                  dimensions: Any, **_: Any) -> Any:
  if spec is no_block_spec:
    return no_block_spec
  if dimensions is not None:
    raise ctx.fail("reshape with `dimensions` (a transposing reshape)")
  block, index_fn = _regroup(ctx, ctx.avals_in[0].shape, ctx.avals_out[0].shape,
                             spec.block_shape)
  return _spec(spec, block, index_fn)


# ------------------------------------------------------------------ slices
@_register(["slice"], PULL)
def _slice_pull(ctx: RuleContext, t: Any, *, start_indices: Sequence[int],
                limit_indices: Sequence[int], strides: Sequence[int] | None) -> list:
  if t is None:
    return [None]
  if strides is not None and any(s != 1 for s in strides):
    raise ctx.fail(f"strided slice (strides {tuple(strides)})")
  block, shifts = [], []
  for b, start in zip(t.block_shape, start_indices):
    if start == 0:
      block.append(b); shifts.append(None)
    elif blocks.is_plain(b) and start % dim_size(b) == 0:
      block.append(b); shifts.append(("blocks", start // dim_size(b)))
    elif is_squeezed(b) or isinstance(b, (Element, BoundedSlice)):
      block.append(b); shifts.append(("elements", start))
    else:
      block.append(Element(dim_size(b))); shifts.append(("rebase", start, dim_size(b)))

  def index_fn(idx: tuple) -> tuple:
    out = []
    for i, shift in zip(idx, shifts):
      if shift is None:
        out.append(i)
      elif shift[0] in ("blocks", "elements"):
        out.append(_add(i, shift[1]))
      else:
        out.append(i * shift[2] + shift[1])
    return tuple(out)
  return [_transform(t, block, index_fn)]


def _add(index: Any, n: Any) -> Any:
  """Shifts a block index, or the start of a `pl.ds` index (BoundedSlice dims)."""
  if isinstance(index, Slice):
    return Slice(index.start + n, index.size, index.stride)
  return index + n


def _identity_eval(ctx: EvalContext, x: Any, *rest: Any, **params: Any) -> Any:
  if ctx.out_block_specs[0] is no_block_spec:
    return ctx.eqn.primitive.bind(x, *rest, **params)
  return x


EVAL["slice"] = _identity_eval
EVAL["dynamic_slice"] = _identity_eval


@_register(["dynamic_slice"], PULL)
def _dynamic_slice_pull(ctx: RuleContext, t: Any, *, slice_sizes: Sequence[int]) -> list:
  operand = ctx.avals_in[0]
  nstarts = operand.ndim
  if t is None:
    return [None] * len(ctx.avals_in)
  block = []
  for b, size, full in zip(t.block_shape, slice_sizes, operand.shape):
    if size == full or is_squeezed(b) or isinstance(b, Element):
      block.append(b)
    elif dim_size(b) == 1:
      block.append(1)
    else:
      block.append(Element(dim_size(b)))

  def index_fn(idx: tuple) -> tuple:
    starts = ctx.scalars()[1:1 + nstarts]
    out = []
    for d, (i, b, size, full) in enumerate(zip(idx, t.block_shape, slice_sizes, operand.shape)):
      if size == full:
        out.append(i)
        continue
      start = jnp.clip(jnp.asarray(starts[d], jnp.int32), 0, full - size)
      out.append(start + blocks.element_offset(b, i))
    return tuple(out)
  return [_transform(t, block, index_fn)] + [None] * nstarts


# ------------------------------------------------------------------ iota
@_register(["iota"], PULL)
def _iota_pull(ctx: RuleContext, t: Any, **_: Any) -> list:
  return [None] * len(ctx.avals_in)


@_register(["iota"], EVAL)
def _iota_eval(ctx: EvalContext, *args: Any, dtype: Any, shape: Sequence[int],
               dimension: int, **params: Any) -> Any:
  spec = ctx.out_block_specs[0]
  if spec is no_block_spec:
    return ctx.eqn.primitive.bind(*args, dtype=dtype, shape=shape, dimension=dimension,
                                  **params)
  block = spec.block_shape
  index = ctx.out_block_indices()[0][dimension]
  start = blocks.element_offset(block[dimension], index)
  target = ref_shape(block)
  if is_squeezed(block[dimension]):
    return jnp.full(target, start, dtype)
  return (lax.broadcasted_iota(dtype, target, ref_axis(block, dimension))
          + jnp.asarray(start).astype(dtype))


# ------------------------------------------------------------------ reductions
REDUCTIONS = ["reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
              "reduce_or", "argmax", "argmin"]


@_register(REDUCTIONS, PULL)
def _reduce_pull(ctx: RuleContext, t: Any, *, axes: Sequence[int], **_: Any) -> list:
  if t is None:
    return [None]
  shape = ctx.avals_in[0].shape
  kept = [d for d in range(len(shape)) if d not in axes]
  block = [shape[d] if d in axes else t.block_shape[kept.index(d)] for d in range(len(shape))]
  return [_transform(t, block, lambda idx: tuple(
      0 if d in axes else idx[kept.index(d)] for d in range(len(shape))))]


@_register(REDUCTIONS, EVAL)
def _reduce_eval(ctx: EvalContext, x: Any, *, axes: Sequence[int], **params: Any) -> Any:
  in_spec = ctx.in_block_specs[0]
  if in_spec is no_block_spec:
    return ctx.eqn.primitive.bind(x, axes=axes, **params)
  return ctx.eqn.primitive.bind(
      x, axes=tuple(ref_axis(in_spec.block_shape, a) for a in axes), **params)


@_register(["reduce_sum", "reduce_max", "reduce_min", "reduce_prod"], PUSH)
def _reduce_push(ctx: RuleContext, spec: Any, *, axes: Sequence[int], **_: Any) -> Any:
  if spec is no_block_spec:
    return no_block_spec
  shape = ctx.avals_in[0].shape
  for a in axes:
    if is_squeezed(spec.block_shape[a]) and shape[a] != 1 or dim_size(spec.block_shape[a]) != shape[a]:
      raise ctx.fail(f"it reduces axis {a}, which the block {tuple(spec.block_shape)} "
                     f"splits (the axis has {shape[a]} elements)")
  return _spec(spec, [b for d, b in enumerate(spec.block_shape) if d not in axes],
               lambda idx: tuple(i for d, i in enumerate(idx) if d not in axes))


# ------------------------------------------------------------------ concatenate
@_register(["concatenate"], PULL)
def _concatenate_pull(ctx: RuleContext, t: Any, *, dimension: int) -> list:
  if t is None:
    return [None] * len(ctx.avals_in)
  b = t.block_shape[dimension]
  sizes = [a.shape[dimension] for a in ctx.avals_in]
  total = sum(sizes)
  if blocks.is_plain(b) and dim_size(b) == total:
    return [_transform(t, [s if d == dimension else x for d, x in enumerate(t.block_shape)],
                       lambda idx: tuple(0 if d == dimension else i for d, i in enumerate(idx)))
            for s in sizes]
  if not blocks.is_plain(b) or any(s % dim_size(b) for s in sizes):
    raise ctx.fail(f"the block {dim_size(b)} along the concatenated axis does not tile "
                   f"every operand (sizes {tuple(sizes)})")
  n = dim_size(b)
  result, offset = [], 0
  for s in sizes:
    def index_fn(idx: tuple, first=offset // n, count=s // n) -> tuple:
      local = jnp.clip(idx[dimension] - first, 0, count - 1)
      return tuple(local if d == dimension else i for d, i in enumerate(idx))
    result.append(_transform(t, t.block_shape, index_fn))
    offset += s
  return result


@_register(["concatenate"], EVAL)
def _concatenate_eval(ctx: EvalContext, *args: Any, dimension: int) -> Any:
  spec = ctx.out_block_specs[0]
  if spec is no_block_spec:
    return ctx.eqn.primitive.bind(*args, dimension=dimension)
  block = spec.block_shape
  sizes = [v.aval.shape[dimension] for v in ctx.eqn.invars]
  if dim_size(block[dimension]) == sum(sizes):
    return lax.concatenate(list(args), ref_axis(block, dimension))
  first = dim_size(block[dimension]) * ctx.out_block_indices()[0][dimension]
  which = jnp.int32(0)
  for start in itertools.accumulate(sizes[:-1]):   # the block lies in the operand it starts in
    which = which + jnp.where(first >= start, 1, 0).astype(jnp.int32)
  return lax.select_n(which, *args)

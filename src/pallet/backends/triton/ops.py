"""Array operations: one rule per JAX primitive, each writing Triton source.

A rule takes the code generator, the equation and its operand `Value`s and
returns the result `Value`s (usually one line of generated code each). Math that
Triton only offers through libdevice goes through `libdevice.<fn>`; bf16/fp16
inputs to math functions are computed in float32 and cast back, since Triton
rejects most math on 16-bit floats.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

import numpy as np

from pallet.backends.triton.values import (Value, bit_width, constant,
                                           generating_for_interpreter, is_bool, is_float,
                                           is_signed, next_pow2, python_literal, tl_dtype)

Rule = Callable[..., list[Value]]
RULES: dict[str, Rule] = {}
_FLOAT8 = ("float8_e4m3fn", "float8_e5m2")


def rule(*names: str) -> Callable[[Rule], Rule]:
  def register(fn: Rule) -> Rule:
    for n in names:
      RULES[n] = fn
    return fn
  return register


def _out(eqn, i=0):
  aval = eqn.outvars[i].aval
  return tuple(aval.shape), np.dtype(aval.dtype)


def _operands(a: Value, b: Value) -> tuple[str, str]:
  """Source for a binary operation's operands; 32-bit constants stay Python
  literals (Triton gives them the other operand's type), the rest are typed."""
  def text(v, other):
    if v.is_constant and not other.is_constant and v.dtype == other.dtype and \
        v.dtype.name in ("float32", "int32"):
      return python_literal(v.constant, v.dtype)
    return v.typed
  return text(a, b), text(b, a)


# ------------------------------------------------------------------ elementwise
_BINARY = {"add": "{a} + {b}", "sub": "{a} - {b}", "mul": "{a} * {b}",
           "and": "{a} & {b}", "or": "{a} | {b}", "xor": "{a} ^ {b}",
           "eq": "{a} == {b}", "ne": "{a} != {b}", "lt": "{a} < {b}",
           "le": "{a} <= {b}", "gt": "{a} > {b}", "ge": "{a} >= {b}",
           "rem": "{a} % {b}"}


@rule(*_BINARY)
def _binary(gen, eqn, a, b):
  shape, dtype = _out(eqn)
  x, y = _operands(a, b)
  return [gen.let(eqn.primitive.name, _BINARY[eqn.primitive.name].format(a=x, b=y),
                  shape, dtype)]


@rule("div")
def _div(gen, eqn, a, b):
  shape, dtype = _out(eqn)
  x, y = _operands(a, b)
  if is_float(dtype):
    return [gen.let("div", f"{x} / {y}", shape, dtype)]
  # lax.div rounds toward zero, as Triton's integer `//` does.
  return [gen.let("div", f"{x} // {y}", shape, dtype)]


@rule("max", "min")
def _max_min(gen, eqn, a, b):
  shape, dtype = _out(eqn)
  x, y = _operands(a, b)
  fn = "tl.maximum" if eqn.primitive.name == "max" else "tl.minimum"
  nan = ", propagate_nan=tl.PropagateNan.ALL" if is_float(dtype) else ""
  if is_bool(dtype):
    op = "|" if eqn.primitive.name == "max" else "&"
    return [gen.let(eqn.primitive.name, f"{x} {op} {y}", shape, dtype)]
  return [gen.let(eqn.primitive.name, f"{fn}({x}, {y}{nan})", shape, dtype)]


@rule("neg")
def _neg(gen, eqn, x):
  shape, dtype = _out(eqn)
  return [gen.let("neg", f"-{x.typed}", shape, dtype)]


@rule("not")
def _not(gen, eqn, x):
  shape, dtype = _out(eqn)
  if is_bool(dtype):
    return [gen.let("not", f"{x.typed} == 0", shape, dtype)]
  return [gen.let("not", f"~{x.typed}", shape, dtype)]


@rule("abs")
def _abs(gen, eqn, x):
  shape, dtype = _out(eqn)
  return [gen.let("abs", f"tl.abs({x.typed})", shape, dtype)]


@rule("sign")
def _sign(gen, eqn, x):
  shape, dtype = _out(eqn)
  t = tl_dtype(dtype)
  if is_float(dtype):  # keeps -0.0, 0.0 and NaN as they are, like lax.sign
    expr = f"tl.where({x.typed} > 0, 1.0, tl.where({x.typed} < 0, -1.0, {x.typed})).to({t})"
  elif is_signed(dtype):
    expr = f"tl.where({x.typed} > 0, 1, tl.where({x.typed} < 0, -1, 0)).to({t})"
  else:
    expr = f"({x.typed} != 0).to({t})"
  return [gen.let("sign", expr, shape, dtype)]


def _math(template: str, upcast: bool = True, helper: str | None = None) -> Rule:
  """A float math function; 16-bit inputs are computed in float32."""
  def fn(gen, eqn, *args):
    if helper:
      gen.require_helper(helper)
    shape, dtype = _out(eqn)
    wide = upcast and dtype.name in ("float16", "bfloat16")
    texts = [f"{a.typed}.to(tl.float32)" if wide else a.typed for a in args]
    expr = template.format(*texts)
    if wide:
      expr = f"({expr}).to({tl_dtype(dtype)})"
    return [gen.let(eqn.primitive.name, expr, shape, dtype)]
  return fn


_NEEDS_HELPER = {"cbrt": "_cbrt"}

for _name, _template in {
    "exp": "tl.exp({})", "exp2": "tl.exp2({})", "log": "tl.log({})", "log2": "tl.log2({})",
    "sin": "tl.sin({})", "cos": "tl.cos({})", "erf": "tl.erf({})",
    "rsqrt": "tl.rsqrt({})", "logistic": "tl.sigmoid({})",
    "floor": "tl.floor({})", "ceil": "tl.ceil({})",
    "tan": "libdevice.tan({})", "asin": "libdevice.asin({})",
    "acos": "libdevice.acos({})", "atan": "libdevice.atan({})",
    "sinh": "libdevice.sinh({})", "cosh": "libdevice.cosh({})",
    "tanh": "libdevice.tanh({})", "asinh": "libdevice.asinh({})",
    "acosh": "libdevice.acosh({})", "atanh": "libdevice.atanh({})",
    "expm1": "libdevice.expm1({})", "log1p": "libdevice.log1p({})",
    "cbrt": "_cbrt({})", "erf_inv": "libdevice.erfinv({})",
    "erfc": "libdevice.erfc({})", "lgamma": "libdevice.lgamma({})",
    "atan2": "libdevice.atan2({}, {})", "pow": "libdevice.pow({}, {})",
    "nextafter": "libdevice.nextafter({}, {})",
}.items():
  RULES[_name] = _math(_template, helper=_NEEDS_HELPER.get(_name))


@rule("sqrt")
def _sqrt(gen, eqn, x):
  shape, dtype = _out(eqn)
  # sqrt_rn is correctly rounded, like XLA's sqrt; tl.sqrt is approximate.
  return _math("tl.sqrt_rn({})" if dtype.name in ("float32", "float64")
               else "tl.sqrt({})")(gen, eqn, x)


@rule("round")
def _round(gen, eqn, x):
  shape, dtype = _out(eqn)
  method = int(getattr(eqn.params.get("rounding_method"), "value",
                       eqn.params.get("rounding_method", 0)))
  fn = "_round_half_even" if method == 1 else "_round_half_away"
  gen.require_helper(fn)
  return _math(fn + "({})")(gen, eqn, x)


@rule("is_finite")
def _is_finite(gen, eqn, x):
  shape, dtype = _out(eqn)
  return [gen.let("is_finite", f"tl.abs({x.typed}.to(tl.float32)) < float(\"inf\")",
                  shape, dtype)]


@rule("square")
def _square(gen, eqn, x):
  shape, dtype = _out(eqn)
  return [gen.let("square", f"{x.typed} * {x.typed}", shape, dtype)]


@rule("integer_pow")
def _integer_pow(gen, eqn, x):
  shape, dtype = _out(eqn)
  y = int(eqn.params["y"])
  if y == 0:
    return [gen.let("integer_pow", f"tl.full({list(x.tensor_shape)}, 1, {tl_dtype(dtype)})",
                    shape, dtype)]
  # Square-and-multiply keeps the number of multiplications logarithmic.
  result, base, n = None, x.typed, abs(y)
  while n:
    if n & 1:
      result = base if result is None else gen.let("pow_part", f"{result} * {base}",
                                                   shape, dtype).expr
    n >>= 1
    if n:
      base = gen.let("pow_base", f"{base} * {base}", shape, dtype).expr
  if y < 0:
    result = f"1.0 / {result}" if is_float(dtype) else f"1 // {result}"
  return [gen.let("integer_pow", result, shape, dtype)]


@rule("clamp")
def _clamp(gen, eqn, lo, x, hi):
  shape, dtype = _out(eqn)
  return [gen.let("clamp", f"tl.minimum(tl.maximum({x.typed}, {lo.typed}), {hi.typed})",
                  shape, dtype)]


@rule("shift_left", "shift_right_arithmetic", "shift_right_logical")
def _shift(gen, eqn, x, s):
  shape, dtype = _out(eqn)
  bits, t = bit_width(dtype), tl_dtype(dtype)
  name = eqn.primitive.name
  xs, ss = _operands(x, s)
  if name == "shift_left":
    shifted, overflow = f"{xs} << {ss}", "0"
  elif name == "shift_right_arithmetic":
    shifted = f"{xs} >> {ss}"
    overflow = f"tl.where({xs} < 0, -1, 0)" if is_signed(dtype) else "0"
  else:
    unsigned = t.replace("tl.int", "tl.uint")
    shifted = f"({xs}.to({unsigned}, bitcast=True) >> {ss}.to({unsigned}, bitcast=True)).to({t}, bitcast=True)"
    overflow = "0"
  # XLA defines shifts by >= the bit width (Triton leaves them undefined).
  expr = f"tl.where(({ss} >= 0) & ({ss} < {bits}), {shifted}, {overflow}).to({t})"
  return [gen.let(name, expr, shape, dtype)]


@rule("population_count", "clz")
def _bit_count(gen, eqn, x):
  shape, dtype = _out(eqn)
  bits, t = bit_width(dtype), tl_dtype(dtype)
  wide = "ll" if bits == 64 else ""
  fn = "popc" if eqn.primitive.name == "population_count" else "clz"
  arg = x.typed
  if bits < 32:
    arg = f"{arg}.to({t.replace('tl.int', 'tl.uint')}, bitcast=True).to(tl.int32)"
  expr = f"libdevice.{fn}{wide}({arg})"
  if fn == "clz" and bits < 32:
    expr = f"({expr} - {32 - bits})"
  return [gen.let(eqn.primitive.name, f"{expr}.to({t})", shape, dtype)]


@rule("convert_element_type")
def _convert(gen, eqn, x):
  shape, dtype = _out(eqn)
  return [converted(gen, x, dtype, shape)]


def converted(gen, x: Value, dtype: Any, shape: tuple | None = None) -> Value:
  """`x` as `dtype` (as lax.convert_element_type converts)."""
  dtype = np.dtype(dtype)
  shape = x.shape if shape is None else shape
  if x.is_constant:
    return constant(np.asarray(x.constant).astype(dtype).item(), dtype, shape)
  if x.dtype == dtype:
    return x
  if dtype.name.startswith("float8"):
    return _to_float8(gen, x, shape, dtype)
  if dtype.name == "bfloat16" and generating_for_interpreter():
    # the interpreter's code holds bfloat16 in float32, where `.to` would not round
    return gen.let("convert", f"libdevice.to_bfloat16({x.expr})", shape, dtype)
  return gen.let("convert", f"{x.expr}.to({tl_dtype(dtype)})", shape, dtype)


def _to_float8(gen, x: Value, shape: tuple, dtype: np.dtype) -> Value:
  if generating_for_interpreter():
    # Triton's interpreter rounds conversions to float8 wrongly (a carry out of the
    # mantissa is lost: 7.78 becomes 4.0); pallet's numpy libdevice converts instead.
    return gen.let("convert", f"libdevice.to_{dtype.name}({x.expr})", shape, dtype)
  gen.require_cuda_capability(89, "converts to float8")
  # Triton converts to float8 from 16- and 32-bit floats only; from integers and the
  # other float8 type, float32 holds every value that does not overflow float8 exactly.
  source = x.expr if is_float(x.dtype) and bit_width(x.dtype) >= 16 else f"{x.expr}.to(tl.float32)"
  return gen.let("convert", f"{source}.to({tl_dtype(dtype)})", shape, dtype)


def _bits(text: str, dtype: np.dtype) -> str:
  """The raw bits of a value, as an unsigned integer of its width."""
  if dtype.name == "bfloat16" and generating_for_interpreter():   # held in float32
    return f"({text}.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)"
  return f"{text}.to(tl.uint{bit_width(dtype)}, bitcast=True)"


def _from_bits(text: str, dtype: np.dtype) -> str:
  if dtype.name == "bfloat16" and generating_for_interpreter():
    return f"({text}.to(tl.uint32) << 16).to(tl.float32, bitcast=True)"
  return f"{text}.to({tl_dtype(dtype)}, bitcast=True)"


@rule("bitcast_convert_type")
def _bitcast(gen, eqn, x):
  """Same width: a bitcast. Wider to narrower: a new last axis of the pieces, least
  significant first (as XLA orders them); narrower to wider: that axis combined."""
  shape, dtype = _out(eqn)
  wide, narrow = bit_width(x.dtype), bit_width(dtype)
  if wide == narrow:
    return [gen.let("bitcast", _from_bits(_bits(x.typed, x.dtype), dtype), shape, dtype)]
  rank = len(shape)
  if wide > narrow:   # (...) -> (..., wide // narrow)
    tshape = list(Value("", shape, dtype).tensor_shape)
    bits = gen.let("bits", _bits(x.typed, x.dtype), x.shape, np.dtype(f"uint{wide}"))
    lanes = _expand_to_rank(f"tl.arange(0, {wide // narrow})", rank, [rank - 1])
    spread = f"tl.broadcast_to({_expand_to_rank(bits.expr, rank, list(range(rank - 1)))}, {tshape})"
    piece = f"(({spread} >> ({lanes} * {narrow}).to(tl.uint{wide})) & {(1 << narrow) - 1})"
    return [gen.let("bitcast", _from_bits(f"{piece}.to(tl.uint{narrow})", dtype), shape, dtype)]
  gen.require_helper("_bitwise_or")   # (..., narrow // wide) -> (...)
  lanes = _expand_to_rank(f"tl.arange(0, {narrow // wide})", rank + 1, [rank])
  bits = f"{_bits(x.typed, x.dtype)}.to(tl.uint{narrow})"
  shifted = f"({bits} << ({lanes} * {wide}).to(tl.uint{narrow}))"
  combined = f"tl.reduce({shifted}, {rank}, _bitwise_or)"
  return [gen.let("bitcast", _from_bits(combined, dtype), shape, dtype)]


@rule("reduce_precision")
def _reduce_precision(gen, eqn, x):
  shape, dtype = _out(eqn)
  target = {(8, 7): "tl.bfloat16", (5, 10): "tl.float16", (8, 23): "tl.float32"}.get(
      (eqn.params["exponent_bits"], eqn.params["mantissa_bits"]))
  if target is None:
    gen.fail(f"reduce_precision to {eqn.params}")
  return [gen.let("reduce_precision", f"{x.typed}.to({target}).to({tl_dtype(dtype)})",
                  shape, dtype)]


@rule("select_n")
def _select_n(gen, eqn, pred, *cases):
  shape, dtype = _out(eqn)
  if len(cases) == 1:
    return [cases[0]]
  if is_bool(pred.dtype):
    return [gen.let("select", f"tl.where({pred.typed}, {cases[1].typed}, {cases[0].typed})",
                    shape, dtype)]
  expr = cases[-1].typed
  for i in range(len(cases) - 2, -1, -1):
    expr = f"tl.where({pred.typed} == {i}, {cases[i].typed}, {expr})"
  return [gen.let("select", expr, shape, dtype)]


@rule("elementwise_inline_asm")
def _inline_asm(gen, eqn, *args):
  """pallet.triton.elementwise_inline_asm: the assembly, as Triton's inline asm."""
  if generating_for_interpreter():
    gen.fail("inline GPU assembly under Triton's interpreter (it runs only in kernels "
             "compiled for a GPU; no CPU backend runs it: write the operation with "
             "jax.numpy there)", xla_runs_it=False)
  outs = [_out(eqn, i) for i in range(len(eqn.outvars))]
  dtypes = [tl_dtype(d) for _, d in outs]
  dtype = dtypes[0] if len(dtypes) == 1 else f"({', '.join(dtypes)},)"
  p = eqn.params
  expr = (f"tl.inline_asm_elementwise({p['asm']!r}, {p['constraints']!r}, "
          f"[{', '.join(a.typed for a in args)}], dtype={dtype}, is_pure=True, "
          f"pack={p['pack']})")
  if len(outs) == 1:
    return [gen.let("inline_asm", expr, *outs[0])]
  results = gen.fresh("inline_asm")
  gen.line(f"{results} = {expr}")
  return [gen.let("inline_asm", f"{results}[{i}]", shape, dtype)
          for i, (shape, dtype) in enumerate(outs)]


@rule("copy", "copy_p", "optimization_barrier", "stop_gradient")
def _copy(gen, eqn, *xs):
  return list(xs)


# ------------------------------------------------------------------ shapes
def _expand_to_rank(expr: str, rank: int, positions: list[int]) -> str:
  """`expr` (a tensor with len(positions) dims) as a rank-`rank` tensor whose
  dims sit at `positions`, the others of size 1."""
  if rank == len(positions):
    return expr
  if not positions:
    for _ in range(rank):
      expr = f"tl.expand_dims({expr}, 0)"
    return expr
  index = ", ".join(":" if d in positions else "None" for d in range(rank))
  return f"{expr}[{index}]"


@rule("broadcast_in_dim", "broadcast_to")
def _broadcast_in_dim(gen, eqn, x):
  shape, dtype = _out(eqn)
  tshape = list(Value("", shape, dtype).tensor_shape)
  if x.is_constant:
    return [constant(x.constant, dtype, shape)]
  if "broadcast_dimensions" in eqn.params:
    dims = list(eqn.params["broadcast_dimensions"])
  else:   # numpy-style: trailing dimensions line up
    dims = list(range(len(shape) - len(x.shape), len(shape)))
  # Size-1 operand dims that are broadcast up are dropped first.
  keep = [i for i, d in enumerate(dims) if x.shape[i] == shape[d]]
  expr = x.expr
  if len(keep) != len(dims):
    squeezed = [x.tensor_shape[i] for i in keep]
    expr = f"tl.reshape({expr}, {squeezed})"
  expr = _expand_to_rank(expr, len(shape), [dims[i] for i in keep])
  return [gen.let("broadcast", _splat(f"tl.broadcast_to({expr}, {tshape})", x), shape, dtype)]


def _splat(expr: str, x: Value) -> str:
  """`expr`, a broadcast of `x`. Triton's interpreter gives a comparison of scalars the
  operands' type, so a boolean scalar broadcast to a block holds integers there, which
  its masked loads and stores refuse ("mask has unsupported dtype"); a comparison of
  the block makes it boolean again."""
  if generating_for_interpreter() and not x.shape and is_bool(x.dtype):
    return f"({expr} != 0)"
  return expr


def _reshape(gen, x: Value, shape: tuple[int, ...], what: str) -> Value:
  dtype = x.dtype
  if x.is_constant:
    return constant(x.constant, dtype, shape)
  if [d for d in x.shape if d != 1] != [d for d in shape if d != 1]:
    if x.shape and shape and (x.is_padded or Value("", shape, dtype).is_padded):
      return _reshape_across_padding(gen, x, shape, what)
  tshape = list(Value("", shape, dtype).tensor_shape)
  if not x.shape:
    # Triton cannot reshape a scalar; broadcasting it gives the all-ones shape.
    return gen.let(what, _splat(f"tl.broadcast_to({x.expr}, {tshape})", x), shape, dtype)
  if not tshape:
    # A one-element tensor to a scalar.
    return gen.let(what, f"tl.sum(tl.reshape({x.expr}, [1]), axis=0)", shape, dtype)
  return gen.let(what, f"tl.reshape({x.expr}, {tshape})", shape, dtype)


def _reshape_across_padding(gen, x: Value, shape: tuple[int, ...], what: str) -> Value:
  """A reshape whose elements move across power-of-two padding: every slot of the
  padded result takes the source element with its row-major position, gathered from
  the flattened source tensor."""
  src, dst = x.tensor_shape, Value("", shape, x.dtype).tensor_shape
  size = 1
  for n in shape:
    size *= n
  slot = f"tl.arange(0, {_prod(dst)})"
  position = " + ".join(f"(({slot} // {_prod(dst[d + 1:])}) % {dst[d]}) * {_prod(shape[d + 1:])}"
                        for d in range(len(shape)))
  position = gen.let(f"{what}_position", f"tl.minimum({position}, {size - 1})",
                     (_prod(dst),), np.dtype(np.int32))
  source = " + ".join(f"(({position.expr} // {_prod(x.shape[d + 1:])}) % {x.shape[d]}) * "
                      f"{_prod(src[d + 1:])}" for d in range(len(x.shape)))
  index = gen.let(f"{what}_source", source, (_prod(dst),), np.dtype(np.int32))
  flat = f"tl.reshape({x.typed}, [{_prod(src)}])"
  return gen.let(what, f"tl.reshape(tl.gather({flat}, {index.expr}, 0), {list(dst)})", shape,
                 x.dtype)


def _prod(dims) -> int:
  out = 1
  for d in dims:
    out *= int(d)
  return out


@rule("reshape")
def _reshape_rule(gen, eqn, x, *dyn):
  shape, _ = _out(eqn)
  if eqn.params.get("dimensions") not in (None, ()):
    gen.fail("reshape with a dimension permutation")
  return [_reshape(gen, x, shape, "reshape")]


@rule("squeeze")
def _squeeze(gen, eqn, x):
  shape, _ = _out(eqn)
  return [_reshape(gen, x, shape, "squeeze")]


@rule("expand_dims")
def _expand_dims(gen, eqn, x):
  shape, _ = _out(eqn)
  return [_reshape(gen, x, shape, "expand_dims")]


@rule("transpose")
def _transpose(gen, eqn, x):
  shape, dtype = _out(eqn)
  perm = list(eqn.params["permutation"])
  if perm == list(range(len(perm))):
    return [x]
  return [gen.let("transpose", f"tl.permute({x.typed}, {perm})", shape, dtype)]


@rule("iota")
def _iota(gen, eqn):
  shape, dtype = _out(eqn)
  dim = eqn.params["dimension"]
  tshape = list(Value("", shape, dtype).tensor_shape)
  expr = _expand_to_rank(f"tl.arange(0, {tshape[dim]})", len(shape), [dim])
  if len(shape) > 1:
    expr = f"tl.broadcast_to({expr}, {tshape})"
  if dtype != np.int32:
    expr = f"({expr}).to({tl_dtype(dtype)})"
  return [gen.let("iota", expr, shape, dtype)]


def _gather_along(gen, x: Value, axis: int, index: str, out_shape: tuple[int, ...],
                  name: str) -> Value:
  """x taken at positions `index` (a 1-d int32 tensor) along `axis`."""
  tshape = list(Value("", out_shape, x.dtype).tensor_shape)
  idx = _expand_to_rank(index, len(out_shape), [axis])
  idx = f"tl.broadcast_to({idx}, {tshape})"
  return gen.let(name, f"tl.gather({x.typed}, {idx}, {axis})", out_shape, x.dtype)


@rule("slice")
def _slice(gen, eqn, x):
  shape, dtype = _out(eqn)
  starts, strides = eqn.params["start_indices"], eqn.params["strides"] or (1,) * len(shape)
  out = x
  for axis, (start, stride) in enumerate(zip(starts, strides)):
    if start == 0 and stride == 1 and shape[axis] == x.shape[axis]:
      continue
    size = next_pow2(shape[axis])
    index = f"tl.minimum({start} + {stride} * tl.arange(0, {size}), {out.tensor_shape[axis] - 1})"
    new_shape = out.shape[:axis] + (shape[axis],) + out.shape[axis + 1:]
    out = _gather_along(gen, out, axis, index, new_shape, "slice")
  return [out]


@rule("dynamic_slice")
def _dynamic_slice(gen, eqn, x, *starts):
  shape, dtype = _out(eqn)
  out = x
  for axis, start in enumerate(starts):
    if shape[axis] == x.shape[axis]:
      continue
    # XLA clamps the start so that the slice lies inside the operand.
    s = f"tl.minimum(tl.maximum({start.typed}, 0), {x.shape[axis] - shape[axis]})"
    index = f"{s} + tl.arange(0, {next_pow2(shape[axis])})"
    new_shape = out.shape[:axis] + (shape[axis],) + out.shape[axis + 1:]
    out = _gather_along(gen, out, axis, index, new_shape, "dynamic_slice")
  return [out]


@rule("split")
def _split(gen, eqn, x):
  axis, start, outs = eqn.params["axis"], 0, []
  for v in eqn.outvars:
    shape = tuple(v.aval.shape)
    size = shape[axis]
    index = f"tl.minimum({start} + tl.arange(0, {next_pow2(size)}), {x.tensor_shape[axis] - 1})"
    outs.append(_gather_along(gen, x, axis, index, shape, "split"))
    start += size
  return outs


@rule("pad")
def _pad(gen, eqn, x, value):
  """Each output position reads the operand element it holds, or the padding value."""
  shape, dtype = _out(eqn)
  out = x
  for axis, (lo, hi, interior) in enumerate(eqn.params["padding_config"]):
    lo, hi, interior = int(lo), int(hi), int(interior)
    if (lo, hi, interior) == (0, 0, 0):
      continue
    n, step = out.shape[axis], interior + 1
    new_shape = out.shape[:axis] + (shape[axis],) + out.shape[axis + 1:]
    rel = f"(tl.arange(0, {next_pow2(shape[axis])}) - {lo})"
    index = f"tl.minimum(tl.maximum({rel} // {step}, 0), {n - 1})"
    taken = _gather_along(gen, out, axis, index, new_shape, "pad_take")
    here = _expand_to_rank(rel, len(shape), [axis])
    inside = f"({here} >= 0) & ({here} < {(n - 1) * step + 1}) & ({here} % {step} == 0)"
    out = gen.let("pad", f"tl.where({inside}, {taken.typed}, {value.typed})", new_shape, dtype)
  return [out]


@rule("dynamic_update_slice")
def _dynamic_update_slice(gen, eqn, x, update, *starts):
  """The update gathered into the operand's shape, selected inside its window."""
  shape, dtype = _out(eqn)
  rank = len(shape)
  spread, inside = update, []
  for axis, start in enumerate(starts):
    n, u = shape[axis], update.shape[axis]
    # XLA clamps the start so that the update lies inside the operand.
    s = gen.let("dus_start", f"tl.minimum(tl.maximum({start.typed}, 0), {n - u})", (),
                np.int32)
    rel = f"(tl.arange(0, {next_pow2(n)}) - {s.expr})"
    index = f"tl.minimum(tl.maximum({rel}, 0), {u - 1})"
    new_shape = spread.shape[:axis] + (n,) + spread.shape[axis + 1:]
    spread = _gather_along(gen, spread, axis, index, new_shape, "dus_take")
    here = _expand_to_rank(rel, rank, [axis])
    inside.append(f"({here} >= 0) & ({here} < {u})")
  mask = " & ".join(inside) if inside else "True"
  return [gen.let("dynamic_update_slice", f"tl.where({mask}, {spread.typed}, {x.typed})",
                  shape, dtype)]


@rule("rev")
def _rev(gen, eqn, x):
  shape, dtype = _out(eqn)
  out = x
  for axis in eqn.params["dimensions"]:
    n = x.shape[axis]
    index = f"tl.maximum({n - 1} - tl.arange(0, {next_pow2(n)}), 0)"
    out = _gather_along(gen, out, axis, index, out.shape, "rev")
  return [out]


@rule("concatenate")
def _concatenate(gen, eqn, *xs):
  shape, dtype = _out(eqn)
  axis = eqn.params["dimension"]
  sizes = {x.shape[axis] for x in xs}
  n = len(xs)
  if len(sizes) != 1 or n & (n - 1) or any(x.is_padded for x in xs):
    gen.fail(f"concatenate of {[x.shape for x in xs]} along axis {axis}: the Triton backend "
             f"concatenates a power-of-two number of equal power-of-two pieces")
  parts = [x.typed for x in xs]
  piece_shape = list(xs[0].tensor_shape)
  rank = len(piece_shape)
  perm = list(range(axis)) + [rank] + list(range(axis, rank))
  while len(parts) > 1:
    # join stacks two pieces on a new last axis; moving it in front of `axis`
    # and merging gives [a..., b...] along `axis`.
    merged = piece_shape[:axis] + [2 * piece_shape[axis]] + piece_shape[axis + 1:]
    parts = [gen.let("concat", f"tl.reshape(tl.permute(tl.join({a}, {b}), {perm}), {merged})",
                     tuple(merged), dtype).expr
             for a, b in zip(parts[::2], parts[1::2])]
    piece_shape = merged
  return [gen.let("concatenate", parts[0], shape, dtype)]


@rule("stack")
def _stack(gen, eqn, *xs):
  """Pieces along a new axis: each piece broadcast along it, chosen by position."""
  shape, dtype = _out(eqn)
  axis = eqn.params["axis"]
  tshape = list(Value("", shape, dtype).tensor_shape)
  position = _expand_to_rank(f"tl.arange(0, {tshape[axis]})", len(shape), [axis])
  dims = [d for d in range(len(shape)) if d != axis]
  pieces = [f"tl.broadcast_to({_expand_to_rank(x.typed, len(shape), dims)}, {tshape})"
            for x in xs]
  expr = pieces[-1]
  for i in range(len(xs) - 2, -1, -1):
    expr = f"tl.where({position} == {i}, {pieces[i]}, {expr})"
  return [gen.let("stack", expr, shape, dtype)]


@rule("unstack")
def _unstack(gen, eqn, x):
  axis = eqn.params["axis"]
  one = x.shape[:axis] + (1,) + x.shape[axis + 1:]
  outs = []
  for i, v in enumerate(eqn.outvars):
    piece = _gather_along(gen, x, axis, f"tl.full([1], {i}, tl.int32)", one, "unstack")
    outs.append(_reshape(gen, piece, tuple(v.aval.shape), "unstack"))
  return outs


@rule("tile")
def _tile(gen, eqn, x):
  shape, dtype = _out(eqn)
  if x.is_constant:
    return [constant(x.constant, dtype, shape)]
  out = x
  for axis, reps in enumerate(eqn.params["reps"]):
    if reps == 1:
      continue
    n = out.shape[axis]
    new_shape = out.shape[:axis] + (n * reps,) + out.shape[axis + 1:]
    if next_pow2(n) == n and next_pow2(reps) == reps:
      # Copies side by side: broadcast along a new axis in front, then merge the two.
      tshape = list(out.tensor_shape)
      wide = tshape[:axis] + [reps] + tshape[axis:]
      expr = (f"tl.reshape(tl.broadcast_to(tl.expand_dims({out.typed}, {axis}), {wide}), "
              f"{tshape[:axis] + [reps * n] + tshape[axis + 1:]})")
      out = gen.let("tile", expr, new_shape, dtype)
    else:
      index = f"(tl.arange(0, {next_pow2(n * reps)}) % {n})"
      out = _gather_along(gen, out, axis, index, new_shape, "tile")
  return [out]


# ------------------------------------------------------------------ random bits
_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry_helper() -> str:
  """Threefry-2x32 with 20 rounds (Salmon et al., SC'11), as JAX's threefry2x32
  computes it: five groups of four rounds, a key injection after each."""
  lines = ["@triton.jit", "def _threefry2x32(k0, k1, x0, x1):",
           "    k2 = k0 ^ k1 ^ 0x1BD11BDA", "    x0 = x0 + k0", "    x1 = x1 + k1"]
  keys = ("k0", "k1", "k2")
  for group in range(5):
    for r in _THREEFRY_ROTATIONS[group % 2]:
      lines += ["    x0 = x0 + x1", f"    x1 = (x1 << {r}) | (x1 >> {32 - r})",
                "    x1 = x1 ^ x0"]
    lines += [f"    x0 = x0 + {keys[(group + 1) % 3]}",
              f"    x1 = x1 + {keys[(group + 2) % 3]} + {group + 1}"]
  lines.append("    return x0, x1")
  return "\n".join(lines) + "\n"


@rule("threefry2x32")
def _threefry2x32(gen, eqn, *args):
  shape, dtype = _out(eqn)
  gen.require_helper("_threefry2x32")
  tshape = list(Value("", shape, dtype).tensor_shape)
  operands = []
  for a in args:   # (uint32 operands of one rank, size-1 dims broadcast)
    text = a.typed
    if tuple(a.shape) != shape:
      dims = list(range(len(shape) - len(a.shape), len(shape)))
      text = f"tl.broadcast_to({_expand_to_rank(text, len(shape), dims)}, {tshape})"
    operands.append(text)
  pair = gen.fresh("threefry")
  gen.line(f"{pair} = _threefry2x32({', '.join(operands)})")
  return [gen.let("random_bits", f"{pair}[{i}]", shape, dtype) for i in range(2)]


# ------------------------------------------------------------------ reductions
def _identity(kind: str, dtype: np.dtype) -> str:
  if kind in ("sum", "or"):
    return "0" if not is_bool(dtype) else "False"
  if kind == "prod":
    return "1"
  if kind == "and":
    return "True" if is_bool(dtype) else "-1"
  lowest = kind in ("max", "argmax")
  if is_float(dtype):
    return '-float("inf")' if lowest else 'float("inf")'
  if is_bool(dtype):
    return "False" if lowest else "True"
  info = np.iinfo(dtype)
  return str(info.min if lowest else info.max)


_REDUCERS = {
    "reduce_sum": ("sum", "tl.sum({x}, axis={a})"),
    "reduce_max": ("max", "tl.max({x}, axis={a})"),
    "reduce_min": ("min", "tl.min({x}, axis={a})"),
    "reduce_prod": ("prod", "tl.reduce({x}, {a}, _multiply)"),
    "reduce_and": ("and", "tl.reduce({x}, {a}, _bitwise_and)"),
    "reduce_or": ("or", "tl.reduce({x}, {a}, _bitwise_or)"),
    "reduce_xor": ("sum", "tl.reduce({x}, {a}, _bitwise_xor)"),
}


def _in_float32_for_float8(rule_body: Callable[..., Value]) -> Rule:
  """A reduction or scan rule whose float8 operands are computed in float32:
  float8_e4m3fn has no infinity to pad a max or min with (it would become NaN), and
  Triton reduces 8-bit floats through wider types anyway. Exact: float32 holds every
  float8 value."""
  def apply(gen, eqn, x):
    shape, dtype = _out(eqn)
    if x.dtype.name not in _FLOAT8:
      return [rule_body(gen, eqn, x, shape, dtype)]
    wide = np.dtype(np.float32) if dtype == x.dtype else dtype
    out = rule_body(gen, eqn, converted(gen, x, np.float32), shape, wide)
    return [converted(gen, out, dtype, shape)]
  return apply


def _reduce(gen, eqn, x, shape, dtype) -> Value:
  kind, template = _REDUCERS[eqn.primitive.name]
  for helper in ("_multiply", "_bitwise_and", "_bitwise_or", "_bitwise_xor"):
    if helper in template:
      gen.require_helper(helper)
  axes = sorted(eqn.params["axes"], reverse=True)
  x = gen.mask_padding(x, axes, _identity(kind, dtype))
  expr, cur_shape = x.typed, list(x.shape)
  if is_bool(dtype) and kind in ("sum", "max", "min"):
    expr = f"{expr}.to(tl.int32)"
  for a in axes:
    expr = template.format(x=expr, a=a)
    cur_shape.pop(a)
  if is_bool(dtype):
    expr = f"({expr}).to(tl.int1)"
  elif dtype.name in ("float16", "bfloat16", "int8", "int16", "uint8", "uint16"):
    expr = f"({expr}).to({tl_dtype(dtype)})"   # tl.sum widens small types
  return gen.let(eqn.primitive.name, expr, shape, dtype)


rule(*_REDUCERS)(_in_float32_for_float8(_reduce))


def _arg_reduce(gen, eqn, x, shape, dtype) -> Value:
  (axis,) = eqn.params["axes"]
  kind = eqn.primitive.name
  x = gen.mask_padding(x, [axis], _identity("max" if kind == "argmax" else "min", x.dtype))
  src = x.typed
  if is_bool(x.dtype):
    src = f"{src}.to(tl.int32)"
  expr = f"tl.{kind}({src}, axis={axis}, tie_break_left=True).to({tl_dtype(dtype)})"
  return gen.let(kind, expr, shape, dtype)


rule("argmax", "argmin")(_in_float32_for_float8(_arg_reduce))


_SCANS = {"cumsum": ("sum", "tl.cumsum({x}, axis={a}, reverse={r})"),
          "cumprod": ("prod", "tl.cumprod({x}, axis={a}, reverse={r})"),
          "cummax": ("max", "tl.associative_scan({x}, {a}, _maximum, reverse={r})"),
          "cummin": ("min", "tl.associative_scan({x}, {a}, _minimum, reverse={r})")}


def _cumulative(gen, eqn, x, shape, dtype) -> Value:
  kind, template = _SCANS[eqn.primitive.name]
  for helper in ("_maximum", "_minimum"):
    if helper in template:
      gen.require_helper(helper)
  axis, reverse = eqn.params["axis"], bool(eqn.params["reverse"])
  if reverse:
    # Padding sits at the end of the axis: a reverse scan would carry it in.
    x = gen.mask_padding(x, [axis], _identity(kind, dtype))
  src = x.typed
  expr = template.format(x=src, a=axis, r=reverse)
  if dtype.name in ("float16", "bfloat16", "int8", "int16", "uint8", "uint16", "bool"):
    expr = f"({expr}).to({tl_dtype(dtype)})"
  return gen.let(eqn.primitive.name, expr, shape, dtype)


rule(*_SCANS)(_in_float32_for_float8(_cumulative))


# ------------------------------------------------------------------ dot_general
_PRECISIONS = {"HIGHEST": "ieee", "HIGH": "tf32x3", "DEFAULT": "tf32"}
# A dot with no precision follows `jax_default_matmul_precision`, as XLA's does, so a
# kernel and its jax.numpy twin round float32 inputs alike (unset: TF32, XLA's GPU default).
_CONFIG_PRECISIONS = {"highest": "ieee", "float32": "ieee", "high": "tf32x3",
                      "bfloat16_3x": "tf32x3", "tensorfloat32": "tf32"}
# Dot algorithms (lax.DotAlgorithmPreset) that are a float32 input precision.
_ALGORITHM_PRECISIONS = {"TF32_TF32_F32": "tf32", "TF32_TF32_F32_X3": "tf32x3",
                         "F32_F32_F32": "ieee"}


def input_precision(precision: Any, a: Value, b: Value) -> str | None:
  """Triton's input_precision for a float32 dot (None for other dtypes)."""
  if not (a.dtype.name == "float32" and b.dtype.name == "float32"):
    return None
  names = []
  for p in (precision if isinstance(precision, tuple) else (precision,)):
    if p is not None:
      names.append(getattr(p, "name", str(p)).upper())
  if names and names[0] in _ALGORITHM_PRECISIONS:
    return _ALGORITHM_PRECISIONS[names[0]]
  names = [n for n in names if n in _PRECISIONS]
  if not names:
    return _CONFIG_PRECISIONS.get(str(jax.config.jax_default_matmul_precision).lower(), "tf32")
  best = max(names, key=["DEFAULT", "HIGH", "HIGHEST"].index)
  return _PRECISIONS.get(best, "ieee")


# 16-bit algorithms: the dot Triton makes of two operands of that dtype already (what
# GPU kernels pass for bf16 or fp16 inputs, as JAX's Triton lowering takes them).
_SIXTEEN_BIT_ALGORITHMS = {"BF16_BF16_F32": "bfloat16", "BF16_BF16_BF16": "bfloat16",
                           "F16_F16_F32": "float16", "F16_F16_F16": "float16"}


def _check_dot_algorithm(gen, precision: Any, a: Any, b: Any) -> None:
  """Dot algorithms other than a float32 input precision, or a 16-bit one on operands
  of that dtype (which would convert operands to other types and accumulate in them),
  are refused rather than approximated."""
  name = getattr(precision, "name", None)
  if isinstance(precision, tuple) or name is None or name == "DEFAULT":
    return
  sixteen = _SIXTEEN_BIT_ALGORITHMS.get(name)
  if sixteen is not None and a.dtype.name == sixteen and b.dtype.name == sixteen:
    return
  if name not in _ALGORITHM_PRECISIONS:
    gen.fail(f"a dot with the algorithm {name} of {a.dtype.name} x {b.dtype.name} (the "
             f"Triton backend takes the float32 algorithms {sorted(_ALGORITHM_PRECISIONS)}, "
             f"the 16-bit ones on operands of that dtype, or a lax.Precision)")


# What tl.dot multiplies on tensor cores: two operands of one of these dtypes, or any
# two float8 types.
_TENSOR_CORE_DTYPES = ("int8", "float16", "bfloat16", "float32", "float8_e4m3fn",
                       "float8_e5m2")
# Dtypes every value of which a 16-bit float holds exactly.
_EXACT_IN = {"bfloat16": ("bfloat16", "int8", "uint8", "bool") + _FLOAT8,
             "float16": ("float16", "int8", "uint8", "bool") + _FLOAT8}


def dot_operand_dtypes(a: np.dtype, b: np.dtype, out: np.dtype) -> tuple[np.dtype, np.dtype]:
  """The dtypes a dot of `a` by `b` giving `out` multiplies in, as XLA's dot on CPU and
  GPU does: operands of one dtype, and two float8 types, as they are; any other mixed
  pair (bf16 activations by int8 weights) converted to the result dtype. A float32
  result of two operands that a 16-bit float holds exactly (bf16 x int8, fp16 x int8,
  int8 x float8) multiplies in that 16-bit float instead: the products are exact either
  way, accumulated in float32 either way, and tensor cores take 16-bit floats."""
  a, b, out = np.dtype(a), np.dtype(b), np.dtype(out)
  if a == b or (a.name in _FLOAT8 and b.name in _FLOAT8):
    return a, b
  if out.name == "float32":
    for narrow in ("bfloat16", "float16"):
      if narrow in (a.name, b.name) and all(d.name in _EXACT_IN[narrow] for d in (a, b)):
        return (_named_dtype(narrow),) * 2
    if all(d.name in _EXACT_IN["bfloat16"] for d in (a, b)):
      return (_named_dtype("bfloat16"),) * 2
  return out, out


def _named_dtype(name: str) -> np.dtype:
  return np.dtype(getattr(jax.numpy, name))


@rule("dot_general")
def _dot_general(gen, eqn, a, b):
  shape, dtype = _out(eqn)
  (ca, cb), (ba, bb) = eqn.params["dimension_numbers"]
  if len(ca) != 1 or len(cb) != 1 or len(ba) > 1:
    gen.fail(f"dot_general with dimension numbers {eqn.params['dimension_numbers']}: "
             f"the Triton backend contracts one dimension, with at most one batch dimension")
  precision = eqn.params.get("precision")
  _check_dot_algorithm(gen, precision, a, b)
  wanted = dot_operand_dtypes(a.dtype, b.dtype, dtype)
  if any(np.issubdtype(d, np.unsignedinteger) for d in wanted):
    gen.fail(f"a dot of unsigned integers ({a.dtype} x {b.dtype}; Triton's dot takes "
             f"floats and signed int8)")
  given = f"a dot of {a.dtype} by {b.dtype} giving {dtype}"
  a, b = converted(gen, a, wanted[0]), converted(gen, b, wanted[1])
  # Bring both operands to (batch, M, K) x (batch, K, N).
  def arrange(v, contract, batch, lhs):
    free = [d for d in range(len(v.shape)) if d not in (contract, *batch)]
    if len(free) > 1:
      gen.fail(f"dot_general operand of shape {v.shape} has {len(free)} free dimensions")
    order = list(batch) + (free + [contract] if lhs else [contract] + free)
    v = _transpose_value(gen, v, order)
    if not free:   # a vector: add a size-1 free dimension
      pos = len(batch) + (0 if lhs else 1)
      new_shape = v.shape[:pos] + (1,) + v.shape[pos:]
      v = _reshape(gen, v, new_shape, "as_matrix")
    return v, bool(free)
  a2, a_free = arrange(a, ca[0], ba, True)
  b2, b_free = arrange(b, cb[0], bb, False)
  if a2.is_padded or b2.is_padded:
    # Padding along K must be zero in both operands, or it pollutes every sum.
    a2 = gen.mask_padding(a2, [len(a2.shape) - 1], "0")
    b2 = gen.mask_padding(b2, [len(b2.shape) - 2], "0")
  # Integers accumulate in int32 (Triton's int8 dot gives int32), floats in float32.
  operands_float = is_float(a.dtype) or is_float(b.dtype)
  acc = np.dtype(np.float32) if operands_float else np.dtype(np.int32)
  if np.dtype(np.float64) in (dtype, a.dtype, b.dtype) and operands_float:
    acc = np.dtype(np.float64)
  m, n = a2.tensor_shape[-2], b2.tensor_shape[-1]
  kt = a2.tensor_shape[-1]
  prod_shape = a2.shape[:-1] + (b2.shape[-1],)
  # Tensor-core dots need M, N >= 16 and K >= 16 (K >= 32 for 8-bit operands).
  min_k = 32 if max(a2.dtype.itemsize, b2.dtype.itemsize) == 1 else 16
  if min(m, n) >= 16 and kt >= min_k and acc.name != "float64":
    both = (a2.dtype.name, b2.dtype.name)
    if not all(d in _TENSOR_CORE_DTYPES for d in both) or (
        a2.dtype != b2.dtype and not all(d in _FLOAT8 for d in both)):
      gen.fail(f"{given} (multiplied as {a.dtype} by {b.dtype}, blocks of {a2.shape} by "
               f"{b2.shape}; Triton's dot multiplies int8, float16, bfloat16, float32 and "
               f"float8 blocks, so convert the operands to one of those, int8 only where "
               f"their values fit)")
    prec = input_precision(precision, a2, b2)
    extra = f", input_precision=\"{prec}\"" if prec else ""
    expr = f"tl.dot({a2.typed}, {b2.typed}, out_dtype={tl_dtype(acc)}{extra})"
  else:
    # Smaller products are broadcast sums.
    r = len(a2.shape)
    lhs = f"tl.expand_dims({a2.typed}.to({tl_dtype(acc)}), {r})"
    rhs = f"tl.expand_dims({b2.typed}.to({tl_dtype(acc)}), {r - 2})"
    expr = f"tl.sum({lhs} * {rhs}, axis={r - 1})"
  out = gen.let("dot", expr, prod_shape, acc)
  if not a_free or not b_free:
    out = _reshape(gen, out, shape, "dot")
  return [converted(gen, out, dtype, shape)]


def _transpose_value(gen, v: Value, order: list[int]) -> Value:
  if order == list(range(len(order))):
    return v
  shape = tuple(v.shape[d] for d in order)
  return gen.let("transpose", f"tl.permute({v.typed}, {order})", shape, v.dtype)


# Helpers that generated code may call, defined once at the top of the module.
HELPERS = {
    "_multiply": "@triton.jit\ndef _multiply(a, b):\n    return a * b\n",
    "_bitwise_and": "@triton.jit\ndef _bitwise_and(a, b):\n    return a & b\n",
    "_bitwise_or": "@triton.jit\ndef _bitwise_or(a, b):\n    return a | b\n",
    "_bitwise_xor": "@triton.jit\ndef _bitwise_xor(a, b):\n    return a ^ b\n",
    "_maximum": "@triton.jit\ndef _maximum(a, b):\n    return tl.maximum(a, b)\n",
    "_minimum": "@triton.jit\ndef _minimum(a, b):\n    return tl.minimum(a, b)\n",
    # AMD's libdevice has no cbrt; pow on |x| is accurate to about an ulp.
    "_cbrt": (
        "@triton.jit\ndef _cbrt(x):\n"
        "    r = libdevice.pow(tl.abs(x), 1.0 / 3.0)\n"
        "    return tl.where(x < 0, -r, r)\n"),
    "_threefry2x32": _threefry_helper(),
    "_round_half_away": (
        "@triton.jit\ndef _round_half_away(x):\n"
        "    return tl.where(x >= 0, tl.floor(x + 0.5), tl.ceil(x - 0.5))\n"),
    "_round_half_even": (
        "@triton.jit\ndef _round_half_even(x):\n"
        "    r = tl.floor(x + 0.5)\n"
        "    tie = (r - x) == 0.5\n"
        "    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0\n"
        "    return tl.where(tie & odd, r - 1.0, r)\n"),
}

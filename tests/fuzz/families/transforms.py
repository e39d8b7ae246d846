"""vmap / jvp / grad of pallas_call: a smooth elementwise kernel of 1-2 inputs (blocks
that revisit inputs, program ids in the value) or a sum over a reduction grid axis into
a revisited output block, under `jax.vmap` (in_axes 0, 1 or None per input, out_axes
0, 1 or -1, nested, under `jit`), `jax.jvp`, `jax.grad` of a weighted sum, `vmap` of
`grad`, and `jit` of `jvp`.

The model is the kernel's NumPy simulation; derivatives come from complex steps
through it (f(x + i h t).imag / h, exact to rounding for analytic functions), so they
are computed without JAX. JAX's interpreter checks `vmap` only: its pallas_call has no
JVP in interpret mode and no transpose.
"""
from __future__ import annotations

import random
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..case import Case, random_array
from ..exprs import evaluate, kernel_grid_value, model_grid_value, random_expr, show
from ..layout import (Dim, Layout, covering_layout, grid_points, random_layout, read_block,
                      write_block)

TRANSFORMS = ["vmap", "vmap", "jvp", "grad", "vmap_grad", "jit_jvp"]
STEP = 1e-20


def generate(rng: random.Random, data: np.random.Generator) -> Case:
  kind = rng.choice(["elementwise", "elementwise", "reduce"])
  if kind == "elementwise":
    rank = rng.randint(1, 2)
    grid = tuple(rng.randint(1, 3) for _ in range(rank))
    visible = tuple(rng.choice([1, 2, 4]) for _ in range(rng.randint(1, 2)))
    n_in = rng.randint(1, 2)
    ins = [random_layout(rng, grid, visible, edges=False, element=False) for _ in range(n_in)]
    out = covering_layout(rng, grid, visible, edges=False)
  else:
    grid = (rng.randint(1, 3), rng.randint(2, 3))
    b, c = rng.choice([1, 2]), rng.choice([1, 4])
    n_in = 1
    ins = [Layout((grid[0] * b, grid[1] * c), (Dim("blocked", b, ("lin", 0, 1, 0)),
                                                Dim("blocked", c, ("lin", 1, 1, 0))))]
    out = Layout((grid[0] * b, c), (Dim("blocked", b, ("lin", 0, 1, 0)),
                                    Dim("blocked", c, ("const", 0))))
  expr = random_expr(rng, n_in, len(grid), False, rng.randint(1, 3), smooth=True)
  transform = rng.choice(TRANSFORMS)
  d = dict(kind=kind, grid=grid, ins=ins, out=out, expr=expr, transform=transform,
           batch=rng.randint(2, 3), jit=rng.random() < 0.3, nested=rng.random() < 0.2)
  inputs = [random_array(data, L.shape, np.float32) for L in ins]
  extra: list[np.ndarray] = []
  if transform == "vmap" or transform == "vmap_grad":
    axes = [rng.choice([0, 1, None]) for _ in ins]
    if transform == "vmap_grad" or all(a is None for a in axes):
      axes[0] = rng.choice([0, 1])
    d["in_axes"], d["out_axes"] = axes, rng.choice([0, 1, -1])
    if transform == "vmap_grad":
      d["nested"] = False
    lead = (2,) if d["nested"] else ()    # the outer vmap of a nested pair maps axis 0
    inputs = [random_array(data, (lead if a is not None else ()) +
                           _batched(L.shape, a, d["batch"]), np.float32)
              for L, a in zip(ins, axes)]
    if transform == "vmap_grad":
      d["argnums"] = _argnums(rng, n_in)
      extra = [random_array(data, out.shape, np.float32)]
  elif transform in ("jvp", "jit_jvp"):
    extra = [random_array(data, L.shape, np.float32) for L in ins]
  else:
    d["argnums"] = _argnums(rng, n_in)
    extra = [random_array(data, out.shape, np.float32)]
  if transform != "vmap":
    d["nested"] = False
  d["n_in"] = n_in
  jax_reason = None
  if transform != "vmap":
    jax_reason = "JAX's pallas_call has no JVP under interpret=True (nor a transpose)"
  description = dict(kind=kind, grid=grid, value=show(expr), transform=transform,
                     inputs=[L.describe() for L in ins], out=out.describe(),
                     **{k: d[k] for k in ("in_axes", "out_axes", "argnums", "batch", "jit",
                                          "nested") if k in d})
  return Case(family="transforms", seed=-1, description=description,
              inputs=tuple(inputs + extra), run=lambda api, *a: _run(api, d, a),
              model=lambda *a: _model(d, a), jax_oracle=jax_reason, tolerance_scale=5.0)


def _argnums(rng: random.Random, n_in: int) -> tuple[int, ...]:
  return (0,) if n_in == 1 else rng.choice([(0,), (1,), (0, 1)])


def _batched(shape: tuple[int, ...], axis: int | None, batch: int) -> tuple[int, ...]:
  if axis is None:
    return shape
  return shape[:axis] + (batch,) + shape[axis:]


# ------------------------------------------------------------------ the model
def _simulate(d: dict[str, Any], xs: list[np.ndarray]) -> np.ndarray:
  grid, out_layout = d["grid"], d["out"]
  out = np.zeros(out_layout.shape, np.complex128)
  for ids in grid_points(grid):
    blocks = [read_block(x, L.window(ids, grid))[0] for x, L in zip(xs, d["ins"])]
    value = np.asarray(evaluate(d["expr"], blocks, np, model_grid_value(ids, grid, np.float64)),
                       np.complex128)
    window = out_layout.window(ids, grid)
    if d["kind"] == "reduce" and ids[1] > 0:
      value = value + read_block(out, window)[0]
    write_block(out, window, value)
  return out


def _f(d: dict[str, Any], xs: list[np.ndarray]) -> np.ndarray:
  return _simulate(d, [np.asarray(x, np.complex128) for x in xs]).real


def _jvp(d: dict[str, Any], xs: list[np.ndarray], ts: list[np.ndarray]) -> np.ndarray:
  shifted = [np.asarray(x, np.complex128) + 1j * STEP * t for x, t in zip(xs, ts)]
  return _simulate(d, shifted).imag / STEP


def _grad(d: dict[str, Any], xs: list[np.ndarray], w: np.ndarray) -> list[np.ndarray]:
  grads = []
  for i in d["argnums"]:
    g = np.zeros(xs[i].shape)
    for e in np.ndindex(*xs[i].shape):
      t = [np.zeros(x.shape) for x in xs]
      t[i][e] = 1.0
      g[e] = float(np.sum(w * _jvp(d, xs, t)))
    grads.append(g)
  return grads


def _model(d: dict[str, Any], args: tuple[np.ndarray, ...]) -> Any:
  n, transform = d["n_in"], d["transform"]
  xs, extra = [a.astype(np.float64) for a in args[:n]], [a.astype(np.float64) for a in args[n:]]
  if transform == "vmap":
    def batched(xs):
      outs = [_f(d, [_take(x, a, b) for x, a in zip(xs, d["in_axes"])])
              for b in range(d["batch"])]
      return np.moveaxis(np.stack(outs), 0, d["out_axes"])
    if d["nested"]:
      outer = [0 if a is not None else None for a in d["in_axes"]]
      return np.stack([batched([_take(x, a, b) for x, a in zip(xs, outer)])
                       for b in range(2)]).astype(np.float32)
    return batched(xs).astype(np.float32)
  if transform in ("jvp", "jit_jvp"):
    return [_f(d, xs).astype(np.float32), _jvp(d, xs, extra).astype(np.float32)]
  if transform == "grad":
    return [g.astype(np.float32) for g in _grad(d, xs, extra[0])]
  # vmap_grad: the batch is over the inputs; w is shared
  per = [_grad(d, [_take(x, a, b) for x, a in zip(xs, d["in_axes"])], extra[0])
         for b in range(d["batch"])]
  return [np.stack([p[k] for p in per]).astype(np.float32) for k in range(len(d["argnums"]))]


def _take(x: np.ndarray, axis: int | None, b: int) -> np.ndarray:
  return x if axis is None else np.take(x, b, axis=axis)


# ------------------------------------------------------------------ the kernel
def _call(api: Any, d: dict[str, Any]) -> Callable:
  pl, grid, n = api.pl, d["grid"], d["n_in"]

  def kernel(*refs):
    ins, o_ref = refs[:n], refs[n]
    value = evaluate(d["expr"], [r[...] for r in ins], jnp, kernel_grid_value(pl, jnp.float32))
    value = jnp.broadcast_to(jnp.asarray(value, jnp.float32), o_ref.shape)
    if d["kind"] == "reduce":
      @pl.when(pl.program_id(1) == 0)
      def _():
        o_ref[...] = jnp.zeros_like(o_ref)
      o_ref[...] += value
    else:
      o_ref[...] = value

  return api.pallas_call(kernel, jax.ShapeDtypeStruct(d["out"].shape, jnp.float32), grid=grid,
                         in_specs=[L.spec(pl, grid) for L in d["ins"]],
                         out_specs=d["out"].spec(pl, grid))


def _run(api: Any, d: dict[str, Any], args: tuple[Any, ...]) -> Any:
  n, transform = d["n_in"], d["transform"]
  f = _call(api, d)
  xs, extra = args[:n], args[n:]
  if transform == "vmap":
    g = jax.vmap(f, in_axes=tuple(d["in_axes"]), out_axes=d["out_axes"])
    if d["nested"]:
      g = jax.vmap(g, in_axes=tuple(0 if a is not None else None for a in d["in_axes"]))
    if d["jit"]:
      g = jax.jit(g)
    return g(*xs)
  if transform in ("jvp", "jit_jvp"):
    g = lambda *a: jax.jvp(f, tuple(a[:n]), tuple(a[n:]))
    if transform == "jit_jvp":
      g = jax.jit(g)
    return list(g(*xs, *extra))
  def loss(*a):
    return jnp.sum(f(*a[:n]) * a[n])
  grad = jax.grad(loss, argnums=d["argnums"])
  if transform == "grad":
    return list(grad(*xs, *extra))
  in_axes = tuple(d["in_axes"]) + (None,)
  return list(jax.vmap(grad, in_axes=in_axes)(*xs, *extra))

"""Block layouts as data: how an operand is cut into blocks along a grid.

The same `Layout` gives the kernel its `BlockSpec` (against either Pallas API) and the
model its windows, so the two are built from one description. Index maps are small
expression tuples over the grid indices (and scalar-prefetch tables):

  ("const", c)          c
  ("lin", a, s, o)      s * i_a + o
  ("rev", a, dyn)       n_a - 1 - i_a   (n_a from pl.num_programs(a) when dyn)
  ("div", a, d)         i_a // d        (consecutive revisits)
  ("mod", a, m)         i_a % m         (revisits that come back later)
  ("min", a, m)         min(i_a, m)     (clamped: the last block repeats)
  ("add", a, b, m)      (i_a + i_b) % m
  ("tbl", t, a)         table_t[i_a]    (scalar prefetch)
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any, Callable, Sequence

import numpy as np

Expr = tuple


def eval_index(expr: Expr, ids: Sequence[Any], tables: Sequence[Any] = (),
               num_programs: Callable[[int, bool], Any] | None = None) -> Any:
  """The value of an index expression at grid point `ids` (ints, or traced scalars in
  an index map)."""
  kind = expr[0]
  if kind == "const":
    return expr[1]
  if kind == "lin":
    _, a, s, o = expr
    return ids[a] * s + o
  if kind == "rev":
    _, a, dyn = expr
    assert num_programs is not None
    return num_programs(a, dyn) - 1 - ids[a]
  if kind == "div":
    return ids[expr[1]] // expr[2]
  if kind == "mod":
    return ids[expr[1]] % expr[2]
  if kind == "min":
    x, m = ids[expr[1]], expr[2]
    if isinstance(x, (int, np.integer)):
      return min(int(x), m)
    import jax.numpy as jnp
    return jnp.minimum(x, m)
  if kind == "add":
    _, a, b, m = expr
    return (ids[a] + ids[b]) % m
  if kind == "tbl":
    _, t, a = expr
    return tables[t][ids[a]]
  raise ValueError(f"unknown index expression {expr!r}")


def model_index(expr: Expr, ids: Sequence[int], grid: Sequence[int],
                tables: Sequence[np.ndarray] = ()) -> int:
  """`eval_index` for the model: plain ints."""
  return int(eval_index(expr, [int(i) for i in ids], tables, lambda a, dyn: grid[a]))


def index_values(expr: Expr, grid: Sequence[int], tables: Sequence[np.ndarray] = ()) -> list[int]:
  return [model_index(expr, ids, grid, tables) for ids in np.ndindex(*grid)]


@dataclasses.dataclass(frozen=True)
class Dim:
  """One array dimension of a layout: `kind` is "blocked" (block index), "squeezed"
  (element index, dimension dropped) or "element" (element offset); `spelling` is how
  the block-shape entry is written."""
  kind: str
  block: int
  index: Expr
  spelling: str = ""

  def entry(self, pl: Any) -> Any:
    if self.kind == "blocked":
      return pl.Blocked(self.block) if self.spelling == "Blocked" else self.block
    if self.kind == "squeezed":
      return {"None": None, "Squeezed": pl.Squeezed(), "squeezed": pl.squeezed}[self.spelling]
    if self.kind == "element":
      return pl.Element(self.block, (0, 0)) if self.spelling == "padding" else pl.Element(self.block)
    raise ValueError(self.kind)

  def start(self, index: int) -> int:
    return index * self.block if self.kind == "blocked" else index


@dataclasses.dataclass(frozen=True)
class Layout:
  """An operand's shape and how each grid point's block is found."""
  shape: tuple[int, ...]
  dims: tuple[Dim, ...]

  @property
  def visible_shape(self) -> tuple[int, ...]:
    return tuple(d.block for d in self.dims if d.kind != "squeezed")

  def block_shape(self, pl: Any) -> tuple:
    return tuple(d.entry(pl) for d in self.dims)

  def index_map(self, pl: Any, grid: Sequence[int]) -> Callable:
    dims, rank = self.dims, len(grid)

    def num_programs(a: int, dynamic: bool) -> Any:
      return pl.num_programs(a) if dynamic else grid[a]

    def index_map(*args):
      ids, tables = args[:rank], args[rank:]
      return tuple(eval_index(d.index, ids, tables, num_programs) for d in dims)
    return index_map

  def spec(self, pl: Any, grid: Sequence[int], **kwargs: Any) -> Any:
    return pl.BlockSpec(self.block_shape(pl), self.index_map(pl, grid), **kwargs)

  def window(self, ids: Sequence[int], grid: Sequence[int],
             tables: Sequence[np.ndarray] = ()) -> list[tuple[int, int, bool]]:
    """(start, size, squeezed) per array dimension at grid point `ids`."""
    out = []
    for d in self.dims:
      start = d.start(model_index(d.index, ids, grid, tables))
      out.append((start, d.block, d.kind == "squeezed"))
    return out

  def describe(self) -> dict:
    return {"shape": self.shape,
            "dims": [f"{d.kind}({d.block}{', ' + d.spelling if d.spelling else ''}) @ {d.index}"
                     for d in self.dims]}


def read_block(x: np.ndarray, window: list[tuple[int, int, bool]], fill: Any = 0
               ) -> tuple[np.ndarray, np.ndarray]:
  """The block a kernel sees and a mask of its elements that lie outside `x` (whose
  values are unspecified)."""
  shape = tuple(size for _, size, sq in window if not sq)
  full = tuple(size for _, size, _ in window)
  values = np.full(full, fill, dtype=x.dtype)
  outside = np.ones(full, dtype=bool)
  src, dst = [], []
  for (start, size, _), n in zip(window, x.shape):
    lo, hi = max(start, 0), min(start + size, n)
    if hi <= lo:
      return values.reshape(shape), outside.reshape(shape)
    src.append(slice(lo, hi))
    dst.append(slice(lo - start, hi - start))
  values[tuple(dst)] = x[tuple(src)]
  outside[tuple(dst)] = False
  return values.reshape(shape), outside.reshape(shape)


def write_block(out: np.ndarray, window: list[tuple[int, int, bool]], value: np.ndarray,
                *also: tuple[np.ndarray, np.ndarray]) -> None:
  """Writes the in-range part of a block into `out` (and each (array, block) pair of
  `also` at the same place: masks the model keeps beside the values)."""
  full = tuple(size for _, size, _ in window)
  visible = tuple(size for _, size, sq in window if not sq)
  src, dst = [], []
  for (start, size, _), n in zip(window, out.shape):
    lo, hi = max(start, 0), min(start + size, n)
    if hi <= lo:
      return
    dst.append(slice(lo, hi))
    src.append(slice(lo - start, hi - start))
  for array, block in ((out, value), *also):
    array[tuple(dst)] = np.broadcast_to(block, visible).reshape(full)[tuple(src)]


# ------------------------------------------------------------------ random layouts
def random_block_index(rng: random.Random, grid: Sequence[int], *, moving: bool = True,
                       tables: Sequence[np.ndarray] = ()) -> Expr:
  """A random index expression (a block index: non-negative)."""
  axes = list(range(len(grid)))
  if not axes or not moving:
    return ("const", rng.randint(0, 2))
  a = rng.choice(axes)
  choices = ["lin", "lin", "rev", "div", "mod", "min", "const"]
  if len(axes) > 1:
    choices.append("add")
  if tables:
    choices += ["tbl", "tbl"]
  kind = rng.choice(choices)
  if kind == "lin":
    return ("lin", a, 1, rng.choice([0, 0, 0, 1]))
  if kind == "rev":
    return ("rev", a, rng.random() < 0.5)
  if kind == "div":
    return ("div", a, rng.randint(2, 3))
  if kind == "mod":
    return ("mod", a, rng.randint(1, 2))
  if kind == "min":
    return ("min", a, rng.randint(0, max(grid[a] - 2, 0)))
  if kind == "add":
    b = rng.choice([x for x in axes if x != a])
    return ("add", a, b, rng.randint(2, 4))
  if kind == "tbl":
    t = rng.randrange(len(tables))
    a = rng.choice([x for x in axes if grid[x] <= len(tables[t])] or [a])
    return ("tbl", t, a)
  return ("const", rng.randint(0, 2))


def random_layout(rng: random.Random, grid: Sequence[int], visible: Sequence[int], *,
                  edges: bool = True, squeeze: bool = True, element: bool = True,
                  tables: Sequence[np.ndarray] = (), extra: bool = True) -> Layout:
  """A random layout whose blocks, as the kernel sees them, have shape `visible`.

  Edge blocks (an array size that is no multiple of the block) come only where
  `edges`; the array is always big enough that every block has an element inside.
  """
  dims = []
  for n in visible:
    if element and rng.random() < 0.2:
      axes = list(range(len(grid)))
      if axes:
        a = rng.choice(axes)
        expr = ("lin", a, rng.randint(1, 2 * n), rng.randint(0, 2))
      else:
        expr = ("const", rng.randint(0, 2))
      dims.append(Dim("element", n, expr, rng.choice(["", "padding"])))
    else:
      dims.append(Dim("blocked", n, random_block_index(rng, grid, tables=tables),
                      rng.choice(["", "", "Blocked"])))
  if squeeze and grid:
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
      expr = random_block_index(rng, grid, tables=tables)
      dims.insert(rng.randint(0, len(dims)),
                  Dim("squeezed", 1, expr, rng.choice(["None", "Squeezed", "squeezed"])))
  shape = []
  for d in dims:
    top = max(index_values(d.index, grid, tables)) if grid else model_index(d.index, (), grid, tables)
    end = d.start(top) + d.block
    if d.kind == "blocked" and edges and d.block > 1 and rng.random() < 0.4:
      end -= rng.randint(1, d.block - 1)
    elif extra and rng.random() < 0.2:
      end += rng.randint(1, 3) * (d.block if d.kind == "blocked" else 1)
    shape.append(end)
  return Layout(tuple(shape), tuple(dims))


def grid_points(grid: Sequence[int]) -> list[tuple[int, ...]]:
  return list(itertools.product(*(range(n) for n in grid)))


def covering_layout(rng: random.Random, grid: Sequence[int], visible: Sequence[int], *,
                    edges: bool = True, squeeze_spellings: Sequence[str] = ("None", "Squeezed")
                    ) -> Layout:
  """A layout that visits every block exactly once: each grid axis walks one dimension
  (forwards or reversed; axes beyond the visible rank walk squeezed dimensions), the
  other dimensions are one block wide (an edge block where `edges`)."""
  axes = list(range(len(grid)))
  rng.shuffle(axes)
  dims, shape = [], []
  for n in visible:
    a = axes.pop() if axes else None
    if a is None:
      expr, blocks = ("const", 0), 1
    else:
      expr = ("rev", a, rng.random() < 0.5) if rng.random() < 0.3 else ("lin", a, 1, 0)
      blocks = grid[a]
    cut = rng.randint(1, n - 1) if edges and n > 1 and rng.random() < 0.3 else 0
    dims.append(Dim("blocked", n, expr))
    shape.append(blocks * n - cut)
  for a in axes:
    at = rng.randint(0, len(dims))
    dims.insert(at, Dim("squeezed", 1, ("lin", a, 1, 0), rng.choice(list(squeeze_spellings))))
    shape.insert(at, grid[a])
  return Layout(tuple(shape), tuple(dims))

"""reshaped_windows: a window of a reshaped array, found as a rectangle of the array
before the reshape, covers exactly the same elements in the same order (NumPy model:
flat positions), for static and traced starts; the common layouts are found."""
import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings, strategies as st

from pallet.core import reshaped_windows


def _factorizations(n: int, max_dims: int) -> st.SearchStrategy:
  """Shapes (up to `max_dims` dimensions) whose product is `n`."""
  divisors = [d for d in range(1, n + 1) if n % d == 0]
  if max_dims == 1 or n == 1:
    return st.just((n,))
  return st.sampled_from(divisors).flatmap(
      lambda d: _factorizations(n // d, max_dims - 1).map(lambda rest: (d, *rest)))


@st.composite
def _cases(draw):
  n = draw(st.sampled_from([8, 12, 16, 24, 32, 48, 64]))
  base = draw(_factorizations(n, 4))
  view = draw(_factorizations(n, 4))
  sizes = [draw(st.integers(1, extent)) for extent in view]
  if draw(st.booleans()):   # usually a run of consecutive elements
    d0 = draw(st.integers(0, len(view) - 1))
    sizes = [1] * d0 + [sizes[d0]] + list(view[d0 + 1:])
  starts = [draw(st.integers(0, extent - size)) for extent, size in zip(view, sizes)]
  traced = [draw(st.booleans()) for _ in view]
  return base, view, starts, sizes, traced


def _flat_positions_of_view_window(view, starts, sizes) -> np.ndarray:
  flat = np.arange(math.prod(view)).reshape(view)
  return flat[tuple(slice(s, s + n) for s, n in zip(starts, sizes))].ravel()


def _flat_positions_of_base_window(base, starts, sizes) -> np.ndarray:
  flat = np.arange(math.prod(base)).reshape(base)
  return flat[tuple(slice(int(s), int(s) + n) for s, n in zip(starts, sizes))].ravel()


@settings(max_examples=400, deadline=None)
@given(_cases())
@example(((4, 6), (3, 8), [1, 2], [1, 4], [True, False]))   # row 1 of the view may cross
def test_a_rectangle_found_covers_the_same_elements_in_order(case):
  base, view, starts, sizes, traced = case
  found = reshaped_windows.in_base(base, view, starts, sizes)
  if found is not None:
    base_starts, base_sizes = found
    assert all(isinstance(s, int) for s in base_starts)
    np.testing.assert_array_equal(
        _flat_positions_of_base_window(base, base_starts, base_sizes),
        _flat_positions_of_view_window(view, starts, sizes))
  if any(traced):   # the rectangle must hold for every start a traced one may take
    _check_every_traced_start(base, view, starts, sizes, traced)


def _check_every_traced_start(base, view, starts, sizes, traced):
  holder = {}

  def starts_in_base(*traced_starts):
    it = iter(traced_starts)
    mixed = [next(it) if t else s for s, t in zip(starts, traced)]
    got = reshaped_windows.in_base(base, view, mixed, sizes)
    holder["found"] = got is not None
    if got is None:
      return jnp.zeros(len(base), jnp.int32)
    holder["sizes"] = got[1]
    return jnp.stack([jnp.asarray(s, jnp.int32) for s in got[0]])

  fn = jax.jit(starts_in_base)
  ranges = [range(extent - size + 1) if t else [s]
            for extent, size, s, t in zip(view, sizes, starts, traced)]
  for combination in _product(ranges):
    values = [jnp.int32(v) for v, t in zip(combination, traced) if t]
    got = np.asarray(fn(*values))
    if not holder["found"]:
      return
    want = _flat_positions_of_view_window(view, combination, sizes)
    np.testing.assert_array_equal(_flat_positions_of_base_window(base, got, holder["sizes"]),
                                  want)


def _product(ranges):
  if not ranges:
    yield []
    return
  for v in ranges[0]:
    for rest in _product(ranges[1:]):
      yield [v, *rest]


def test_the_common_layouts_are_rectangles():
  traced = jnp.int32(3)
  # rows of a (16, 128) array seen as (8, 8, 32): rows 2k and 2k + 1
  assert reshaped_windows.in_base((16, 128), (8, 8, 32), [5, 0, 0], [1, 8, 32]) == \
      ([10, 0], [2, 128])
  # a page of a (pages, slots, lanes) cache seen as (pages, slots * lanes), traced page
  starts = jax.jit(lambda p: jnp.stack(reshaped_windows.in_base(
      (6, 16, 4), (6, 64), [p, 0], [1, 64])[0]))(traced)
  np.testing.assert_array_equal(np.asarray(starts), [3, 0, 0])
  assert reshaped_windows.in_base((6, 16, 4), (6, 64), [traced, 0], [1, 64])[1] == [1, 16, 4]
  # rows 2k, 2k + 1 with k traced
  assert reshaped_windows.in_base((16, 128), (8, 8, 32), [traced, 0, 0], [1, 8, 32])[1] == \
      [2, 128]
  # the whole view
  assert reshaped_windows.in_base((4, 6), (3, 8), [0, 0], [3, 8]) == ([0, 0], [4, 6])


def test_windows_that_are_not_rectangles_are_refused():
  # a run crossing from one row of the base into the next
  assert reshaped_windows.in_base((4, 6), (24,), [3], [6]) is None
  # a traced start that may cross a page (slots of a paged cache merged with pages)
  assert reshaped_windows.in_base((6, 16, 4), (96, 4), [jnp.int32(5), 0], [16, 4]) is None
  # not one run of consecutive elements (a column)
  assert reshaped_windows.in_base((4, 6), (4, 6), [0, 2], [4, 1]) is None

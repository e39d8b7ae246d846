"""ref_views: one-window reads, writes and updates through `.at[...]` views agree
with JAX's view-by-view helpers, static and traced starts alike (negative,
overhanging), and stay one slice per access."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings, strategies as st

from pallet import _internals as internals
from pallet.core import ref_views


@st.composite
def _views(draw):
  """(base shape, views as (kind, static start, traced start, size) per visible
  dimension, traced flags). Static slices must lie inside their dimension (as
  `.at[]` checks); traced starts may be negative or overhang (clamped)."""
  shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
  visible, chain = list(shape), []
  for _ in range(draw(st.integers(1, 3))):
    if not visible:
      break
    indices = []
    for extent in visible:
      kind = draw(st.sampled_from(["all", "slice", "index"]))
      if kind == "all":
        indices.append(("slice", 0, 0, extent))
      elif kind == "slice":
        size = draw(st.integers(1, extent))
        indices.append(("slice", draw(st.integers(0, extent - size)),
                        draw(st.integers(-extent, extent)), size))
      else:
        start = draw(st.integers(-extent, extent))   # extent: one past the end, clamped
        indices.append(("index", start, start, 1))
    chain.append(indices)
    visible = [n for (kind, _, _, n) in indices if kind == "slice"]
  traced = draw(st.lists(st.booleans(), min_size=12, max_size=12))
  return shape, chain, traced


def _transforms(shape, chain, starts):
  """NDIndexers for `chain`, their starts taken in order from `starts`."""
  starts = iter(starts)
  transforms, visible = [], list(shape)
  for indices in chain:
    idx = tuple(internals.Slice(next(starts), n) if kind == "slice" else next(starts)
                for kind, _, _, n in indices)
    transforms.append(internals.NDIndexer(idx, tuple(visible), ()))
    visible = [n for kind, _, _, n in indices if kind == "slice"]
  return transforms


# The case that found jaxlib 0.10.2's bug (below): a traced start of -1 clamped by the
# first view, then a traced index into the result.
_CLAMPED_THEN_INDEXED = (
    (2, 1, 1, 3),
    [[("slice", 0, 0, 2), ("slice", 0, 0, 1), ("slice", 0, 0, 1), ("slice", 0, -1, 2)],
     [("slice", 0, 0, 2), ("slice", 0, 0, 1), ("slice", 0, 0, 1), ("slice", 0, 0, 2)],
     [("index", 0, 0, 1), ("slice", 0, 0, 1), ("slice", 0, 0, 1), ("index", 0, 0, 1)]],
    [False, False, False, True, False, False, False, False, True, False, False, False])


@settings(max_examples=60, deadline=None)
@given(_views(), st.integers(0, 2**31 - 1))
@example(_CLAMPED_THEN_INDEXED, 0)
def test_read_and_write_agree_with_jax(views, seed):
  """pallet's views run under `jit`, as in a kernel; JAX's helpers, the oracle, run
  op by op. Under `jit`, jaxlib 0.10.2's XLA folds a `dynamic_slice` of a
  `dynamic_slice` into one and drops the first one's clamp, so JAX's own helpers
  compiled whole read the wrong element there (`dynamic_slice(dynamic_slice(x, (2,),
  (2,)), (0,), (1,))` of `arange(3.)` gives 2., not 1.); pallet clamps each view's
  start itself and is not affected."""
  shape, chain, traced = views
  x = jax.random.normal(jax.random.key(seed), shape)
  entries = [e for indices in chain for e in indices]
  marks = [traced[i % len(traced)] for i in range(len(entries))]

  def transforms(dynamic):
    dynamic = iter(dynamic)
    return _transforms(shape, chain,
                       [next(dynamic) if m else s for (_, s, _, _), m in zip(entries, marks)])

  def value_for(old):
    return jnp.full(old.shape, 7.0) + jnp.arange(old.size, dtype=x.dtype).reshape(old.shape)

  def pallet_views(x, *dynamic):
    ts = transforms(dynamic)
    value = value_for(jax.eval_shape(lambda: ref_views.read(x, ts)))
    return (ref_views.read(x, ts), ref_views.write(x, ts, value),
            ref_views.update(x, ts, lambda v: v * 2.0 + 1.0))

  args = [jnp.int32(t) for (_, _, t, _), m in zip(entries, marks) if m]
  got_read, got_write, got_update = jax.jit(pallet_views)(x, *args)
  ts = transforms(args)
  want_read = internals.transform_array(x, ts)
  want_write = internals.transform_swap_array(x, ts, value_for(want_read))[1]
  want_update = internals.transform_swap_array(x, ts, want_read * 2.0 + 1.0)[1]
  assert got_read.shape == want_read.shape
  np.testing.assert_array_equal(got_read, want_read)
  np.testing.assert_array_equal(got_write, want_write)
  np.testing.assert_array_equal(got_update, want_update)


def test_static_views_are_one_slice_and_one_update():
  x = jnp.zeros((3, 8, 128))
  ts = [internals.NDIndexer((1, internals.Slice(0, 8), internals.Slice(0, 128)), x.shape, ()),
        internals.NDIndexer((internals.Slice(2, 4), internals.Slice(0, 128)), (8, 128), ())]
  read = jax.make_jaxpr(lambda x: ref_views.read(x, ts))(x)
  assert [e.primitive.name for e in read.jaxpr.eqns] == ["slice", "reshape"]
  write = jax.make_jaxpr(lambda x: ref_views.write(x, ts, jnp.ones((4, 128))))(x)
  names = [e.primitive.name for e in write.jaxpr.eqns]
  assert "dynamic_slice" not in names and names.count("dynamic_update_slice") == 1


def test_strided_views_fall_back_to_jax():
  x = jnp.arange(24.0).reshape(4, 6)
  ts = [internals.NDIndexer((internals.Slice(0, 2, 2), internals.Slice(1, 3)), x.shape, ())]
  np.testing.assert_array_equal(ref_views.read(x, ts), x[0:4:2, 1:4])
  np.testing.assert_array_equal(ref_views.write(x, ts, jnp.zeros((2, 3))),
                                x.at[0:4:2, 1:4].set(0.0))


def test_a_static_index_past_the_end_is_clamped_as_jax_clamps_it():
  x = jnp.arange(12.0).reshape(3, 4)
  ts = [internals.NDIndexer((3, internals.Slice(1, 2)), x.shape, ())]
  read = jax.jit(lambda x: (ref_views.read(x, ts), internals.transform_array(x, ts)))
  np.testing.assert_array_equal(*read(x))
  write = jax.jit(lambda x, v: (ref_views.write(x, ts, v),
                                internals.transform_swap_array(x, ts, v)[1]))
  np.testing.assert_array_equal(*write(x, jnp.zeros((2,))))

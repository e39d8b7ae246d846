"""NamedRef: the seed document's walk-through, then every rule of specs/named_refs.md."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallet.named as hax  # the seed's spelling
from pallet.named import selection

Batch, Feature = hax.make_axes(Batch=4, Feature=8)
Cache = hax.Axis("layer", 24)
Head = hax.Axis("head", 8)


def rand(axes, seed=0):
  return hax.random.normal(jax.random.PRNGKey(seed), axes)


# ============================================================ the seed, block by block


def test_seed_creating_a_named_ref():
  weights = hax.random.normal(jax.random.PRNGKey(0), (Batch, Feature))
  weights_ref = hax.new_ref(weights)
  assert weights_ref.axes == weights.axes
  assert weights_ref.shape == {"Batch": 4, "Feature": 8}
  np.testing.assert_array_equal(weights_ref[...].array, weights.array)


def test_seed_normalize_stages_intermediates_in_a_fresh_ref():
  @jax.jit
  def normalize(x: hax.NamedArray) -> hax.NamedArray:
    ref = hax.new_ref(x)
    ref[{"Batch": slice(None)}] = ref[{"Batch": slice(None)}] - hax.mean(x, axis=Batch)
    return ref[...]

  x = rand((Batch, Feature), 3)
  out = normalize(x)
  assert isinstance(out, hax.NamedArray) and out.axes == (Batch, Feature)
  np.testing.assert_allclose(out.array, x.array - x.array.mean(0), rtol=1e-5, atol=1e-6)


def test_seed_reading_and_writing():
  logits_ref = hax.new_ref(hax.zeros((Batch, Feature)))
  logits = logits_ref[{"Batch": 0}]
  assert logits.axes == (Feature,)
  new_row = hax.random.uniform(jax.random.PRNGKey(1), logits.axes)
  logits_ref[{"Batch": 0}] = new_row
  assert logits_ref[{"Batch": 0}].array is not None
  np.testing.assert_array_equal(logits_ref[{"Batch": 0}].array, new_row.array)
  np.testing.assert_array_equal(logits_ref[{"Batch": slice(1, None)}].array, np.zeros((3, 8)))
  np.testing.assert_array_equal(hax.ref.get(logits_ref, {"Batch": 0}).array, new_row.array)
  np.testing.assert_array_equal(hax.get(logits_ref, sel=...).array, logits_ref[...].array)


def test_seed_slice_refs():
  cache_ref = hax.new_ref(hax.zeros((Cache, Head)))
  window = cache_ref.slice({"layer": slice(4, 8)})
  assert window.axes == (Cache.resize(4), Head)
  window[{"layer": 0, "head": 3}] = 1.0  # updates layer 4, head 3 in the original buffer
  window_value = window.value()
  assert window_value.axes == (Cache.resize(4), Head)
  expected = np.zeros((24, 8))
  expected[4, 3] = 1.0
  np.testing.assert_array_equal(cache_ref[...].array, expected)
  np.testing.assert_array_equal(window_value.array, expected[4:8])


def test_seed_slice_refs_compose():
  cache_ref = hax.new_ref(hax.zeros((Cache, Head)))
  row = rand((Head,), 2)
  cache_ref.slice({"layer": slice(1, 4)}).slice({"layer": 0})[...] = row
  expected = np.zeros((24, 8))
  expected[1] = row.array  # the second layer
  np.testing.assert_array_equal(cache_ref.value().array, expected)


def test_seed_unsliced_recovers_the_whole_buffer():
  cache_ref = hax.new_ref(rand((Cache, Head)))
  inner = cache_ref.slice({"layer": 3}).slice({"head": slice(2, 4)})
  whole = inner.unsliced()
  assert whole.axes == (Cache, Head)
  np.testing.assert_array_equal(whole.value().array, cache_ref.value().array)


def test_seed_collect_metrics_with_stop_gradient():
  def collect_metrics(x, stats_ref):
    y = hax.sin(x)
    stats_ref[{"Batch": slice(None)}] += jax.lax.stop_gradient(y)
    return y

  x = rand((Batch, Feature), 4)
  stats = hax.new_ref(hax.ones((Batch, Feature)))
  y = collect_metrics(x, stats)
  np.testing.assert_allclose(stats.value().array, 1 + np.sin(x.array), rtol=1e-6)

  def loss(x):
    stats_ref = hax.new_ref(hax.zeros((Batch, Feature)))
    y = collect_metrics(x, stats_ref)
    return (y.sum() + stats_ref.value().sum()).array  # the stats carry no gradient
  np.testing.assert_allclose(jax.grad(loss)(x).array, np.cos(x.array), rtol=1e-6)
  assert y.axes == x.axes


def test_seed_freeze_and_swap():
  cache_ref = hax.new_ref(rand((Cache, Head), 5))
  before = np.asarray(cache_ref.value().array)
  final = hax.freeze(cache_ref)
  assert isinstance(final, hax.NamedArray)
  prev = hax.swap(cache_ref, {"layer": slice(0, 2)}, hax.ones((Cache.resize(2), Head)))
  assert prev.axes == (Cache.resize(2), Head)
  np.testing.assert_array_equal(prev.array, before[:2])
  np.testing.assert_array_equal(cache_ref[{"layer": slice(0, 2)}].array, np.ones((2, 8)))
  np.testing.assert_array_equal(cache_ref[{"layer": slice(2, None)}].array, before[2:])
  np.testing.assert_array_equal(final.array, before)  # the frozen value did not change


def test_seed_ref_restrictions_raise_jax_errors():
  ref = hax.new_ref(rand((Batch, Feature)))
  with pytest.raises(ValueError, match="cannot be returned"):
    jax.jit(lambda x: hax.new_ref(x))(rand((Batch,)))
  with pytest.raises(ValueError, match="only one reference to a mutable array"):
    jax.jit(lambda a, b: a[...] + b[...])(ref, ref)

  def closes_over(a):
    a[...] = ref[...] + 1
  with pytest.raises(ValueError, match="both closed over and passed as the argument"):
    jax.jit(closes_over)(ref)


# ============================================================ creating and reading


def test_new_ref_from_raw_array_and_axis_spec():
  raw = jax.random.normal(jax.random.PRNGKey(0), (4, 8))
  by_name = hax.new_ref(raw, ("Batch", "Feature"))
  by_axis = hax.new_ref(raw, (Batch, Feature))
  assert by_name.axes == by_axis.axes == (Batch, Feature)
  assert by_name.ndim == 2 and by_name.dtype == jnp.float32
  np.testing.assert_array_equal(by_name[...].array, raw)
  with pytest.raises(TypeError, match="a raw array needs its axes"):
    hax.new_ref(raw)
  with pytest.raises(TypeError, match="axes are taken from the NamedArray"):
    hax.new_ref(hax.named(raw, ("Batch", "Feature")), ("x", "y"))
  with pytest.raises(ValueError, match="axis 'Feature' has size 8 but the array has 4"):
    hax.new_ref(raw.T, (Batch.resize(8), Feature))
  with pytest.raises(ValueError, match=r"NamedRef: ref of shape \(4, 8\) does not match"):
    hax.NamedRef(jax.new_ref(raw), (Feature, Batch))


def test_axes_of_a_view_drop_fixed_and_resize_sliced():
  ref = hax.new_ref(rand((Cache, Head, Feature)))
  view = ref.slice({"layer": 2, "head": slice(1, 7, 2)})
  assert view.axes == (Head.resize(3), Feature)
  assert view.shape == {"head": 3, "Feature": 8} and view.ndim == 2


def test_negative_ints_count_from_the_end_of_the_view():
  x = rand((Cache, Head))
  ref = hax.new_ref(x)
  np.testing.assert_array_equal(ref[{"layer": -1}].array, x.array[-1])
  window = ref.slice({"layer": slice(4, 10)})
  np.testing.assert_array_equal(window[{"layer": -1, "head": -2}].array, x.array[9, 6])
  np.testing.assert_array_equal(window.slice({"layer": -2})[...].array, x.array[8])


def test_out_of_range_and_unknown_axes():
  ref = hax.new_ref(rand((Cache, Head)))
  with pytest.raises(IndexError, match="index 24 is out of range for axis 'layer' of size 24"):
    ref[{"layer": 24}]
  window = ref.slice({"layer": slice(0, 4)})
  with pytest.raises(IndexError, match="index -5 is out of range for axis 'layer' of size 4"):
    window[{"layer": -5}]
  with pytest.raises(IndexError, match=r"ds\(start=3, size=2, stride=1\) is out of range for "
                                       "axis 'layer' of size 4"):
    window[{"layer": hax.ds(3, 2)}]
  with pytest.raises(ValueError, match=r"unknown axis 'heads'; the axes are \('layer', 'head'\)"):
    ref[{"heads": 0}]
  with pytest.raises(ValueError, match="axis 'head' is selected twice"):
    ref[{"head": 0, Head: 1}]
  with pytest.raises(IndexError, match="at most one"):
    ref[..., 0, ...]
  with pytest.raises(IndexError, match="too many indices"):
    ref[0, 0, 0]
  with pytest.raises(TypeError, match="slice bounds must be static ints"):
    jax.jit(lambda i: ref[{"layer": slice(i, i + 2)}])(1)
  with pytest.raises(ValueError, match="slice step must be positive"):
    ref[{"layer": slice(None, None, -1)}]
  with pytest.raises(TypeError, match="unsupported indexer 'x'"):
    ref[{"layer": "x"}]
  with pytest.raises(TypeError, match="ds needs a static size >= 0 and stride >= 1"):
    ref[{"layer": hax.ds(0, 2, 0)}]
  with pytest.raises(TypeError, match="axis 'layer': expected an integer scalar"):
    jax.jit(lambda f: ref[{"layer": hax.ds(f, 2)}])(1.0)
  with pytest.raises(TypeError, match="an Ellipsis key must map to"):
    ref[{...: 0}]


def test_positional_selection_and_ellipsis_fill_axes_in_order():
  x = rand((Batch, Cache, Head))
  ref = hax.new_ref(x)
  np.testing.assert_array_equal(ref[1, ..., 2].array, x.array[1, :, 2])
  assert ref[1, ..., 2].axes == (Cache,)
  np.testing.assert_array_equal(ref[{"head": 3, ...: ...}].array, x.array[:, :, 3])


# ============================================================ composition arithmetic


def _prefix_of(ref, name):
  return ref.prefix[[ax.name for ax in ref.base_axes].index(name)]


def test_slice_then_slice_with_strides():
  x = rand((Cache, Head))
  ref = hax.new_ref(x)
  view = ref.slice({"layer": slice(1, 9, 2)}).slice({"layer": slice(1, 3)})
  assert _prefix_of(view, "layer") == selection.Range(3, 2, 2)  # ds(3, 2, stride=2)
  np.testing.assert_array_equal(view.value().array, x.array[1:9:2][1:3])
  np.testing.assert_array_equal(view.value().array, x.array[3:7:2])
  double = ref.slice({"layer": slice(2, 20, 3)}).slice({"layer": slice(1, None, 2)})
  np.testing.assert_array_equal(double.value().array, x.array[2:20:3][1::2])


def test_ds_then_slice_and_slice_then_ds():
  x = rand((Cache, Head))
  ref = hax.new_ref(x)
  a = ref.slice({"layer": hax.ds(5, 10, 2)}).slice({"layer": slice(2, 8, 3)})
  np.testing.assert_array_equal(a.value().array, x.array[5:25:2][2:8:3])
  b = ref.slice({"layer": slice(3, 23)}).slice({"layer": hax.ds(4, 3, 5)})
  assert _prefix_of(b, "layer") == selection.Range(7, 3, 5)
  np.testing.assert_array_equal(b.value().array, x.array[3:23][4:15:5])
  b[{"layer": 1}] = -1.0
  assert float(ref[{"layer": 12, "head": 0}].array) == -1.0


def test_ints_in_a_prefix_fix_their_axis():
  ref = hax.new_ref(rand((Batch, Cache, Head)))
  view = ref.slice({"layer": 5}).slice({"Batch": -1})
  assert view.axes == (Head,)
  np.testing.assert_array_equal(view.value().array, ref[...].array[3, 5])
  with pytest.raises(IndexError, match="axis 'layer' is already fixed by an integer"):
    view.slice({"layer": 0})
  with pytest.raises(IndexError, match="axis 'layer' is already fixed by an integer"):
    view[{"layer": 0}]


def test_array_prefixes_are_not_implemented():
  ref = hax.new_ref(rand((Cache, Head)))
  with pytest.raises(NotImplementedError, match="cannot be staged in a slice ref"):
    ref.slice({"layer": jnp.array([0, 2])})
  with pytest.raises(NotImplementedError, match="cannot be staged in a slice ref"):
    ref.slice({"layer": hax.named(jnp.array([0, 2]), ("k",))})


# ============================================================ NumPy axis placement


def test_numpy_placement_when_ints_arrays_and_slices_mix():
  Aa, Bb, Cc, Dd = hax.make_axes(a=5, b=6, c=7, d=3)
  x = rand((Aa, Bb, Cc, Dd))
  raw = np.asarray(x.array)
  ref = hax.new_ref(x)
  idx = jnp.array([4, 0, 2])
  named_idx = hax.named(idx, ("k",))
  # int and array adjacent: the broadcast axis stays in place
  got = ref[{"b": named_idx, "c": 1}]
  assert got.names == ("a", "k", "d")
  np.testing.assert_array_equal(got.array, raw[:, np.asarray(idx), 1])
  # non-adjacent advanced indices: the broadcast axis goes first
  got = ref[{"a": named_idx, "c": 1}]
  assert got.names == ("k", "b", "d")
  np.testing.assert_array_equal(got.array, raw[np.asarray(idx), :, 1])
  # only ints and slices: basic indexing, axes keep their order
  assert ref[{"a": 1, "c": 2}].names == ("b", "d")
  # an unnamed 1-d array keeps the axis name with the new size; with the int on a
  # (not adjacent to d) NumPy puts it first
  got = ref[{"d": jnp.array([2, 2, 0, 1]), "a": 0}]
  assert got.axes == (Dd.resize(4), Bb, Cc)
  np.testing.assert_array_equal(got.array, raw[0, :, :, [2, 2, 0, 1]])
  # two named indexers broadcast by name
  other = hax.named(jnp.array([1, 3]), ("m",))
  got = ref[{"a": named_idx, "b": other}]
  assert got.names == ("k", "m", "c", "d")
  np.testing.assert_array_equal(got.array, raw[np.asarray(idx)[:, None], np.array([1, 3])[None]])


def test_placement_inside_a_slice_ref_follows_the_view():
  Aa, Bb, Cc = hax.make_axes(a=5, b=6, c=7)
  x = rand((Aa, Bb, Cc))
  view = hax.new_ref(x).slice({"a": 2})  # view axes (b, c)
  named_idx = hax.named(jnp.array([6, 0]), ("k",))
  got = view[{"c": named_idx}]
  assert got.names == ("b", "k")  # as NumPy would index the (b, c) view
  np.testing.assert_array_equal(got.array, np.asarray(x.array)[2][:, [6, 0]])
  view[{"c": named_idx}] = hax.named(jnp.arange(12.).reshape(2, 6), ("k", "b"))
  np.testing.assert_array_equal(x.array[2][:, [6, 0]] * 0 + np.arange(12.).reshape(2, 6).T,
                                view[{"c": named_idx}].array)


def test_call_time_arrays_compose_with_a_strided_prefix():
  x = rand((Cache, Head))
  ref = hax.new_ref(x)
  strided = ref.slice({"layer": slice(1, 20, 3)})  # layers 1, 4, ..., 19 (7 of them)
  picks = hax.named(jnp.array([0, -1, 2]), ("pick",))  # negatives count from the view's end
  np.testing.assert_array_equal(strided[{"layer": picks}].array,
                                np.asarray(x.array)[[1, 19, 7]])
  strided[{"layer": picks, "head": 0}] = hax.named(jnp.array([7.0, 8.0, 9.0]), ("pick",))
  np.testing.assert_array_equal(ref[{"head": 0}].array[np.array([1, 19, 7])], [7.0, 8.0, 9.0])


def test_indexing_errors_for_arrays():
  ref = hax.new_ref(rand((Cache, Head)))
  with pytest.raises(TypeError, match="must be 0-d or 1-d"):
    ref[{"layer": jnp.zeros((2, 2), jnp.int32)}]
  with pytest.raises(TypeError, match="array indexers must hold integers"):
    ref[{"layer": jnp.zeros((2,))}]
  with pytest.raises(TypeError, match="a NamedArray indexer must hold integers"):
    ref[{"layer": hax.zeros((hax.Axis("k", 2),))}]
  with pytest.raises(ValueError, match="would produce axis 'head' twice"):
    ref[{"layer": hax.named(jnp.array([1, 2]), ("head",))}]


# ============================================================ writing


def test_write_scalar_raw_array_and_transposed_named_array():
  ref = hax.new_ref(rand((Batch, Feature, Head), 1))
  ref[{"Batch": 0}] = 2.0
  np.testing.assert_array_equal(ref[{"Batch": 0}].array, np.full((8, 8), 2.0))
  raw = jax.random.normal(jax.random.PRNGKey(2), (8, 8))
  ref[{"Batch": 1}] = raw  # a raw array of the target shape, in view order
  np.testing.assert_array_equal(ref[{"Batch": 1}].array, raw)
  transposed = rand((Head, Feature), 3)
  ref[{"Batch": 2}] = transposed
  np.testing.assert_array_equal(ref[{"Batch": 2}].array, transposed.array.T)
  broadcast = rand((Head,), 4)  # lacks Feature: repeated along it
  ref[{"Batch": 3}] = broadcast
  np.testing.assert_array_equal(ref[{"Batch": 3}].array, np.broadcast_to(broadcast.array, (8, 8)))
  ref[{"Batch": 3}] = jnp.int32(7)  # an int into a float ref is safe
  assert float(ref[{"Batch": 3, "head": 0, "Feature": 0}].array) == 7.0


def test_write_augmented_assignment():
  x = rand((Batch, Feature))
  ref = hax.new_ref(x)
  delta = rand((Feature,), 1)
  ref[{"Batch": slice(1, 3)}] += delta
  expected = np.asarray(x.array).copy()
  expected[1:3] += np.asarray(delta.array)
  np.testing.assert_allclose(ref.value().array, expected, rtol=1e-6)


def test_write_errors():
  ref = hax.new_ref(rand((Batch, Feature)))
  with pytest.raises(ValueError, match="axis 'head' is not in the target"):
    ref[{"Batch": 0}] = rand((Feature, Head))
  with pytest.raises(ValueError, match="axis 'Feature' has size 4, the target 8"):
    ref[{"Batch": 0}] = rand((Feature.resize(4),))
  with pytest.raises(ValueError, match=r"unnamed array of shape \(4,\)"):
    ref[{"Batch": 0}] = jnp.ones(4)
  int_ref = hax.new_ref(hax.zeros((Batch,), jnp.int32))
  with pytest.raises(TypeError, match="cannot write a float32 value into a int32 ref"):
    int_ref[...] = rand((Batch,))
  with pytest.raises(TypeError, match="cannot write a float"):
    int_ref[{"Batch": 0}] = 1.5


def test_gather_writes_and_swap_through_named_indexer():
  x = rand((Cache, Head))
  ref = hax.new_ref(x)
  rows = hax.named(jnp.array([3, 7]), ("pick",))
  new = rand((Head, hax.Axis("pick", 2)), 9)
  old = hax.swap(ref, {"layer": rows}, new)
  assert old.names == ("pick", "head")
  np.testing.assert_array_equal(old.array, np.asarray(x.array)[[3, 7]])
  np.testing.assert_array_equal(ref[{"layer": rows}].array, new.array.T)


def test_freeze_is_a_snapshot_and_the_ref_stays_usable():
  ref = hax.new_ref(rand((Batch, Feature)))
  frozen = ref.freeze()
  ref[...] = 0.0
  assert not np.allclose(frozen.array, 0.0)
  np.testing.assert_array_equal(ref.value().array, np.zeros((4, 8)))
  window_snapshot = hax.freeze(ref.slice({"Batch": 1}))
  assert window_snapshot.axes == (Feature,)


# ============================================================ transformations


def test_pytree_only_leaf_is_the_jax_ref():
  ref = hax.new_ref(rand((Cache, Head))).slice({"layer": slice(2, 6)})
  leaves, tree = jax.tree_util.tree_flatten({"cache": ref, "n": 1})
  assert len(leaves) == 2 and leaves[0] is ref.ref
  back = jax.tree_util.tree_unflatten(tree, leaves)["cache"]
  assert back.axes == ref.axes and back.prefix == ref.prefix and back.ref is ref.ref
  mapped = jax.tree_util.tree_map(lambda leaf: leaf, ref)
  assert isinstance(mapped, hax.NamedRef) and mapped.axes == ref.axes


def test_named_ref_over_a_jax_ref_view_made_with_at():
  x = rand((Cache, Head))

  @jax.jit
  def f(raw):
    buffer = jax.new_ref(raw)
    rows = hax.NamedRef(buffer.at[2:6], (Cache.resize(4), Head))  # JAX's own ref view
    rows[{"layer": 1}] = rows[{"layer": 0}] * 10.0
    return buffer[...]

  expected = np.asarray(x.array).copy()
  expected[3] = expected[2] * 10
  np.testing.assert_allclose(f(x.array), expected, rtol=1e-6)


def test_jit_mutation_is_visible_after_the_call_and_structure_is_static():
  traces = []

  @jax.jit
  def write_row(ref, value):
    traces.append(1)
    ref[{"layer": 1}] = value

  ref = hax.new_ref(hax.zeros((Cache, Head)))
  row = rand((Head,), 7)
  write_row(ref, row)
  np.testing.assert_array_equal(ref[{"layer": 1}].array, row.array)
  other = hax.new_ref(rand((Cache, Head), 8))
  write_row(other, row)  # same axes and prefix: no retrace
  assert len(traces) == 1
  window = other.slice({"layer": slice(4, 8)})
  write_row(window, row * 2)  # a different prefix is different static structure
  assert len(traces) == 2
  np.testing.assert_array_equal(other[{"layer": 5}].array, 2 * row.array)


def test_scan_with_a_traced_integer_in_slice():
  Time = hax.Axis("time", 6)
  x = rand((Feature,), 1)

  @jax.jit
  def fill(x):
    out = hax.new_ref(hax.zeros((Time, Feature)))

    def body(carry, t):
      out.slice({"time": t})[...] = x * t.astype(jnp.float32)
      out.slice({"time": hax.ds(t, 1)})[{"time": 0, "Feature": 0}] += 100.0
      return carry, None
    jax.lax.scan(body, 0, jnp.arange(Time.size))
    return out.value()

  got = fill(x)
  expected = np.arange(6)[:, None] * np.asarray(x.array)[None]
  expected[:, 0] += 100
  np.testing.assert_allclose(got.array, expected, rtol=1e-6)


def test_grad_through_a_scan_that_fills_a_ref():
  Time = hax.Axis("time", 5)
  w = rand((Feature,), 2)

  def loss(w):
    out = hax.new_ref(hax.zeros((Time, Feature)))

    def body(h, t):
      h = hax.tanh(h * w + 1.0)
      out.slice({"time": t})[...] = h
      return h, None
    jax.lax.scan(body, hax.ones((Feature,)), jnp.arange(Time.size))
    return hax.sum(out.value() ** 2).array

  def reference(w):
    h, total = jnp.ones(8), 0.0
    for _ in range(5):
      h = jnp.tanh(h * w + 1.0)
      total = total + jnp.sum(h ** 2)
    return total

  g = jax.grad(loss)(w)
  assert g.axes == (Feature,)
  np.testing.assert_allclose(g.array, jax.grad(reference)(w.array), rtol=1e-5, atol=1e-6)


def test_vmap_of_a_function_that_creates_refs():
  def step(raw):
    x = hax.named(raw, (Batch, Feature))
    ref = hax.new_ref(x)
    ref[{"Batch": 0}] = ref[{"Batch": 0}] * 3.0
    ref.slice({"Feature": slice(0, 4)})[...] += 1.0
    return ref.value().array

  raws = jax.random.normal(jax.random.PRNGKey(3), (3, 4, 8))
  expected = np.asarray(raws).copy()
  expected[:, 0] *= 3
  expected[:, :, :4] += 1
  np.testing.assert_allclose(jax.vmap(step)(raws), expected, rtol=1e-6)


def test_slice_ref_with_a_traced_prefix_inside_scan_and_jit():
  x = rand((Cache, Head))
  ref, out = hax.new_ref(x), hax.new_ref(hax.zeros((Cache, Head)))

  def body(carry, t):
    doubled = jax.jit(lambda r: r.value() * 2)(ref.slice({"layer": t}))
    out.slice({"layer": t})[...] = doubled
    # such a ref's structure is not static: comparing it fails with our message
    a = jax.tree_util.tree_structure(ref.slice({"layer": t}))
    b = jax.tree_util.tree_structure(ref.slice({"layer": t + 1}))
    with pytest.raises(ValueError) as failure:
      a == b  # noqa: B015
    cause = failure.value.__cause__ or failure.value.__context__
    assert "slice prefix holds a traced index" in str(cause)
    return carry, None
  jax.lax.scan(body, 0, jnp.arange(Cache.size))
  np.testing.assert_allclose(out.value().array, 2 * x.array)

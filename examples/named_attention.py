"""Attention over named axes: a pallet kernel that never counts dimensions.

You will learn how `pallet.named` writes a kernel by axis name:
  * inputs are `NamedArray`s with axes batch / head / seq / feature (keys use `key`),
  * the grid and the blocks are given by name (`grid={"batch": ..., "seq": ...}`,
    `block={"batch": None, "seq": 64}`), so each operand is cut by the axes it has,
    whatever order they are stored in,
  * the kernel receives `NamedRef`s over its blocks and slices them by name
    (`k_ref.slice({"key": pn.ds(start, size)})`) inside a `fori_loop`,
  * the output comes back as a `NamedArray`.
The kernel is flash attention: it walks the keys in blocks, keeping a running max and
sum for a numerically safe softmax. Run it: `python examples/named_attention.py`.
"""
# %%
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallet.named as pn

Batch, Head, Seq, Feature = pn.make_axes(batch=2, head=4, seq=256, feature=64)
Key = pn.Axis("key", Seq.size)  # keys get their own name: scores are (seq, key)


# %%
# The kernel runs once per (batch, head, query block). `None` blocks for batch and
# head hide those axes, so the kernel sees:
#   q_ref: (seq=block_q, feature)  this program's queries
#   k_ref: (key, feature)          every key of this batch and head
#   v_ref: (key, feature)          every value of this batch and head
#   o_ref: (seq=block_q, feature)  where this program's output rows go
def attention_kernel(q_ref, k_ref, v_ref, o_ref, *, block_k: int):
  q = q_ref[...] * (1.0 / np.sqrt(q_ref.shape["feature"]))
  rows = q_ref.axes[0]

  def visit_key_block(j, carry):
    running_max, running_sum, acc = carry
    keys = {"key": pn.ds(j * block_k, block_k)}
    k, v = k_ref.slice(keys).value(), v_ref[keys]  # a slice ref, or index directly
    scores = pn.dot(q, k, axis="feature")                      # (seq, key)
    new_max = pn.maximum(running_max, pn.max(scores, "key"))   # (seq,)
    p = pn.exp(scores - new_max)                                # broadcast by name
    rescale = pn.exp(running_max - new_max)
    running_sum = running_sum * rescale + pn.sum(p, "key")
    acc = acc * rescale + pn.dot(p, v, axis="key")             # (seq, feature)
    return new_max, running_sum, acc

  start = (pn.full((rows,), -jnp.inf), pn.zeros((rows,)), pn.zeros(q.axes))
  n_blocks = k_ref.shape["key"] // block_k
  _, total, acc = jax.lax.fori_loop(0, n_blocks, visit_key_block, start)
  o_ref[...] = (acc / total).astype(o_ref.dtype)


# %%
# The host wrapper: a named grid, block sizes by name, the output shaped like q.
# Cut axes take their block index from the grid axis of the same name; `key` is not
# cut, so k and v arrive whole for each (batch, head).
def attention(q: pn.NamedArray, k: pn.NamedArray, v: pn.NamedArray, *, block_q: int = 64,
              block_k: int = 64) -> pn.NamedArray:
  grid = {"batch": q.shape["batch"], "head": q.shape["head"],
          "seq": q.shape["seq"] // block_q}
  return pn.pallas_call(functools.partial(attention_kernel, block_k=block_k), out_shape=q,
                        grid=grid, block={"batch": None, "head": None, "seq": block_q})(q, k, v)


def reference(q: pn.NamedArray, k: pn.NamedArray, v: pn.NamedArray) -> jax.Array:
  """Plain jax.numpy attention on the raw arrays, laid out (batch, head, seq, feature)."""
  qa = q.rearrange(("batch", "head", "seq", "feature")).array
  ka = k.rearrange(("batch", "head", "key", "feature")).array
  va = v.rearrange(("batch", "head", "key", "feature")).array
  scores = jnp.einsum("bhsd,bhkd->bhsk", qa, ka) / np.sqrt(qa.shape[-1])
  return jnp.einsum("bhsk,bhkd->bhsd", jax.nn.softmax(scores, axis=-1), va)


# %%
def inputs(seed: int = 0):
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = pn.random.normal(kq, (Batch, Head, Seq, Feature))
  k = pn.random.normal(kk, (Batch, Key, Head, Feature))   # stored in another order:
  v = pn.random.normal(kv, (Head, Batch, Key, Feature))   # names make that irrelevant
  return q, k, v


def check() -> None:
  q, k, v = inputs()
  out = attention(q, k, v)
  assert out.axes == q.axes
  want = reference(q, k, v)
  np.testing.assert_allclose(out.array, want, rtol=2e-4, atol=2e-5)
  print(f"named attention over {dict(q.shape)} matches jax.numpy: max |difference| "
        f"{float(jnp.max(jnp.abs(out.array - want))):.1e}")


# %% Timing against jax.numpy (median of `reps` runs after a warm-up that compiles).
def median_ms(fn, *args, reps: int = 7) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def benchmark(reps: int = 7) -> None:
  q, k, v = inputs(1)
  print(f"{'implementation':<22}{'ms':>10}")
  for label, fn in [("pallet.named kernel", jax.jit(attention)),
                    ("jax.numpy", jax.jit(reference))]:
    print(f"{label:<22}{median_ms(fn, q, k, v, reps=reps):>10.2f}")


if __name__ == "__main__":
  check()
  benchmark()

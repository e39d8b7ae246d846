"""In-kernel random numbers (`pltpu.prng_seed`, `prng_random_bits`, `stateful_*`,
`sample_block`, `to_pallas_key`): a documented deterministic generator.

A TPU core has a hardware generator: `prng_seed(*seeds)` sets its state and each
`prng_random_bits(shape)` draws the next bits. pallet keeps the same contract
with a counter-based generator, so the same seeds always give the same bits on
every pallet backend (they differ from a TPU's hardware bits; see
docs/semantics.md):

* the state is a 64-bit key and a draw counter, held per traced kernel body;
* `prng_seed(s0, s1, ...)` starts from a fixed key and mixes every 32-bit word
  of every seed in with Threefry-2x32 (20 rounds, the hash behind jax.random),
  and resets the counter;
* draw `c` of shape S is, for element `i` in row-major order, the first word of
  Threefry-2x32(key, (c, i)).

A draw inside a loop body (fori_loop, scan, pl.loop) from a generator seeded
outside it would repeat the same bits in every iteration, so it is an error: seed
inside the loop (e.g. with the loop index) instead.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Callable, Sequence

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallet.core import primitives
from pallet.errors import PalletError
from pallet.core.unsupported import describe_call_site

# ------------------------------------------------------------------ Threefry-2x32
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def _rotl(x: jax.Array, r: int) -> jax.Array:
  return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def threefry2x32(key: tuple[Any, Any], count: tuple[Any, Any]) -> tuple[jax.Array, jax.Array]:
  """Threefry-2x32 with 20 rounds (Salmon et al. 2011), in uint32 jax.numpy."""
  k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
  ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(_PARITY))
  x0 = jnp.asarray(count[0], jnp.uint32) + ks[0]
  x1 = jnp.asarray(count[1], jnp.uint32) + ks[1]
  for block in range(5):
    for r in _ROTATIONS[block % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(block + 1) % 3]
    x1 = x1 + ks[(block + 2) % 3] + jnp.uint32(block + 1)
  return x0, x1


# ------------------------------------------------------------------ generator state
_INITIAL_KEY = (0x243F6A88, 0x85A308D3)


@dataclasses.dataclass
class _State:
  key: tuple[Any, Any]
  counter: int
  loop_depth: int


def _loop_depth() -> int:
  """How many JAX loop bodies (scan / while) are being traced around the caller."""
  depth, frame = 0, sys._getframe(1)
  while frame is not None:
    code = frame.f_code
    if code.co_name in ("scan", "while_loop") and "control_flow" in code.co_filename:
      depth += 1
    frame = frame.f_back
  return depth


def _kernel_context(fn_name: str) -> Any:
  if not primitives._grid_contexts:
    raise PalletError(f"pltpu.{fn_name} may only be called inside a kernel; called "
                      f"{describe_call_site()}")
  return primitives._grid_contexts[-1]


def _seed_words(seed: Any) -> list[jax.Array]:
  arr = jnp.asarray(seed)
  if jnp.issubdtype(arr.dtype, jax.dtypes.prng_key):
    arr = jax.random.key_data(arr)
  if not (jnp.issubdtype(arr.dtype, jnp.integer) or arr.dtype == jnp.bool_):
    raise PalletError(f"pltpu.prng_seed: seeds must be integers, got {arr.dtype} in "
                      f"{describe_call_site()}")
  if arr.dtype.itemsize == 8:
    arr = lax.bitcast_convert_type(arr, jnp.uint32)
  return list(arr.astype(jnp.uint32).reshape(-1))


def _generator_key(words: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """The generator's key after seeding with `words`, mixed in one by one."""
  key = tuple(jnp.uint32(k) for k in _INITIAL_KEY)
  for position, word in enumerate(words):
    key = threefry2x32(key, (word, jnp.uint32(position)))
  return key


def _draw(key: tuple[Any, Any], counter: int, shape: Sequence[int]) -> tuple[jax.Array, jax.Array]:
  """Both output words of draw number `counter` of `shape`."""
  shape = tuple(int(d) for d in shape)
  index = lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
  return threefry2x32(key, (jnp.uint32(counter), index))


def prng_seed(*seeds: Any) -> None:
  """Seeds this kernel's generator from integer scalars or arrays (e.g. key data)."""
  ctx = _kernel_context("prng_seed")
  words = [w for s in seeds for w in _seed_words(s)]
  if not words:
    raise PalletError(f"pltpu.prng_seed needs at least one seed ({describe_call_site()})")
  ctx.pallet_prng = _State(key=_generator_key(words), counter=0, loop_depth=_loop_depth())


def prng_random_bits(shape: Sequence[int]) -> jax.Array:
  """The next `shape` of uint32 random bits from this kernel's generator."""
  ctx = _kernel_context("prng_random_bits")
  state = getattr(ctx, "pallet_prng", None)
  if state is None:
    raise PalletError(f"pltpu.prng_random_bits before pltpu.prng_seed in "
                      f"{describe_call_site()}: seed the generator first")
  if _loop_depth() > state.loop_depth:
    raise PalletError(f"random bits drawn inside a loop body from a generator seeded "
                      f"outside it, {describe_call_site()}: every iteration would get "
                      f"the same bits on pallet; call pltpu.prng_seed inside the loop "
                      f"(mixing in the loop index)")
  bits, _ = _draw(state.key, state.counter, shape)
  state.counter += 1
  return bits


# ------------------------------------------------------------------ samplers
def _uniform_from_bits(bits: jax.Array, dtype: Any, minval: Any, maxval: Any) -> jax.Array:
  """Floats in [minval, maxval) from 32 random bits (23 mantissa bits, as jax.random)."""
  one_to_two = lax.bitcast_convert_type((bits >> jnp.uint32(9)) | jnp.uint32(0x3F800000),
                                        jnp.float32)
  u = one_to_two - jnp.float32(1.0)
  minval = jnp.asarray(minval, jnp.float32)
  maxval = jnp.asarray(maxval, jnp.float32)
  value = u * (maxval - minval) + minval
  # A select, not jnp.maximum: XLA's CPU compiler stalls analysing max() over the
  # hash's long integer chain.
  return jnp.where(value < minval, minval, value).astype(dtype)


def stateful_bits(shape: Sequence[int] = (), dtype: Any = jnp.uint32) -> jax.Array:
  """Random unsigned bits of `dtype` (8 to 64 bits wide) from this kernel's generator."""
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.unsignedinteger):
    raise PalletError(f"pltpu.stateful_bits: dtype must be unsigned, got {dtype}")
  if dtype.itemsize == 8:
    hi = prng_random_bits(shape).astype(jnp.uint64)
    lo = prng_random_bits(shape).astype(jnp.uint64)
    return (hi << jnp.uint64(32)) | lo
  return prng_random_bits(shape).astype(dtype)


def stateful_uniform(shape: Sequence[int] = (), dtype: Any = jnp.float32,
                     minval: Any = 0.0, maxval: Any = 1.0) -> jax.Array:
  """Uniform floats in [minval, maxval)."""
  return _uniform_from_bits(prng_random_bits(shape), dtype, minval, maxval)


def stateful_normal(shape: Sequence[int] = (), dtype: Any = jnp.float32) -> jax.Array:
  """Standard normal floats (inverse error function of a uniform, as jax.random)."""
  lo = np.nextafter(np.float32(-1.0), np.float32(1.0))
  u = _uniform_from_bits(prng_random_bits(shape), jnp.float32, lo, 1.0)
  return (jnp.float32(np.sqrt(2.0)) * lax.erf_inv(u)).astype(dtype)


def stateful_bernoulli(p: Any = 0.5, shape: Sequence[int] | None = None) -> jax.Array:
  """Booleans that are True with probability `p`."""
  p = jnp.asarray(p, jnp.float32)
  shape = p.shape if shape is None else tuple(shape)
  return _uniform_from_bits(prng_random_bits(shape), jnp.float32, 0.0, 1.0) < p


# ------------------------------------------------------------------ keys and blocks
def _bits_from_key_data(data: jax.Array, bit_width: int, shape: Sequence[int]) -> jax.Array:
  """What `prng_seed(data)` then one draw of `shape` gives, at `bit_width` bits."""
  first, second = _draw(_generator_key(_seed_words(data)), 0, shape)
  if bit_width == 64:
    return (first.astype(jnp.uint64) << jnp.uint64(32)) | second.astype(jnp.uint64)
  return first.astype(jnp.dtype(f"uint{bit_width}"))


def _fold_in_key_data(data: jax.Array, value: Any) -> jax.Array:
  words = _seed_words(data)
  k0, k1 = threefry2x32((words[0], words[1]), (jnp.asarray(value, jnp.uint32), jnp.uint32(1)))
  return jnp.stack([k0, k1]).reshape(1, 2)


def _split_key_data(data: jax.Array, shape: Sequence[int]) -> jax.Array:
  words = _seed_words(data)
  index = lax.iota(jnp.uint32, math.prod(shape))
  k0, k1 = threefry2x32((words[0], words[1]), (index, jnp.full_like(index, 2)))
  return jnp.stack([k0, k1], axis=-1).reshape(*shape, 1, 2)


# The key type `to_pallas_key` returns, pallet's stand-in for Pallas's "pallas_tpu"
# keys: jax.random.bits(key, shape) gives what prng_seed(key) and one
# prng_random_bits(shape) give, in a kernel or outside one.
PALLAS_KEY_IMPL = jax.extend.random.define_prng_impl(
    key_shape=(1, 2),
    seed=lambda seed: jnp.broadcast_to(jnp.asarray(seed).astype(jnp.uint32), (1, 2)),
    split=_split_key_data,
    random_bits=_bits_from_key_data,
    fold_in=_fold_in_key_data,
    name="pallet_tpu",
    tag="pl")


def to_pallas_key(key: jax.Array) -> jax.Array:
  """A typed key for kernels (pallet's `pallet_tpu` keys), drawn from `key` (typed or
  legacy uint32, one key or a batch) with jax.random, to pass to a kernel (e.g. in
  SMEM) and use there with jax.random or `prng_seed`."""
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  batched = key.ndim > (0 if typed else 1)
  draw = lambda k: jax.random.bits(k, (1, 2), jnp.uint32)
  data = jax.vmap(draw)(key) if batched else draw(key)
  return jax.random.wrap_key_data(data, impl=PALLAS_KEY_IMPL)


def sample_block(sampler_fn: Callable[..., jax.Array], global_key: Any,
                 block_size: Sequence[int], tile_size: Sequence[int],
                 total_size: Sequence[int], block_index: Sequence[Any] | None = None,
                 **kwargs: Any) -> jax.Array:
  """The `block_size` block at `block_index` (default: the program ids) of a
  `total_size` random array, identical whatever block size a kernel uses.

  The array is cut into `tile_size` tiles; each tile is drawn with
  `sampler_fn(key, tile_size, **kwargs)` (e.g. `jax.random.uniform`) under a
  Threefry key hashed from the global key and the tile's position.
  """
  block_size, tile_size = tuple(block_size), tuple(tile_size)
  total_size = tuple(total_size)
  if not len(block_size) == len(tile_size) == len(total_size):
    raise PalletError(f"pltpu.sample_block: block_size {block_size}, tile_size "
                      f"{tile_size} and total_size {total_size} need the same rank")
  if any(b % t for b, t in zip(block_size, tile_size)):
    raise PalletError(f"pltpu.sample_block: tile_size {tile_size} must divide "
                      f"block_size {block_size}")
  if block_index is None:
    block_index = tuple(primitives.program_id(a) for a in range(len(block_size)))
  words = _seed_words(global_key)
  base = (words[0], words[-1])
  tiles_per_block = [b // t for b, t in zip(block_size, tile_size)]
  tiles_total = [-(-n // t) for n, t in zip(total_size, tile_size)]

  def tile(offsets: tuple[int, ...]) -> jax.Array:
    linear = jnp.uint32(0)
    for d, off in enumerate(offsets):
      tile_pos = jnp.asarray(block_index[d], jnp.uint32) * jnp.uint32(tiles_per_block[d]) + off
      linear = linear * jnp.uint32(tiles_total[d]) + tile_pos
    k0, k1 = threefry2x32(base, (jnp.uint32(0x5A3C), linear))
    return sampler_fn(jax.random.wrap_key_data(jnp.stack([k0, k1]), impl="threefry2x32"),
                      tile_size, **kwargs)

  def assemble(prefix: tuple[int, ...]) -> jax.Array:
    d = len(prefix)
    if d == len(block_size):
      return tile(prefix)
    return jnp.concatenate([assemble((*prefix, i)) for i in range(tiles_per_block[d])], d)

  return assemble(())

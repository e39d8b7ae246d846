"""Random NamedArrays: `jax.random` with a named shape."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallet.named.array import NamedArray
from pallet.named.axis import AxisSpec, as_axes


def normal(key: jax.Array, axes: AxisSpec, dtype: Any = jnp.float32) -> NamedArray:
  axes = as_axes(axes)
  return NamedArray(jax.random.normal(key, [ax.size for ax in axes], dtype), axes)


def uniform(key: jax.Array, axes: AxisSpec, dtype: Any = jnp.float32, minval: Any = 0.0,
            maxval: Any = 1.0) -> NamedArray:
  axes = as_axes(axes)
  return NamedArray(jax.random.uniform(key, [ax.size for ax in axes], dtype, minval, maxval),
                    axes)

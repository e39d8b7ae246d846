"""`Fusion`: a piece of a program handed to a fusible kernel, with its types."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, ParamSpec, TypeVar

import jax

P = ParamSpec("P")
K = TypeVar("K")


@dataclasses.dataclass
class Fusion(Generic[P, K]):
  """A fused computation: calling it computes the value; `in_type`/`out_type` say on
  what and of what type (`shape`/`dtype` describe the output)."""
  func: Callable[P, K]
  in_type: tuple[tuple[Any, ...], dict[str, Any]]
  out_type: Any
  strict_mode: bool = True

  def __call__(self, *args: P.args, **kwargs: P.kwargs) -> K:
    return self.func(*args, **kwargs)

  @property
  def shape(self) -> Any:
    return jax.tree_util.tree_map(lambda t: t.shape, self.out_type)

  @property
  def dtype(self) -> Any:
    return jax.tree_util.tree_map(lambda t: t.dtype, self.out_type)

  @property
  def type(self) -> Any:
    return self.out_type

  @property
  def in_shape(self) -> Any:
    return jax.tree_util.tree_map(lambda t: t.shape, self.in_type)

  @property
  def in_dtype(self) -> Any:
    return jax.tree_util.tree_map(lambda t: t.dtype, self.in_type)

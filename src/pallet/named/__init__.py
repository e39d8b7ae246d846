"""Named axes for arrays, refs and kernels: index by name, not by position.

`import pallet.named as pn`, then `Batch, Feature = pn.make_axes(Batch=4, Feature=8)`,
`x = pn.random.normal(key, (Batch, Feature))`, `r = pn.new_ref(x)`, `r[{"Batch": 0}]`.
See docs/named.md.
"""
from pallet.named import random
from pallet.named.array import NamedArray, named
from pallet.named.axis import Axis, make_axes
from pallet.named.ops import (abs, arange, cos, dot, exp, full, full_like, log, max, maximum,
                              mean, min, minimum, ones, ones_like, sin, sqrt, square, sum, tanh,
                              where, zeros, zeros_like)
from pallet.named import ref
from pallet.primitives import ds
from pallet.named.ref import NamedRef, freeze, get, new_ref, swap

__all__ = [
    "Axis", "NamedArray", "NamedRef", "abs", "arange", "cos", "dot", "ds", "exp", "freeze", "full",
    "full_like", "get", "log", "make_axes", "max", "maximum", "mean", "min", "minimum", "named",
    "new_ref", "ones", "ones_like", "random", "ref", "sin", "sqrt", "square", "sum", "swap",
    "tanh", "where", "zeros", "zeros_like",
]

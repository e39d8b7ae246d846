"""pallet.ops: a library of kernels written with pallet, each with a jax.numpy
reference and a custom VJP whose backward pass runs as kernels too."""
from pallet.ops.normalization import (layer_norm, layer_norm_reference, rms_norm,
                                      rms_norm_reference)
from pallet.ops.softmax import softmax, softmax_reference
from pallet.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from pallet.ops.rope import rotary_embedding, rotary_embedding_reference
from pallet.ops.glu import glu, glu_reference, swiglu, swiglu_reference
from pallet.ops.attention import attention_reference, flash_attention
from pallet.ops.tuned import tuning_cases
from pallet.ops.decode_attention import decode_attention, decode_attention_reference
from pallet.ops.ragged_dot import grouped_matmul, ragged_dot, ragged_dot_reference
from pallet.ops.paged_attention import paged_attention, paged_attention_reference

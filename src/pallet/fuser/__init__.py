"""pallet.fuser: the `jax.experimental.pallas.fuser` API (fusing the computation around
a kernel into it, block by block); see docs/compatibility.md."""
from pallet.fuser.blocks import BlockIndexTransform, make_scalar_prefetch_handler
from pallet.fuser.custom_fusion import custom_fusion
from pallet.fuser.evaluate import evaluate
from pallet.fuser.fusible import fusible
from pallet.fuser.fusion import Fusion
from pallet.fuser.fuse import fuse
from pallet.fuser.pull import pull_block_spec
from pallet.fuser.push import push_block_spec, push_pull_block_spec
from pallet.fuser.spec_utils import block_spec_with_prefetch, filter_no_block_specs
from pallet.fuser.values import (get_fusion_values, get_stateful_input_fusion_values,
                                 get_stateful_output_fusion_values)

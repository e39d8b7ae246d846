"""pallet.ops.tuned: the autotuned ops agree with their references, and `pallet tune`
finds their cases."""
from __future__ import annotations

import pytest

from helpers import assert_close, random_array
from pallet import ops
from pallet.ops import tuned


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("PALLET_CACHE_DIR", str(tmp_path))


@pytest.mark.cpu_only
def test_tuned_layer_norm_picks_a_config_and_matches_the_reference(fresh_cache):
  x, w = random_array((64, 96)), random_array((96,))
  out = tuned.layer_norm(x, w, w)
  assert_close(out, ops.layer_norm_reference(x, w, w))
  assert tuned.layer_norm.last_choice.source == "tuned"
  assert "block_rows" in tuned.layer_norm.last_choice.config


def test_untuned_calls_use_the_plain_ops_defaults(monkeypatch, fresh_cache):
  monkeypatch.setenv("PALLET_AUTOTUNE", "0")
  x = random_array((16, 40))
  assert_close(tuned.softmax(x), ops.softmax(x))
  assert tuned.softmax.last_choice.config == {"block_rows": None}


def test_pallet_tune_lists_every_tuned_op():
  names = {"/".join(c.name.split("/")[:2]) for c in ops.tuning_cases("tiny")}
  assert names == {f"ops/{n}" for n in ("layer_norm", "rms_norm", "softmax", "swiglu",
                                         "linear_cross_entropy", "rotary_embedding",
                                         "flash_attention", "paged_attention", "ragged_dot")}

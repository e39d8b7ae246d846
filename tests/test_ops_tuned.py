"""pallet.ops.tuned: the autotuned ops agree with their references, and `pallet tune`
finds their cases."""
from __future__ import annotations

import pytest

import json

import pallet as pl
from helpers import assert_close, random_array
from pallet import ops
from pallet.cli import tune
from pallet.autotune import Choice, Recorded
from pallet.ops import launch_table, tuned


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
  assert tuned.softmax.last_choice.config == {"block_rows": None, "launch": None}


def test_pallet_tune_lists_every_tuned_op():
  names = {"/".join(c.name.split("/")[:2]) for c in ops.tuning_cases("tiny")}
  assert names == {f"ops/{n}" for n in ("layer_norm", "rms_norm", "softmax", "swiglu",
                                         "linear_cross_entropy", "rotary_embedding",
                                         "flash_attention", "paged_attention", "ragged_dot")}


@pytest.mark.cpu_only
def test_launch_table_configs_are_not_timed_off_the_gpu(fresh_cache):
  x = random_array((64, 96))
  assert_close(tuned.softmax(x), ops.softmax_reference(x))
  trials = tuned.softmax.last_choice.trials
  pruned = [t for t in trials if t.config["launch"] is not None]
  assert pruned and all(t.status == "pruned" and "only change Triton kernels" in t.note
                        for t in pruned)


def _launch_seen(x):
  with pl.default_backend("triton"), launch_table.using_device("sm_90"), \
      launch_table.recording() as seen:
    launch_table.lookup("softmax", width=x.shape[-1], itemsize=4)
  return seen


def test_pallet_tune_writes_a_chosen_launch_config_into_the_users_table(fresh_cache):
  x = random_array((64, 96))
  section = {"fwd": {"elements": 512, "num_warps": 2, "num_stages": None}}
  chosen = Recorded("softmax", Choice({"block_rows": None, "launch": section}, "tuned", {}),
                    tuned.softmax, (x,), {})
  cached = Recorded("softmax", Choice({"block_rows": None, "launch": section}, "cache", {}),
                    tuned.softmax, (x,), {})
  blocks = Recorded("softmax", Choice({"block_rows": 8, "launch": None}, "tuned", {}),
                    tuned.softmax, (x,), {})
  assert tune.store_launch_choices([cached, blocks], _launch_seen(x), "gpu:H100") == []
  [(path, op)] = tune.store_launch_choices([chosen], _launch_seen(x), "gpu:H100")
  assert op == "softmax" and path == launch_table.user_table_path("sm_90")
  [entry] = json.loads(path.read_text())["ops"]["softmax"]
  assert entry["when"] == {"width": 96, "itemsize": 4}
  assert entry["fwd"] == section["fwd"] and entry["source"].startswith("pallet tune on gpu:H100")
  assert _launch_seen(x)[0].sections["fwd"] == section["fwd"]
  assert _launch_seen(random_array((64, 80)))[0].sections["fwd"] != section["fwd"]

"""pallet.ops.launch_table: per-device launch defaults of the ops, their fallback by GPU
family, the user's tables overriding the shipped ones, and the ops reading them."""
from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import pytest

import pallet as pl
from helpers import random_array
from pallet import PalletError, ops
from pallet.triton import gpu_target
from pallet.ops import launch_table
from pallet.pallas_call import pallas_call_p


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("PALLET_CACHE_DIR", str(tmp_path))
  return tmp_path


def _kernels(fn, *args):
  """{kernel name: kernel description} of the pallas_calls fn(*args) launches."""
  found = {}

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is pallas_call_p:
        found[eqn.params["kernel"].name] = eqn.params["kernel"]
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub.jaxpr if hasattr(sub, "jaxpr") else sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def _on(device):
  """Ops traced on the Triton backend with `device`'s table (nothing is run)."""
  from contextlib import ExitStack
  stack = ExitStack()
  stack.enter_context(pl.default_backend("triton"))
  stack.enter_context(launch_table.using_device(device))
  return stack


def _flash_tiles(device, causal=False, **kw):
  q = jax.ShapeDtypeStruct((1, 2, 256, 64), jnp.bfloat16)
  with _on(device):
    kernels = _kernels(lambda q, k, v: jax.grad(
        lambda q, k, v: ops.flash_attention(q, k, v, causal=causal, **kw).astype(
            jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v), q, q, q)
  out = {}
  for name, kd in kernels.items():
    params = kd.compiler_params
    out[name] = (kd.grid_mapping.grid, getattr(params, "num_warps", None),
                 getattr(params, "num_stages", None))
  return out


# ------------------------------------------------------------------ devices
@pytest.mark.parametrize("name,key,family", [
    ("sm_90", "sm_90", "sm_90"), (90, "sm_90", "sm_90"), ("9.0", "sm_90", "sm_90"),
    ("sm_90a", "sm_90", "sm_90"), ("cuda:80", "sm_80", "sm_80"), ("8.9", "sm_89", "sm_80"),
    ("sm_86", "sm_86", "sm_80"), ("sm_75", "sm_75", "sm_80"), ("sm_100", "sm_100", "sm_90"),
    ("10.3", "sm_103", "sm_90"), ("sm_120", "sm_120", "sm_80"),
    ("gfx942", "gfx942", "gfx942"), ("gfx90a:sramecc+:xnack-", "gfx90a", "gfx942"),
    ("gfx950", "gfx950", "gfx942")])
def test_device_names_and_their_family(name, key, family):
  assert launch_table.device_key(name) == key
  assert launch_table.family(name) == family


def test_an_unknown_device_name_is_a_clear_error():
  with pytest.raises(PalletError, match=r"cannot tell the GPU from 'h100'.*sm_90.*gfx942"):
    launch_table.device_key("h100")


def test_device_comes_from_the_context_then_the_aot_target(monkeypatch):
  monkeypatch.delenv("PALLET_OPS_DEVICE", raising=False)
  monkeypatch.setenv("PALLET_TRITON_COMPUTE_CAPABILITY", "80")
  assert launch_table.current_device() == "sm_80"
  with launch_table.using_device("gfx942"):
    assert launch_table.current_device() == "gfx942"
  monkeypatch.delenv("PALLET_TRITON_COMPUTE_CAPABILITY")
  if not gpu_target.is_gpu_device():
    assert launch_table.current_device() == launch_table.NO_GPU_DEVICE


# ------------------------------------------------------------------ the shipped tables
def test_shipped_tables_cover_every_op_with_the_same_sections():
  names = {op: launch_table.parameter_names(op) for op in launch_table.shipped("sm_90")}
  assert set(names) >= {"flash_attention", "linear_cross_entropy", "decode_attention",
                        "paged_attention", "ragged_dot", "layer_norm", "rms_norm", "softmax",
                        "glu", "rotary_embedding"}
  for device in launch_table.DEVICES:
    table = launch_table.shipped(device)
    assert set(table) == set(names), device
    for op, entries in table.items():
      final = entries[-1]
      assert not final.when, f"{device} {op}: the last entry must apply to every call"
      assert {s: set(p) for s, p in final.sections.items()} == names[op], f"{device} {op}"
      for entry in entries:
        assert entry.source.strip(), f"{device} {op}: an entry without a source"
        for section, params in entry.sections.items():
          assert set(params) <= names[op][section], f"{device} {op} {section}"


def test_families_give_different_defaults():
  assert _flash_tiles("sm_90") != _flash_tiles("gfx942")
  assert _flash_tiles("sm_89") == _flash_tiles("sm_80")
  assert _flash_tiles("sm_100") == _flash_tiles("sm_90")
  assert _flash_tiles("gfx90a") == _flash_tiles("gfx942")


@pytest.mark.parametrize("device", launch_table.DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attention_launches_with_its_devices_table(device, causal):
  launch = None
  with _on(device), launch_table.recording() as seen:
    tiles = _flash_tiles(device, causal=causal)
    launch = seen[-1]
  assert launch.features == {"causal": causal, "head_dim": 64, "itemsize": 2}
  for name, section in (("flash_attention_fwd", "fwd"), ("flash_attention_dq", "dq"),
                        ("flash_attention_dkv", "dkv")):
    grid, warps, stages = tiles[name]
    p = launch.sections[section]
    # t = 256 padded to whole blocks of every pass: fwd and dq grids count query
    # blocks, dkv's counts key blocks
    rows = p["block_k"] if section == "dkv" else p["block_q"]
    assert grid[-1] == 256 // rows
    assert (warps, stages) == (p["num_warps"], p["num_stages"])


def test_explicit_blocks_leave_warps_and_stages_to_the_backend():
  tiles = _flash_tiles("sm_90", block_q=16, block_k=16)
  assert all(grid[-1] == 256 // 16 and warps is None and stages is None
             for grid, warps, stages in tiles.values())


def test_cpu_backend_keeps_its_own_choices():
  with pl.default_backend("xla"), launch_table.using_device("sm_90"):
    launch = launch_table.lookup("flash_attention", causal=False, head_dim=64, itemsize=4)
    assert not launch.on_gpu and launch.sections == {}
    q = jax.ShapeDtypeStruct((1, 1, 512, 64), jnp.float32)
    (kd,) = _kernels(ops.flash_attention, q, q, q).values()
  assert kd.grid_mapping.grid == (1, 1, 512 // 128) and kd.compiler_params is None


# ------------------------------------------------------------------ the user's tables
def test_user_entries_override_shipped_ones_for_their_features(user_cache):
  shipped = _flash_tiles("sm_90")
  path = launch_table.store(
      "flash_attention", "sm_90", {"causal": False, "head_dim": 64, "itemsize": 2},
      {"fwd": {"block_q": 16, "block_k": 32, "num_warps": 2, "num_stages": 1}}, "test")
  assert path == user_cache / "launch_tables" / "sm_90.json"
  tuned = _flash_tiles("sm_90")
  assert tuned["flash_attention_fwd"] == ((1, 2, 256 // 16), 2, 1)
  assert tuned["flash_attention_dq"] == shipped["flash_attention_dq"]   # not in the entry
  assert _flash_tiles("sm_90", causal=True) == _flash_tiles("sm_100", causal=True)
  assert _flash_tiles("sm_80") != tuned                   # another GPU: its own table
  with launch_table.recording() as seen, _on("sm_90"):
    launch_table.lookup("flash_attention", causal=False, head_dim=64, itemsize=2)
  assert seen[0].sources["fwd"].startswith(f"user table {path}: test")


def test_a_newer_user_entry_for_the_same_features_replaces_the_older(user_cache):
  features = {"causal": False, "head_dim": 64, "itemsize": 2}
  for block in (16, 32):
    launch_table.store("flash_attention", "sm_90", features,
                       {"fwd": {"block_q": block, "block_k": 32, "num_warps": 4,
                                "num_stages": 1}}, f"run {block}")
  data = json.loads((user_cache / "launch_tables" / "sm_90.json").read_text())
  assert [e["source"] for e in data["ops"]["flash_attention"]] == ["run 32"]
  assert _flash_tiles("sm_90")["flash_attention_fwd"][0] == (1, 2, 256 // 32)


def test_malformed_or_unknown_user_entries_are_ignored_with_a_warning(user_cache, caplog):
  shipped = _flash_tiles("sm_90")
  path = user_cache / "launch_tables" / "sm_90.json"
  path.parent.mkdir(parents=True)
  path.write_text(json.dumps({"format": 1, "ops": {"flash_attention": [
      {"fwd": {"block_q": 16, "blok_k": 16}, "source": "typo"}]}}))
  with caplog.at_level(logging.WARNING, logger="pallet.ops"):
    assert _flash_tiles("sm_90") == shipped
  assert "['blok_k']" in caplog.text and "ignored" in caplog.text
  path.write_text("{not json")
  with caplog.at_level(logging.WARNING, logger="pallet.ops"):
    assert _flash_tiles("sm_90") == shipped
  assert f"ignoring the launch table {path}" in caplog.text


def test_bad_shipped_style_tables_are_clear_errors():
  with pytest.raises(PalletError, match=r"t.json: expected a JSON object with \"format\": 1"):
    launch_table.parse({"ops": {}}, "t.json")
  with pytest.raises(PalletError, match=r"softmax entry 0: expected an object with a \"source\""):
    launch_table.parse({"format": 1, "ops": {"softmax": [{"fwd": {}}]}}, "t.json")
  with pytest.raises(PalletError, match=r"softmax entry 0: \"when\" must map features"):
    launch_table.parse({"format": 1, "ops": {"softmax": [
        {"when": {"width": [1, 2, 3]}, "fwd": {}, "source": "x"}]}}, "t.json")


def test_when_matches_values_and_ranges():
  entry = launch_table.Entry({"causal": True, "head_dim": [65, None]}, {"fwd": {}}, "x")
  assert entry.applies({"causal": True, "head_dim": 128})
  assert not entry.applies({"causal": True, "head_dim": 64})
  assert not entry.applies({"causal": False, "head_dim": 128})
  assert not entry.applies({"causal": True})


def test_overriding_comes_before_every_table(user_cache):
  with launch_table.overriding("flash_attention", {"dq": {"block_q": 16, "block_k": 16,
                                                         "num_warps": 1, "num_stages": 1}}):
    tiles = _flash_tiles("sm_90")
  assert tiles["flash_attention_dq"] == ((1, 2, 256 // 16), 1, 1)
  assert tiles["flash_attention_fwd"] == _flash_tiles("sm_90")["flash_attention_fwd"]


def test_ops_with_table_defaults_match_their_references_on_the_cpu():
  # the CPU backend ignores the tables: the same results whatever device is named
  x = random_array((64, 96))
  with launch_table.using_device("gfx942"):
    assert jnp.allclose(ops.softmax(x), ops.softmax_reference(x), atol=1e-6)

"""The real-engine benchmarks (bench/vllm_*.py) end to end on CPU against the fake engines (--smoke), their
comparison arithmetic on shards with known differences, and the recorded GPU results they reproduce."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import STORIES

from eagle3build.shards import HiddenShardWriter, read_tokens

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
import vllm_extract_compare as compare  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"


def smoke(script: str, tmp_path: Path, *args: str) -> dict:
    """Run `bench/<script> ... --work tmp --out tmp/r.json` and return its one recorded run."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH / script), *args, "--work", str(tmp_path / "w"), "--out",
                           str(out)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1 and list(runs[0])[:3] == ["device", "date", "commit"]
    assert runs[0]["engine"] == "fake"
    return runs[0]


def no_server_left(run_dir: Path) -> bool:
    return not list(run_dir.glob("**/server.json"))


# ---------------------------------------------------------------- extraction: vLLM vs HF
def write_hidden(path: Path, hidden: torch.Tensor, lengths: list[int], backend: str, layer_ids: list[int]) -> None:
    ids = torch.arange(sum(lengths)) % 50 + 3
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    meta = {"model": "m", "revision": "", "layer_ids": layer_ids, "backend": backend, "image": ""}
    with HiddenShardWriter(path, ids, torch.ones(len(ids)), cu, hidden.shape[-1], "bf16", meta) as w:
        w.write(0, hidden)


def test_comparison_counts_rows_beyond_each_tolerance_and_the_router_near_ties(tmp_path):
    torch.manual_seed(0)
    ref = torch.randn(10, 4, 16)
    vllm = ref.clone()
    vllm[2, 1] *= 1.03  # 3% off: over 1% and 2%
    vllm[5, 1] *= 1.08  # over every tolerance
    vllm[7, 3] *= 1.015  # over 1% only
    for name, hidden, backend in (("hf", ref, "hf"), ("fp32", ref, "hf"), ("vllm", vllm, "vllm")):
        (tmp_path / name).mkdir()
        write_hidden(tmp_path / name / "s.safetensors", hidden, [4, 6], backend, [1, 2, 3, 4])
    margins = torch.full((10, 2), 0.05)
    margins[5, 0] = 1e-4  # a near-tie in the MoE layer before slot 1 (layer 2) of the row 8% off
    margins[2, 1] = 1e-4  # in a layer after it: not an explanation for slot 1
    report = compare.compare_target(tmp_path / "vllm", tmp_path / "hf", tmp_path / "fp32",
                                    {"moe_layers": [1, 3], "margins": {"s.safetensors": margins}})
    slot1, final = report["slots"]["aux1"], report["slots"]["final"]
    v = slot1["vllm_vs_hf_bf16"]
    assert (v["rows"], v["rows_over_0.01"], v["rows_over_0.02"], v["rows_over_0.05"]) == (10, 2, 2, 1)
    assert v["max"] == pytest.approx(0.08, abs=2e-3)  # bf16 storage rounds the stored rows
    assert slot1["hf_bf16_vs_fp32"]["max"] == 0 and slot1["vllm_vs_fp32"]["rows_over_0.02"] == 2
    assert final["vllm_vs_hf_bf16"]["rows_over_0.01"] == 1 and final["vllm_vs_hf_bf16"]["rows_over_0.02"] == 0
    ties = slot1["router_near_ties"]
    assert ties == {"rows_over_2pct": 2, "rows_over_2pct_with_margin_below_1e-3": 1,
                    "rows_with_margin_below_1e-3": 1, "rows": 10}
    assert report["slots"]["final"]["router_near_ties"]["rows_with_margin_below_1e-3"] == 2  # both layers < 4
    assert "router_near_ties" not in report["slots"]["aux0"]  # no MoE layer before layer 1
    assert report["shards"]["s.safetensors"]["same_tokens"]
    assert report["shards"]["s.safetensors"]["meta_differs"] == ["backend"]


def test_long_shard_chains_conversations_to_each_length(tmp_path):
    smollm2, alpaca = ROOT / "models" / "SmolLM2-135M-Instruct", ROOT.parent / "shared/assets/data/train/alpaca_eval"
    if not (smollm2 / "tokenizer.json").exists() or not alpaca.exists():
        pytest.skip("needs models/SmolLM2-135M-Instruct and ../shared/assets")
    info = compare.long_shard(tmp_path / "long.safetensors", str(smollm2), alpaca, [300, 1200])
    tokens = read_tokens(tmp_path / "long.safetensors")
    assert info == {"samples": 2, "tokens": 1500} and tokens.lengths == [300, 1200]
    im_start = 1  # SmolLM2's <|im_start|>: the long sample holds several turns
    assert int((tokens.sample(1)[0] == im_start).sum()) >= 4


def test_extract_compare_smoke_runs_both_backends_and_the_dsv3_stand_ins(tmp_path):
    run = smoke("vllm_extract_compare.py", tmp_path, "smoke")
    assert set(run["targets"]) == {"llama", "dsv3_top2", "dsv3_all", "dsv3_top2_nosc"}
    for name, target in run["targets"].items():
        assert all(s["same_tokens"] for s in target["shards"].values()), name
        assert [s["layer"] for s in target["slots"].values()] == [2, 4, 5, 8]
        for slot in target["slots"].values():
            assert slot["vllm_vs_hf_bf16"]["rows"] == 244
    # the fp32 reference is the same forward: bf16 is within bf16 rounding of it where routing cannot flip
    assert run["targets"]["llama"]["slots"]["final"]["hf_bf16_vs_fp32"]["max"] < 0.05
    assert run["targets"]["dsv3_all"]["slots"]["final"]["hf_bf16_vs_fp32"]["max"] < 0.05
    assert "router_near_ties" in run["targets"]["dsv3_top2"]["slots"]["aux1"]
    assert "router_near_ties" not in run["targets"]["dsv3_all"]["slots"]["aux1"]  # top-8 of 8: nothing flips
    assert run["targets"]["dsv3_top2_nosc"]["hf_from"] == "dsv3_top2"
    assert "scoring_func" not in run["targets"]["dsv3_top2_nosc"]["config"]
    assert run["targets"]["dsv3_top2"]["config"]["scoring_func"] == "sigmoid"
    assert no_server_left(tmp_path / "w" / "run")


# ---------------------------------------------------------------- extraction throughput
def test_extract_throughput_smoke_measures_every_path_against_the_disk_bound(tmp_path):
    run = smoke("vllm_extract_throughput.py", tmp_path, "--smoke")
    rows = {(r["backend"], r.get("concurrency"), r.get("storage")) for r in run["rows"] if "tokens_per_s" in r}
    assert rows == {("hf", None, "bf16"), ("hf", None, "fp8"), ("vllm", 2, "bf16"), ("vllm", 2, "fp8"),
                    ("vllm", 8, "bf16"), ("vllm", 8, "fp8"), ("vllm-bare", 8, None)}
    for r in run["rows"]:
        if "share_of_disk_bound" in r:
            bound = run["disk_bound_tokens_per_s"][r["storage"]]
            assert r["share_of_disk_bound"] == pytest.approx(r["tokens_per_s"] / bound)
    assert run["disk_bound_tokens_per_s"]["bf16"] == pytest.approx(run["disk_bytes_per_s"] / run["bytes_per_token"]["bf16"])
    bare = next(r for r in run["rows"] if r["backend"] == "vllm-bare")
    assert bare["connector_bytes"] > bare["tokens"] * 4 * 32 * 2  # bf16 [T, 4, H] per request, and a header
    assert no_server_left(tmp_path / "w" / "run")


def test_extract_throughput_can_put_the_connector_files_elsewhere(tmp_path):
    """--connector-dir (extract.vllm.shared_storage_path, e.g. /dev/shm): the engine's per-request files go
    there, and every one is gone when the run ends."""
    conn = tmp_path / "conn"
    run = smoke("vllm_extract_throughput.py", tmp_path, "--smoke", "--skip-hf", "--storage", "bf16",
                "--connector-dir", str(conn))
    assert run["connector_dir"] == str(conn)
    assert conn.is_dir() and not any(conn.iterdir())
    assert not any((tmp_path / "w" / "run").rglob("*.safetensors"))  # nothing written beside the run



# ---------------------------------------------------------------- evaluation through vLLM
def test_eval_compare_smoke_reads_tau_from_both_evaluators(tmp_path):
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    run = smoke("vllm_eval_compare.py", tmp_path, "--smoke", "--temperature", "1.0")
    assert set(run["sets"]) == {"stories", "first"}
    for s in run["sets"].values():
        # the fake engine accepts one token per two answer tokens: tau = 2 exactly
        assert s["vllm"]["tau"] == pytest.approx(2.0)
        sampled = s["vllm"]["at_temperature"]["1.0"]  # the same turns again, sampled, counted apart
        assert sampled["tau"] == pytest.approx(2.0) and sampled["turns"] == s["turns"]["vllm"]
        assert sampled["draft_sample_method"] == "probabilistic"
        hf_sampled = s["hf"]["at_temperature"]["1.0"]  # the HF evaluator's, read off the target's samples
        assert 1.0 <= hf_sampled["tau"] <= 4.0 and hf_sampled["turns"] == s["turns"]["hf"]
        assert s["at_temperature_relative_difference"]["1.0"] == pytest.approx(sampled["tau"] / hf_sampled["tau"] - 1)
        assert 1.0 <= s["hf"]["tau"] <= 4.0
        assert s["relative_difference"] == pytest.approx(s["vllm"]["tau"] / s["hf"]["tau"] - 1)
        assert s["vllm"]["mismatches_vs_target_alone"] == 0
    assert run["sets"]["stories"]["turns"] == {"hf": 3, "vllm": 3}
    assert run["sets"]["first"]["turns"] == {"hf": 2, "vllm": 2}  # every question cut to its first turn
    assert [r["concurrency"] for r in run["speed"]] == [1, 2]
    for r in run["speed"]:
        assert r["ratio"] == pytest.approx(r["spec_tokens_per_s"] / r["base_tokens_per_s"])
        assert r["spec_tokens"] == r["base_tokens"] > 0


def test_eval_compare_without_baseline_reports_no_baseline_numbers(tmp_path):
    """--no-baseline (how the T = 1 run on the H100 ran): no server without the draft for the sets, so no
    mismatch count and no baseline tokens/s, written as null rather than as a measured 0."""
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    run = smoke("vllm_eval_compare.py", tmp_path, "--smoke", "--temperature", "1.0", "--no-baseline")
    for s in run["sets"].values():
        assert s["vllm"]["baseline_tokens_per_s"] is None and s["vllm"]["mismatches_vs_target_alone"] is None
        assert s["vllm"]["tokens_per_s"] > 0 and s["vllm"]["at_temperature"]["1.0"]["tau"] == pytest.approx(2.0)


def test_variant_load_smoke_serves_each_variant_from_the_plain_head(tmp_path):
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    run = smoke("vllm_variant_load.py", tmp_path, "--smoke")
    from eagle3build.draft.model import DraftConfig

    assert list(run["variants"]) == ["plain", *DraftConfig.VARIANTS]
    for name, row in run["variants"].items():
        assert row["loaded"], row.get("traceback")
        assert row["config_keys"] == {k: k == name for k in DraftConfig.VARIANTS}  # one switch on at a time
        s = row["sets"]["stories"]
        assert s["turns"] == {"hf": 3, "vllm": 3} and s["vllm"]["tau"] == pytest.approx(2.0)
        assert s["vllm"]["mismatches_vs_target_alone"] is None  # one server per variant: no baseline
    from safetensors import safe_open

    with safe_open(str(tmp_path / "w" / "fc_norm" / "export" / "eagle3" / "model.safetensors"), "pt") as f:
        assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(f.keys())
        assert torch.equal(f.get_tensor("fc_norm.0.weight"), torch.ones_like(f.get_tensor("fc_norm.0.weight")))



def test_variant_load_takes_the_plain_weights_of_a_variant_head(tmp_path):
    """The GPU config trains a norm_before_fc head: each variant is built from its plain weights, its own
    input_norm dropped, so `plain` is plain and `fc_norm` is not refused for having two norms."""
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    import dataclasses

    import vllm_eval_compare as vec
    from safetensors import safe_open
    from safetensors.torch import save_file
    from vllm_variant_load import variant_export

    from eagle3build.draft.export import export, load_exported
    from eagle3build.draft.model import Eagle3Draft
    from eagle3build.train.checkpoint import save_best

    _, plain_dir, _ = vec.smoke_inputs(tmp_path)
    plain = load_exported(plain_dir, dtype=torch.float32, target_path=str(STORIES))
    trained = tmp_path / "nbf"  # the plain weights with a trained-looking input_norm: a norm_before_fc head
    config = dataclasses.replace(plain.config, norm_before_fc=True)
    head = Eagle3Draft(config)
    head.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        head.input_norm.weight.fill_(0.5)
    trained.mkdir()
    save_best(trained, head, config, 1, None)
    save_file({"d2t": plain.d2t, "t2d": plain.t2d}, str(trained / "mapping.safetensors"))
    export(str(trained / "best.safetensors"), str(trained / "mapping.safetensors"), str(STORIES),
           str(trained / "export"), {})  # fmt: skip
    for flag in (None, "fc_norm", "norm_before_fc"):
        out = variant_export(str(trained / "export"), str(STORIES), flag, tmp_path / str(flag))
        exported = json.loads(Path(out, "config.json").read_text())
        assert {k: exported[k] for k in ("norm_before_fc", "fc_norm")} == {
            "norm_before_fc": flag == "norm_before_fc", "fc_norm": flag == "fc_norm"}
        with safe_open(str(Path(out) / "model.safetensors"), "pt") as f:
            assert torch.equal(f.get_tensor("fc.weight"), plain.fc.weight.detach())  # the trained weights
            if flag == "norm_before_fc":  # a new norm at ones, not the head's own
                assert torch.equal(f.get_tensor("input_norm.weight"), torch.ones(3 * config.target_hidden_size))
            else:
                assert "input_norm.weight" not in f.keys()


# ---------------------------------------------------------------- queued aborts and killed jobs
def test_abort_probe_smoke_the_relay_keeps_the_engine_alive_and_a_direct_abort_crashes_it(tmp_path):
    run = smoke("vllm_abort_probe.py", tmp_path, "--smoke")
    relay, engine = run["relay_flood"], run["engine_flood"]
    assert relay["answered"] == {"200": 5} and relay["relay_health"] == relay["engine_health"] == 200
    assert relay["crash_markers"] == {} and relay["fresh_request"] == "200"
    assert relay["connector_files_left"] == {"safetensors": 0, "locks": 0}  # the relay deleted the orphans
    # the fake plays vLLM 0.25.0: aborting its queued requests directly kills the engine (and its relay)
    assert "KeyError" in engine["crash_markers"] and engine["engine_health"] != 200
    assert not engine["relay_alive"]
    assert run["recovery"]["same_server"] is False  # the next job replaced the dead server
    killed = run["killed_job"]
    assert killed["first_connector_file_at_s"] is not None and killed["engine_health"] == 200
    assert killed["fresh_request"] == "200" and "KeyError" not in killed["crash_markers"]
    assert no_server_left(tmp_path / "w" / "run")


# ---------------------------------------------------------------- the recorded GPU runs
def recorded(bench: str) -> dict:
    runs = json.loads((BENCH / "results" / f"{bench}.json").read_text())["runs"]
    return next(r for r in runs if r["device"] == H100)


def test_recorded_h100_results_hold_what_benchmarks_md_states():
    ex = recorded("vllm_extract_compare")
    assert (ex["date"], ex["commit"]) == ("2026-12-05", "204759b")
    slots = ex["targets"]["dsv3_all"]["slots"]
    assert all(s["vllm_vs_hf_bf16"]["rows_over_0.01"] == 0 and s["vllm_vs_hf_bf16"]["max"] < 0.0085
               for s in slots.values())  # top-8 of 8: no row beyond 1%
    smol = ex["targets"]["smollm2"]["slots"]
    assert all(s["vllm_vs_fp32"]["mean"] <= s["hf_bf16_vs_fp32"]["mean"] for s in smol.values())
    nosc, top2 = ex["targets"]["dsv3_top2_nosc"]["slots"], ex["targets"]["dsv3_top2"]["slots"]
    assert all(nosc[k]["vllm_vs_hf_bf16"]["mean"] > 2 * top2[k]["vllm_vs_hf_bf16"]["mean"] for k in nosc)
    ev = recorded("vllm_eval_compare")
    assert (ev["date"], ev["commit"]) == ("2026-12-06", "17abe2a")
    mt = ev["sets"]["mt_bench"]
    assert mt["turns"] == {"hf": 160, "vllm": 160}
    assert round(mt["vllm"]["tau"], 3) == 2.525 and round(mt["hf"]["tau"], 3) == 2.511
    assert abs(mt["relative_difference"]) < 0.05  # the bar: vLLM's tau@3 within 5% of the evaluator's
    speeds = {r["concurrency"]: r for r in ev["speed"]}
    assert round(speeds[1]["ratio"], 2) == 1.17 and round(speeds[16]["ratio"], 2) == 0.74
    t1 = recorded("vllm_eval_compare_t1")
    assert (t1["date"], t1["commit"]) == ("2026-12-07", "dbfc1d0")
    mt = t1["sets"]["mt_bench"]
    assert mt["turns"] == {"hf": 80, "vllm": 80}
    assert round(mt["hf"]["tau"], 3) == 2.680 and round(mt["vllm"]["tau"], 3) == 2.661
    hf1, v1 = mt["hf"]["at_temperature"]["1.0"], mt["vllm"]["at_temperature"]["1.0"]
    assert round(hf1["tau"], 3) == 1.914 and round(v1["tau"], 3) == 1.863
    assert v1["draft_sample_method"] == "probabilistic" and v1["turns"] == 80
    assert abs(mt["at_temperature_relative_difference"]["1.0"]) < 0.05  # the bar, at T = 1 too
    tp = recorded("vllm_extract_throughput")
    assert (tp["date"], tp["commit"]) == ("2026-12-05", "f164093")
    rows = {(r["backend"], r.get("concurrency"), r.get("storage")): r for r in tp["rows"]}
    client = rows[("vllm", 64, "bf16")]
    assert round(client["tokens_per_s"]) == 135396 and client["share_of_disk_bound"] < 0.7  # the bar: not met
    bare = rows[("vllm-bare", 64, None)]
    # the client outpaces the engine's own loop: the connector's files, not the client, bound it
    assert bare["tokens_per_s"] < client["tokens_per_s"]
    assert bare["connector_bytes_per_s"] < tp["disk_bytes_per_s"] / 3
    ab = recorded("vllm_abort_probe")
    assert ab["relay_flood"]["crash_markers"] == {} and ab["relay_flood"]["engine_health"] == 200
    assert ab["relay_flood"]["answered"] == {"200": 200} and ab["relay_flood"]["queued_when_aborted"] > 100
    assert ab["engine_flood"]["crash_markers"]["EngineDeadError"] >= 1 and not ab["engine_flood"]["relay_alive"]


# ---------------------------------------------------------------- fixtures recorded from an engine
def test_fixture_recorder_writes_the_files_tests_fixtures_holds(tmp_path):
    from eagle3build.evaluate.vllm import parse_metrics

    proc = subprocess.run([sys.executable, str(BENCH / "vllm_fixtures.py"), "--smoke", "--work", str(tmp_path / "w"),
                           "--out", str(tmp_path / "fx")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = sorted(p.name for p in (tmp_path / "fx").iterdir())
    assert written == sorted(p.name for p in (ROOT / "tests" / "fixtures").glob("vllm_0.25.0_*"))
    counters = parse_metrics((tmp_path / "fx" / "vllm_0.25.0_metrics.txt").read_text(), 3)
    assert counters.drafts > 0 and counters.accepted == sum(counters.accepted_per_position)
    layout = json.loads((tmp_path / "fx" / "vllm_0.25.0_connector_layout.json").read_text())
    assert layout["after_write"]["file_exists"] and set(layout["safetensors_header"]) >= {"hidden_states", "token_ids"}
    assert no_server_left(tmp_path / "w" / "run")

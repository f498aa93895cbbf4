"""bench/results/: one file per benchmark, the latest run of each device (bench/results.py)."""

import json
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import results  # noqa: E402

ORDINAL = r"(?:thi|four|fif|six|seven|eigh|nin|ten|eleven|twelf|[a-z]+teen|twentie)(?:rd|th)"  # 3rd .. 20th, spelled
ROUND = re.compile(rf"session|(?:\b|_){ORDINAL}(?:\b|_)", re.IGNORECASE)  # how development rounds were named
FILES = sorted((BENCH / "results").iterdir())


def keys(value):
    """Every key of a JSON value, at any depth."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from keys(v)


def test_record_replaces_the_same_devices_run_and_keeps_the_others(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    out = tmp_path / "bench.json"
    results.record("bench", "NVIDIA H200", {"tokens_per_s": 1.0, "date": "a timestamp"}, out)
    results.record("bench", "CPU x86_64, 2 cores", {"tokens_per_s": 2.0}, out)
    results.record("bench", "NVIDIA H200", {"tokens_per_s": 3.0, "device": "cuda"}, out)
    runs = json.loads(out.read_text())["runs"]
    assert [(r["device"], r["tokens_per_s"]) for r in runs] == [("CPU x86_64, 2 cores", 2.0), ("NVIDIA H200", 3.0)]
    for run in runs:
        assert list(run)[:3] == ["device", "date", "commit"]
        assert run["commit"] == "abc1234"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"])


def test_record_into_a_folder_names_the_file_after_the_bench(tmp_path):
    path = results.record("my_bench", "NVIDIA H100 80GB HBM3", {"x": 1}, tmp_path)
    assert path == tmp_path / "my_bench.json"
    assert json.loads(path.read_text())["runs"][0]["device"] == "NVIDIA H100 80GB HBM3"


def test_merge_folds_a_files_runs_into_the_results_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    results.record("b", "NVIDIA H200", {"x": 1}, tmp_path / "results")
    results.record("b", "CPU x86_64, 2 cores", {"x": 2}, tmp_path / "results")
    results.record("b", "NVIDIA H200", {"x": 3}, tmp_path / "elsewhere")
    results.merge([str(tmp_path / "elsewhere" / "b.json")])
    runs = json.loads((tmp_path / "results" / "b.json").read_text())["runs"]
    assert {r["device"]: r["x"] for r in runs} == {"NVIDIA H200": 3, "CPU x86_64, 2 cores": 2}


def test_merge_refuses_a_missing_file_before_merging_any(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    results.record("b", "NVIDIA H200", {"x": 3}, tmp_path / "elsewhere")
    with pytest.raises(SystemExit, match="no such results file: --help"):
        results.merge([str(tmp_path / "elsewhere" / "b.json"), "--help"])
    assert not (tmp_path / "results").exists()


def test_a_run_without_its_keys_is_refused(tmp_path):
    with pytest.raises(ValueError, match="commit"):
        results.put(tmp_path / "b.json", {"device": "NVIDIA H200", "date": "2026-12-05"})


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_results_files_keep_one_latest_run_per_device(path):
    assert path.suffix == ".json", "bench/results/ holds <bench>.json files only"
    data = json.loads(path.read_text())
    assert list(data) == ["runs"] and data["runs"]
    devices = [run["device"] for run in data["runs"]]
    assert len(set(devices)) == len(devices), f"{path.name}: more than one run of a device"
    for run in data["runs"]:
        assert list(run)[:3] == ["device", "date", "commit"]
        assert run["device"] and isinstance(run["device"], str)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"])
        assert re.fullmatch(r"[0-9a-f]{7,40}|unknown", run["commit"])


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_no_results_file_name_key_or_text_names_a_development_round(path):
    assert not ROUND.search(path.name)
    data = json.loads(path.read_text())
    assert not [k for k in keys(data) if ROUND.search(k)]
    assert not ROUND.search(path.read_text())

"""bench/quality.py: the quality benchmark as variants of one workflow config, built by `make run`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3build.config import validate_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import quality  # noqa: E402
from workflow_util import copy_workflow  # noqa: E402

BASE = yaml.safe_load(quality.BASE_CONFIG.read_text())


def variant(name: str) -> dict:
    return quality.merged(BASE, quality.override_of(name))


@pytest.mark.parametrize("name", quality.VARIANTS)
def test_every_variant_is_a_valid_config_with_its_own_output_root(name):
    from snakemake.utils import validate

    config = variant(name)
    validate_config(config, validate)  # the schema, as the workflow checks it
    if name != quality.BASE:
        assert config["output_root"] != BASE["output_root"]  # `make run` of one variant keeps the base's tree


def test_each_variant_shares_exactly_the_stages_its_override_leaves_alone():
    shared = {name: quality.shared_stages(BASE, variant(name)) for name in quality.VARIANTS}
    upstream = ["data", "regen", "tokens"]
    for head in ("plain", "fc_norm", "norm_output", "tv", "nla", "lk_hybrid", "frozen_lm_head", "steps_8000"):
        assert shared[head] == [*upstream, "hidden", "vocab"], head  # trains, exports and evaluates anew
    evaluate_only = quality.merged(BASE, {"evaluate": {"max_new_tokens": 64}})
    assert quality.shared_stages(BASE, evaluate_only) == [*upstream, "hidden", "vocab", "train", "export"]
    assert shared["bf16"] == [*upstream, "vocab"]  # extracts its own states
    assert shared["final_only"] == [*upstream, "vocab"]
    assert shared["original"] == []  # other datasets: nothing is the base's
    assert shared[quality.BASE] == list(quality.STAGES)
    assert quality.shared_stages(BASE, {**BASE, "target": {"model": "other"}}) == []


def test_overrides_change_what_their_names_say():
    assert BASE["extract"]["storage_dtype"] == "fp8" and BASE["train"]["norm_before_fc"]  # the recipe's winners
    assert variant("bf16")["extract"] == {**BASE["extract"], "storage_dtype": "bf16"}
    assert variant("plain")["train"] == {**BASE["train"], "norm_before_fc": False}
    assert variant("fc_norm")["train"]["fc_norm"] and not variant("fc_norm")["train"]["norm_before_fc"]  # one or the other
    assert variant("norm_output")["train"]["norm_before_fc"]  # on top of the recipe's head
    final = variant("final_only")["extract"]
    assert final["backend"] == "hf" and len(set(final["aux_layer_ids"])) == 1  # vLLM cannot repeat a layer
    assert variant("norm_output")["evaluate"] == BASE["evaluate"]  # mappings merge key by key
    assert not any(ds.get("regenerate") for ds in variant("original")["datasets"])
    assert {ds["path"] for ds in variant("original")["datasets"]} == {ds["path"] for ds in BASE["datasets"]}
    assert variant("lk_hybrid")["train"] == {**BASE["train"], "loss": "lk_hybrid"}


def test_the_short_recipe_is_the_full_one_with_less_data_steps_and_evaluation():
    """configs/overrides/smollm2-gpu-short.yaml (the ablation recipe) merged over the base: a valid config whose datasets
    are the base's greedy pass and first sampled pass, and every variant shares with it what it shares with
    the full recipe."""
    from snakemake.utils import validate

    short = quality.base_config([quality.BASE_CONFIG, ROOT / "configs" / "overrides" / "smollm2-gpu-short.yaml"])
    validate_config(json.loads(json.dumps(short)), validate)  # (validation fills in the schema's defaults)
    assert [d["name"] for d in short["datasets"]] == [
        d["name"] for d in BASE["datasets"] if "." not in d["name"] or d["name"].endswith(".s1")]
    assert all(d in BASE["datasets"] for d in short["datasets"]) and len(short["datasets"]) == 14
    assert short["train"] == {**BASE["train"], "max_steps": 1500}
    assert [s["name"] for s in short["evaluate"]["sets"]] == ["mt_bench"]
    assert short["extract"] == BASE["extract"] and short["regenerate"] == BASE["regenerate"]
    for name in quality.VARIANTS:
        full = quality.shared_stages(BASE, variant(name))
        assert quality.shared_stages(short, quality.merged(short, quality.override_of(name))) == full, name


def test_link_tree_links_and_a_rebuilt_link_leaves_the_base_intact(tmp_path):
    base, var = tmp_path / "base" / "tokens", tmp_path / "var" / "tokens"
    (base / "ds").mkdir(parents=True)
    (base / "ds" / "00000.safetensors").write_text("base")
    os.utime(base / "ds" / "00000.safetensors", (1_000_000, 1_000_000))
    assert quality.link_tree(base, var) == 1
    linked = var / "ds" / "00000.safetensors"
    assert os.path.samefile(linked, base / "ds" / "00000.safetensors") and linked.stat().st_mtime == 1_000_000
    assert quality.link_tree(base, var) == 0  # already linked
    tmp = linked.with_name("tmp")  # a job of the variant rewrites it the way the stages do: new file, rename
    tmp.write_text("variant")
    os.replace(tmp, linked)
    assert (base / "ds" / "00000.safetensors").read_text() == "base"
    assert quality.link_tree(base, var) == 1 and linked.read_text() == "base"  # the base's again


def test_free_hidden_waits_for_the_last_variant_that_trains_on_a_set(tmp_path):
    shared = {"eagle3": list(quality.STAGES), "tv": ["data", "hidden"], "bf16": ["data"]}
    roots = {n: tmp_path / n for n in shared}
    for n in shared:
        (roots[n] / "hidden").mkdir(parents=True)
    quality.free_hidden(["eagle3"], ["tv", "bf16"], shared, roots)
    assert all((roots[n] / "hidden").is_dir() for n in shared)  # tv still trains on the base's
    quality.free_hidden(["eagle3", "tv"], ["bf16"], shared, roots)
    assert not (roots["eagle3"] / "hidden").exists() and not (roots["tv"] / "hidden").exists()
    assert (roots["bf16"] / "hidden").is_dir()
    quality.free_hidden(["eagle3", "tv", "bf16"], [], shared, roots)
    assert not (roots["bf16"] / "hidden").exists()


def test_serve_args_take_the_engine_flags_as_one_string():
    """argparse refuses a list of words that start with --, so the server's flags come as one string."""
    args = quality.parser().parse_args(["--serve-args", "--gpu-memory-utilization 0.3 --max-model-len 4096"])
    assert args.serve_args == ["--gpu-memory-utilization", "0.3", "--max-model-len", "4096"]
    assert quality.parser().parse_args([]).serve_args == ["--gpu-memory-utilization", "0.3"]


def test_job_counts_reads_the_run_table_not_a_later_one():
    text = ("Job stats:\njob      count\n-----  -------\ntotal        0\n\nJob stats:\njob  count\n---  ---\n"
            "split_0 1\ntotal 1\n")
    assert quality.job_counts(text) == {}
    text = ("Job stats:\njob           count\n----------  -------\nall 1\nsplit_0 1\nsplit_1 2\nregenerate 3\n"
            "total 7\n")
    assert quality.job_counts(text) == {"split": 3, "regenerate": 3}


def report(tau3: float, t1: float | None = None) -> dict:
    def row(tau):
        return {"mean_acceptance_length": tau, "drafts": 10, "per_category": {"coding": {"mean_acceptance_length": tau}}}

    def per_k(tau):
        return {"3": row(tau), "7": row(tau + 0.5)}

    out = {"turns": 4, "k": per_k(tau3)}
    out["k"]["3"].update(mismatches=0, simulation_agrees=2, speedup=1.5)
    if t1 is not None:
        out["at_temperature"] = {"1.0": {"k": {"3": per_k(t1)["3"]}}}
    return out


def test_read_reports_keeps_the_training_summary_and_its_peak_memory(tmp_path):
    """A variant's train peak is a result too (a head variant's memory price, docs/TRAINING.md, Memory)."""
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "mt_bench.json").write_text(json.dumps({"sets": {"mt_bench": report(2.4)}}))
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "summary.json").write_text(json.dumps(
        {"steps": 1500, "best_step": 1500, "peak_memory_gib": 11.05, "params_hash": "x"}))
    got = quality.read_reports(tmp_path, {"evaluate": {"sets": [{"name": "mt_bench"}]}})
    assert got["train"] == {"steps": 1500, "best_step": 1500, "peak_memory_gib": 11.05}
    assert got["sets"]["mt_bench"]["tau"] == {"3": 2.4, "7": 2.9}


def test_summary_and_table_carry_tau_per_k_category_and_temperature():
    variants = {
        "eagle3": {"override_keys": [], "sets": {"mt_bench": quality.set_summary(report(2.4))}},
        "t1": {"override_keys": ["evaluate.temperatures=[0.0, 1.0]"],
               "sets": {"mt_bench": quality.set_summary(report(2.4, t1=2.1))}},
    }
    summary = variants["t1"]["sets"]["mt_bench"]
    assert summary["tau"] == {"3": 2.4, "7": 2.9} and summary["per_category"]["coding"]["7"] == 2.9
    assert summary["sequential"]["3"] == {"mismatches": 0, "simulation_agrees": 2, "speedup": 1.5}
    assert summary["at_temperature"]["1.0"]["tau"] == {"3": 2.1}
    table = quality.tables(variants).splitlines()
    assert table[0] == "| variant | override | MT-Bench τ@3 | MT-Bench τ@7 | MT-Bench τ@3 T=1.0 |"
    assert table[2] == "| eagle3 | (base) | 2.40 | 2.90 |  |"
    assert table[3] == "| t1 | `evaluate.temperatures=[0.0, 1.0]` | 2.40 | 2.90 | 2.10 |"
    assert "| coding | 2.40 / 2.90 | 2.40 / 2.90 |" in table


def test_configs_only_writes_configs_make_can_run(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "quality.py"), "--configs-only", "--workdir",
                          str(tmp_path), "--root", "q", "--variants", "bf16", "tv"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "make run CONFIG=q/configs/bf16.yaml" in out and "links the base's: data, regen, tokens, vocab" in out
    bf16 = yaml.safe_load((tmp_path / "q" / "configs" / "bf16.yaml").read_text())
    assert bf16["output_root"] == "q/bf16" and bf16["extract"]["storage_dtype"] == "bf16"
    assert bf16["datasets"] == BASE["datasets"]
    assert yaml.safe_load((tmp_path / "q" / "configs" / "eagle3.yaml").read_text())["output_root"] == "q/eagle3"
    # a base of several files, merged in order: the short recipe's plain head
    short = str(ROOT / "configs" / "overrides" / "smollm2-gpu-short.yaml")
    subprocess.run([sys.executable, str(ROOT / "bench" / "quality.py"), "--configs-only", "--workdir", str(tmp_path),
                    "--root", "s", "--base", str(quality.BASE_CONFIG), short, "--variants", "plain"],
                   capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    text = (tmp_path / "s" / "configs" / "plain.yaml").read_text()
    plain = yaml.safe_load(text)
    assert len(plain["datasets"]) == 14 and plain["train"]["max_steps"] == 1500
    assert plain["train"]["norm_before_fc"] is False and "smollm2-gpu.yaml + smollm2-gpu-short.yaml" in text


@pytest.mark.slow  # two workflow builds of ~11 and ~6 jobs, side by side: about 100 s on 2 cores
def test_smoke_run_builds_two_variants_through_make_sharing_the_base_upstream(tmp_path):
    if not (quality.SHARED / "assets" / "models" / "stories260K").exists():
        pytest.skip("../shared/assets is absent")
    wd = copy_workflow(tmp_path / "wf")
    shutil.copy2(ROOT / "Makefile", wd / "Makefile")
    cmd = [sys.executable, str(ROOT / "bench" / "quality.py"), "--smoke", "--workdir", str(wd), "--root", "q",
           "--out", str(tmp_path / "quality_smollm2.json")]
    # the base builds what bf16 shares, then the two build side by side
    packed = tmp_path / "regen.tar.xz"
    proc = subprocess.run([*cmd, "--parallel", "2", "--pack-regeneration", str(packed)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run = json.loads((tmp_path / "quality_smollm2.json").read_text())["runs"][0]
    base, bf16 = run["variants"]["eagle3"], run["variants"]["bf16"]
    assert base["jobs"]["regenerate"] == 2 and base["jobs"]["train"] == 1  # the fake server answered
    # bf16 extracts its own states and trains on them; the data, answers, tokens and vocabulary are the base's
    assert bf16["jobs"] == {"extract": 2, "train": 1, "export": 1, "evaluate": 1}
    assert bf16["shared_from_base"] == ["data", "regen", "tokens", "vocab"]
    for v in (base, bf16):
        tau = v["sets"]["demo_heldout"]["tau"]
        assert set(tau) == {"1", "3"} and all(1.0 <= t <= 4.0 for t in tau.values())
    assert "| bf16 | `extract.storage_dtype=bf16` |" in proc.stdout
    assert "[eagle3] " in proc.stdout and "[bf16] " in proc.stdout  # each build's lines marked
    assert proc.stdout.count(f"Snakemake records into {packed}") == 1  # the base builds twice, packs once
    assert "eagle3: make run CONFIG=q/configs/eagle3.yaml SMK_ARGS='--until vocab'" in proc.stdout  # bf16's last shared
    assert "bf16: make run CONFIG=q/configs/bf16.yaml SMK_ARGS='--prioritize q/bf16/eval/demo_heldout.json'" in proc.stdout
    # the server is gone and a second run, one variant at a time, plans nothing anywhere
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-4000:]
    run = json.loads((tmp_path / "quality_smollm2.json").read_text())["runs"][0]
    assert all(v["jobs"] == {} for v in run["variants"].values())
    # another checkout restores the packed answers: its plan starts after them
    other = copy_workflow(tmp_path / "wf2")
    shutil.copy2(ROOT / "Makefile", other / "Makefile")
    quality.unpack_regeneration(other, "q/eagle3", packed)
    subprocess.run([*cmd[:-2], "--configs-only", "--workdir", str(other)], check=True, capture_output=True, timeout=120)
    plan = subprocess.run(["make", "dry-run", "CONFIG=q/configs/eagle3.yaml", f"PYTHON={sys.executable}"], cwd=other,
                          capture_output=True, text=True, timeout=300)
    jobs = quality.job_counts(plan.stdout)
    assert plan.returncode == 0 and jobs["train"] == 1 and "regenerate" not in jobs and "split" not in jobs, plan.stdout


def test_metadata_subject_reads_the_records_snakemake_writes(tmp_path):
    """The record names that --pack-regeneration picks by, read back from a real Snakemake run's records: a short
    path, and one whose record name is cut into '@' folders because it is longer than a file name may be."""
    long = "x" * 200 + "/" + "y" * 150 + ".txt"
    (tmp_path / "Snakefile").write_text(
        f'rule all:\n    input: ["short/a.txt", "{long}"]\n\n'
        'rule short:\n    output: "short/a.txt"\n    shell: "echo hi > {output}"\n\n'
        f'rule long:\n    output: "{long}"\n    shell: "echo hi > {{output}}"\n')
    subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1"], cwd=tmp_path, check=True, capture_output=True,
                   timeout=120)
    meta = tmp_path / quality.METADATA
    records = [r.relative_to(meta) for r in meta.rglob("*") if r.is_file()]
    assert any(len(r.parts) > 1 for r in records)  # the long one was cut into folders
    assert {quality.metadata_subject(r) for r in records} == {"short/a.txt", long}


def record(workdir: Path, path: str) -> Path:
    """A stand-in Snakemake record of `path` (named as Snakemake names it; the test above checks that reading)."""
    import base64

    rec = workdir / quality.METADATA / base64.urlsafe_b64encode(path.encode()).decode()
    rec.parent.mkdir(parents=True, exist_ok=True)
    rec.write_text(json.dumps({"record_format_version": 6, "rule": path}))
    return rec


def test_a_packed_regeneration_restores_elsewhere_and_a_foreign_tarball_writes_nothing(tmp_path):
    import tarfile

    a, b = tmp_path / "a", tmp_path / "b"
    carried = ["q/eagle3/data/alpaca/00000.jsonl", "q/eagle3/regen/alpaca/00000.jsonl",
               "q/eagle3/regen/alpaca/00000.report.json"]
    for i, rel in enumerate([*carried, "q/eagle3/tokens/alpaca/00000.safetensors", "q/bf16/regen/alpaca/00000.jsonl"]):
        (a / rel).parent.mkdir(parents=True, exist_ok=True)
        (a / rel).write_text(f"file {i}\n")
        os.utime(a / rel, (1_700_000_000 + i, 1_700_000_000 + i))
        record(a, rel)
    packed = tmp_path / "regen.tar.xz"
    assert quality.pack_regeneration(a, "q/eagle3", packed) == 3  # the records of the carried files only
    names = tarfile.open(packed).getnames()
    assert not any("tokens" in n or "bf16" in n for n in names)

    assert quality.unpack_regeneration(b, "q/eagle3", packed) == 6  # three files, three records
    for rel in carried:
        assert (b / rel).read_text() == (a / rel).read_text()
        assert (b / rel).stat().st_mtime == (a / rel).stat().st_mtime  # Snakemake compares them
    assert sorted(p.name for p in (b / quality.METADATA).iterdir()) == sorted(
        p.name for p in (a / quality.METADATA).iterdir() if "tokens" not in quality.metadata_subject(Path(p.name))
        and "bf16" not in quality.metadata_subject(Path(p.name)))

    def tarball(name: str, members: dict[str, str]) -> Path:
        path = tmp_path / name
        with tarfile.open(path, "w:xz") as tar:
            for arcname, src in members.items():
                tar.add(src, arcname=arcname)
        return path

    other = tmp_path / "other"
    other.mkdir()
    (other / "f").write_text("x")
    tokens_record = next(p for p in (a / quality.METADATA).iterdir()
                         if "tokens" in quality.metadata_subject(Path(p.name)))
    cases = {
        "stray.tar.xz": ({carried[1]: a / carried[1], "Makefile": other / "f"}, "member 'Makefile'"),
        "record.tar.xz": ({carried[1]: a / carried[1], f".snakemake/metadata/{tokens_record.name}": tokens_record},
                          "nor a Snakemake record"),
        "up.tar.xz": ({carried[1]: a / carried[1], "q/eagle3/regen/../../../x": other / "f"}, "member"),
        "root.tar.xz": ({"r/eagle3/regen/alpaca/00000.jsonl": a / carried[1]}, "for --root q"),
        "garbled.tar.xz": ({carried[1]: a / carried[1], ".snakemake/metadata/not*base64": other / "f"},
                           "nor a Snakemake record"),
    }
    for name, (members, says) in cases.items():
        c = tmp_path / f"c_{name}"
        with pytest.raises(SystemExit) as e:
            quality.unpack_regeneration(c, "q/eagle3", tarball(name, members))
        assert says in str(e.value) and name in str(e.value)
        assert not c.exists()  # refused before a file was written
    with pytest.raises(SystemExit, match="cannot read it as a tarball"):
        quality.unpack_regeneration(b, "q/eagle3", other / "f")


def test_a_carried_regeneration_that_is_not_current_stops_instead_of_regenerating(tmp_path, monkeypatch):
    """--regeneration-from without a server: where Snakemake still plans regenerate jobs (config or code changed
    since the tarball was packed), the build stops with the reason instead of running them against no server."""
    calls = []

    def make(workdir, target, cfg, smk_args, log_path, env=None, prefix=""):
        calls.append((target, smk_args))
        return "Job stats:\njob           count\n----------  -------\nregenerate        3\ntotal             3\n", 0.1

    monkeypatch.setattr(quality, "make", make)
    args = quality.parser().parse_args(["--regeneration-from", "regen.tar.xz", "--workdir", str(tmp_path)])
    args.work = tmp_path / "build-quality"
    with pytest.raises(SystemExit) as e:
        quality.build_variant(args, quality.BASE, BASE, tmp_path / "c.yaml", tmp_path / "r", tmp_path / "r", [])
    assert "still plans 3 regenerate job(s)" in str(e.value) and "--serve-regeneration" in str(e.value)
    assert calls == [("dry-run", "--until regenerate")]  # nothing ran


def test_a_build_evaluates_its_first_set_first():
    """The evaluations queue for the one GPU; the config's first set (MT-Bench, the bar's) goes first, so a run
    cut off during evaluation still has it (Snakemake's own order ran Spec-Bench first)."""
    assert quality.first_set_first(BASE) == f"--prioritize {BASE['output_root']}/eval/mt_bench.json"
    assert quality.first_set_first({**BASE, "evaluate": {"sets": []}}) == ""


def test_parallel_builds_take_their_own_gpus_or_share_them(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(quality.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert quality.device_groups(4) == [{"CORES": "4", "CUDA_VISIBLE_DEVICES": f"{2 * i},{2 * i + 1}"}
                                        for i in range(4)]
    assert quality.device_groups(3) == [{"CORES": "5", "CUDA_VISIBLE_DEVICES": v} for v in ("0,1", "2,3", "4,5")]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert quality.device_groups(3) == [{"CORES": "5"}] * 3  # the cores are still shared out


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_failed_or_cut_off_run_keeps_the_variants_that_finished(tmp_path, monkeypatch, parallel):
    """Each finished variant is in <root>/quality.json at once (a run cut off keeps it), and one variant's
    failure neither discards the others' results nor hides that it failed."""
    def build_variant(args, name, *rest, **kwargs):
        if name == "tv" and not kwargs.get("until"):
            sys.exit("`make run` failed (2): CUDA out of memory")
        return {"config": name, "output_root": name, "shared_from_base": [], "jobs": {}, "until_regenerate_s": 0.0,
                "run_s": 0.0}

    seen = []

    def read_reports(root, config):
        seen.append(json.loads((tmp_path / "build-q" / "quality.json").read_text())["variants"]
                    if (tmp_path / "build-q" / "quality.json").exists() else {})
        return {"sets": {"mt_bench": quality.set_summary(report(2.4))}, "train": {}}

    monkeypatch.setattr(quality, "build_variant", build_variant)
    monkeypatch.setattr(quality, "read_reports", read_reports)
    out = tmp_path / "quality_smollm2.json"
    argv = ["--variants", "eagle3", "tv", "bf16", "--parallel", str(parallel), "--root", "build-q",
            "--workdir", str(tmp_path), "--out", str(out)]
    with pytest.raises(SystemExit) as e:
        quality.main(argv)
    assert "variants failed: tv" in str(e.value)
    saved = json.loads((tmp_path / "build-q" / "quality.json").read_text())
    if parallel == 1:  # one at a time: the base ran, tv failed, bf16 (after it) never started
        assert list(saved["variants"]) == ["eagle3"] and seen == [{}]
    else:
        assert set(saved["variants"]) == {"eagle3", "bf16"}
    assert "CUDA out of memory" in saved["failed"]["tv"]
    recorded = json.loads(out.read_text())["runs"][0]
    assert recorded["variants"].keys() == saved["variants"].keys() and "tv" in recorded["failed"]


def test_the_base_builds_up_to_the_last_shared_stages_only():
    assert quality.upstream_stages("vocab") == {"data", "regen", "tokens"}
    assert quality.upstream_stages("eval") == {"data", "regen", "tokens", "hidden", "vocab", "train", "export"}

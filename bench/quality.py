"""Quality benchmark: acceptance length of SmolLM2-135M-Instruct heads built by the workflow itself, one
config per variant, in one table (BENCHMARKS.md §3).

    python3 bench/quality.py --serve-regeneration --free-hidden --out bench/results/quality_smollm2.json
    python3 bench/quality.py --variants eagle3 plain           # some variants (eagle3, the base, always runs)
    python3 bench/quality.py --variants eagle3 tv nla --parallel 3   # three at once, after the shared stages
    python3 bench/quality.py --configs-only                    # write the variants' configs, print their commands
    python3 bench/quality.py --table bench/results/quality_smollm2.json      # print a results file's tables
    python3 bench/quality.py --smoke --root /tmp/q             # CPU: stories260K, a fake regeneration server, 2 variants
    python3 bench/quality.py --serve-regeneration --variants eagle3 --pack-regeneration regen.tar.xz   # keep the answers
    python3 bench/quality.py --regeneration-from regen.tar.xz --variants eagle3 plain          # elsewhere, no vLLM

A variant is the base config (configs/smollm2-gpu.yaml) with configs/ablations/<name>.yaml merged over it
(Snakemake's own merge of several --configfile: mappings key by key, lists replaced); `eagle3` is the base
itself. The merged config is written to <root>/configs/<name>.yaml with output_root <root>/<name>, and built
by `make run CONFIG=<root>/configs/<name>.yaml`: the benchmark measures what a user runs.

Sharing. Before its run a variant's output root gets hard links to the base's outputs of every stage that
reads no config section the override changes (STAGES): a head or loss variant (train.*) links data, regen,
tokens, hidden and vocab, and runs train, export and evaluate; bf16 and final_only (extract.*) link data, regen,
tokens and vocab; an evaluate.* override would link everything up to the export; original (datasets) links
nothing. The T = 1 rows come with every variant: the base config measures evaluate.temperatures [0, 1]. Links cost
no disk. Snakemake keeps no record for a linked file, so it takes it as current (it is: its stage's inputs and
config are the base's, which built it), and a job that does run writes new files in place of the links (the
stages write through a temporary file and a rename), so the base's stay intact. A variant that changes the
extraction stores its own hidden states: bf16 twice the base's fp8 (~46 GB for this recipe's 10M tokens),
final_only as much as the base (~23 GB). --free-hidden deletes each hidden-state folder, with its links, after the
last variant that trains on it (a later run of those variants extracts and trains again). When the base's outputs change, run this again:
it links the new files, and Snakemake rebuilds what follows them in each variant.

Parallel. With --parallel N the base first builds every stage another variant takes from it (`make run` with
`--until` those stages' rules), then all variants, the base's own rest included, build N at a time, each a
`make run` of its own output root (Snakemake's locks are per file, so the runs never meet). Each build gets
1/N of the host's cores (make's CORES) and, where there are at least N GPUs, its own share of them
(CUDA_VISIBLE_DEVICES); else they share the GPUs (for a small head whose step leaves the GPU partly idle). --free-hidden builds one variant at a time and cannot be combined.

Order. A full build passes Snakemake `--prioritize` for its first eval set (MT-Bench, the bar's): the
evaluations queue for the GPU, and a run cut off during them keeps that one.

Regeneration. The base config regenerates through an OpenAI-compatible server. With --serve-regeneration,
a variant whose dry-run plans regenerate jobs gets one: `vllm serve TARGET --port <regenerate.url's port>`
is started, the workflow runs up to those jobs (`--until regenerate`), and the server is stopped before
extraction needs the GPU. Regeneration is the recipe's one stage that needs the engine, and on one GPU it takes
longer than the rest but training. --pack-regeneration FILE writes the base's split conversations and answers,
with Snakemake's records of them, once they are built; --regeneration-from FILE restores them in another
checkout (the same --root), which then builds the rest without vLLM. A run whose config or regeneration code
no longer matches the tarball stops with the reason instead of regenerating silently.

What the workflow cannot do and this script does: the links, the regeneration server, and one results file
(bench/results/quality_smollm2.json: per variant and eval set, tau@k for every k, per category, and the T > 0
rows where the variant measures them) with its tables. <root>/quality.json is rewritten after each variant,
so a run that is cut off keeps what finished; a variant whose build fails is listed under `failed` with the
error (with --parallel the others finish), and the run exits non-zero after recording the rest. The fp32 cross-check of the stage-function driver this
replaces is the evaluate stage's own now: `evaluate.sequential_samples` questions per set decode step by step
in the target's dtype (`mismatches`, `simulation_agrees` in each report), and the turns that part from the
reference there are decoded again in float32 (`float32_recheck`). The earlier driver's results stay in
bench/results/quality_smollm2_{eagle3,final_only,original}.json.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import copy
import json
import os
import queue
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from eagle3build.atomic import write_json_atomic  # noqa: E402

SHARED = ROOT.parent / "shared"
BASE_CONFIG = ROOT / "configs" / "smollm2-gpu.yaml"
ABLATIONS = ROOT / "configs" / "ablations"
BASE = "eagle3"  # the base config's own variant: the reference row, and the outputs the others link
VARIANTS = [BASE, "plain", "fc_norm", "norm_output", "tv", "nla", "lk_hybrid", "frozen_lm_head", "steps_8000",
            "bf16", "final_only", "original"]
SMOKE_VARIANTS = [BASE, "bf16"]
VLLM_EXECUTABLE = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
# The workflow's stage folders under an output root: the config sections each one's jobs read, and the stage
# folders they read (every stage also reads `target`). A change of any other section shares nothing.
STAGES = {
    "data": ({"datasets", "prepare"}, ()),
    "regen": ({"datasets", "regenerate"}, ("data",)),
    "tokens": ({"datasets", "prepare"}, ("data", "regen")),
    "hidden": ({"extract"}, ("tokens",)),
    "vocab": ({"vocab"}, ("tokens",)),
    "train": ({"train"}, ("hidden", "vocab")),
    "export": ({"export"}, ("train", "vocab")),
    "eval": ({"evaluate"}, ("export",)),
}
# The rules whose jobs (with everything upstream: Snakemake's --until) build each stage folder but `data`,
# which every other stage reads. A regenerated dataset's tokens come from `tokens_regenerated`.
STAGE_RULES = {"regen": "regenerate", "tokens": "tokens tokens_regenerated", "hidden": "extract", "vocab": "vocab",
               "train": "train", "export": "export", "eval": "evaluate"}
KNOWN_SECTIONS = {"output_root", "target"}.union(*(sections for sections, _ in STAGES.values()))
# What --pack-regeneration carries and --regeneration-from restores: the base's split conversations and the
# target's answers to them, with Snakemake's records of those files (the GPU-bound stage of the recipe).
CARRIED_STAGES = ("data", "regen")
METADATA = Path(".snakemake") / "metadata"
SET_TITLES = {"mt_bench": "MT-Bench", "spec_bench": "Spec-Bench"}
# A chat template for stories260K (a base model without one), for the smoke run.
SMOKE_TEMPLATE = ROOT / "tests" / "data" / "chat_template.jinja"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- variants: configs and what they share
def merged(base: dict, override: dict) -> dict:
    """`override` over `base` as Snakemake merges `--configfile base override`."""
    from snakemake.utils import update_config

    config = copy.deepcopy(base)
    update_config(config, copy.deepcopy(override))
    return config


def base_config(paths: list[Path]) -> dict:
    """The base config: the files merged in order (a recipe and overrides of it, as `make run CONFIG="A B"`)."""
    config: dict = {}
    for path in paths:
        config = merged(config, yaml.safe_load(path.read_text()) or {})
    return config


def override_of(name: str) -> dict:
    """The variant's override (configs/ablations/<name>.yaml); the base's is empty."""
    if name == BASE:
        return {}
    path = ABLATIONS / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in ABLATIONS.glob("*.yaml"))
        sys.exit(f"no variant '{name}': {path} does not exist (variants: {BASE}, {', '.join(known)})")
    return yaml.safe_load(path.read_text()) or {}


def upstream_stages(stage: str) -> set[str]:
    """Every stage folder a stage's jobs read, directly or through the stages they read."""
    direct = set(STAGES[stage][1])
    return direct.union(*(upstream_stages(u) for u in direct))


def stage_sections(stage: str) -> set[str]:
    """Every config section a stage's outputs depend on, through the stages it reads."""
    return {"target"}.union(*(STAGES[s][0] for s in {stage, *upstream_stages(stage)}))


def shared_stages(base: dict, variant: dict) -> list[str]:
    """The stage folders a variant may take from the base: those reading no section the variant changes."""
    changed = {k for k in set(base) | set(variant) if k != "output_root" and base.get(k) != variant.get(k)}
    if changed - KNOWN_SECTIONS:
        return []
    return [stage for stage in STAGES if not stage_sections(stage) & changed]


def safe_path(path: Path) -> str:
    """A path that `make run CONFIG=...` may carry: the Makefile puts it into a shell command unquoted."""
    text = str(path)
    if not re.fullmatch(r"[A-Za-z0-9._/+-]+", text):
        sys.exit(f"{text!r}: use a path of letters, digits and . _ / + - only (it reaches a shell through make)")
    return text


def write_config(config: dict, path: Path, name: str, base: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# Variant '{name}' of bench/quality.py: {base} with configs/ablations/{name}.yaml "
              "merged over it (written by the script; edit those instead).\n")
    path.write_text(header + yaml.safe_dump(config, sort_keys=False, allow_unicode=True))


def link_tree(src: Path, dst: Path) -> int:
    """Hard-link every file under src to the same place under dst (a copy, with its mtime, where the two
    are on different file systems); a file already there that is not the same one is replaced."""
    count = 0
    for path in sorted(src.rglob("*")):
        if path.is_dir():
            continue
        target = dst / path.relative_to(src)
        if target.exists() and os.path.samefile(path, target):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.link")
        tmp.unlink(missing_ok=True)
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copy2(path, tmp)
        os.replace(tmp, target)
        count += 1
    return count


# ---------------------------------------------------------------- the workflow
def make(workdir: Path, target: str, config: str, smk_args: str, log_path: Path, env: dict | None = None,
         prefix: str = "") -> tuple[str, float]:
    """`make TARGET CONFIG=config` in workdir, its output shown (each line after `prefix`) and appended to
    log_path; (output, seconds). A failed run stops the benchmark, or with --parallel its variant (its log
    says why; the variant's tree keeps what it finished)."""
    cmd = ["make", "--no-print-directory", target, f"CONFIG={config}", f"PYTHON={sys.executable}"]
    if smk_args:
        cmd.append(f"SMK_ARGS={smk_args}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    t0 = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log_file:
        log_file.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        for line in proc.stdout:
            lines.append(line)
            log_file.write(line)
            if target == "run":
                print(prefix + line, end="", flush=True)
        proc.wait()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"`{' '.join(cmd)}` failed ({proc.returncode}) in {workdir}; its output: {log_path}\n"
                 + "".join(lines[-40:]))
    return "".join(lines), seconds


def job_counts(output: str) -> dict[str, int]:
    """rule -> jobs, from the job stats Snakemake prints before it runs (or dry-runs) anything."""
    table = re.search(r"Job stats:\njob +count\n-+ +-+\n((?:\S+ +\d+\n)*)total", output)
    if not table:
        return {}
    jobs: dict[str, int] = {}
    for line in table.group(1).splitlines():
        rule, count = line.split()
        if rule != "all":
            rule = re.sub(r"^split_\d+$", "split", rule)
            jobs[rule] = jobs.get(rule, 0) + int(count)
    return jobs


def add_jobs(jobs: dict[str, int], more: dict[str, int]) -> None:
    """Add another run's job counts (rule -> jobs) into `jobs`."""
    for rule, count in more.items():
        jobs[rule] = jobs.get(rule, 0) + count


def metadata_subject(record: Path) -> str:
    """The output path that a Snakemake metadata record (its path under .snakemake/metadata) is about: the
    urlsafe base64 of that path, cut into '@'-prefixed folders where it is longer than a file name may be
    (Snakemake's FilePersistence; tests/test_bench_quality.py checks this against a real run's records).
    "" for a name that is no such encoding."""
    try:
        return base64.urlsafe_b64decode("".join(part.removeprefix("@") for part in record.parts)).decode()
    except (ValueError, UnicodeDecodeError):  # (binascii.Error is a ValueError) not a record's name
        return ""


def within(path: str, folders: list[str]) -> bool:
    return any(path == f or path.startswith(f + "/") for f in folders)


def carried_folders(base_root: str) -> list[str]:
    return [f"{base_root}/{stage}" for stage in CARRIED_STAGES]


def pack_regeneration(workdir: Path, base_root: str, out: Path) -> int:
    """Write `out` (tar.xz): the base's CARRIED_STAGES folders and Snakemake's records of their files, by
    their paths relative to the workdir (mtimes kept), so that another host's checkout resumes after them
    (docs/PRODUCTION.md, "Moving a build"). Returns the number of records."""
    folders = carried_folders(base_root)
    missing = [f for f in folders if not (workdir / f).is_dir()]
    if missing:
        sys.exit(f"--pack-regeneration: {', '.join(missing)} not built in {workdir}: nothing to pack")
    meta = workdir / METADATA
    records = [r for r in sorted(meta.rglob("*")) if r.is_file()
               and within(metadata_subject(r.relative_to(meta)), folders)] if meta.is_dir() else []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with tarfile.open(tmp, "w:xz", preset=9) as tar:  # text: 116 MB -> ~9.5 MB for the recipe
            for folder in folders:
                tar.add(workdir / folder, arcname=folder)
            for record in records:
                tar.add(record, arcname=str(record.relative_to(workdir)))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"packed {' '.join(folders)} and {len(records)} Snakemake records into {out}")
    return len(records)


def unpack_regeneration(workdir: Path, base_root: str, path: Path) -> int:
    """Restore a --pack-regeneration tarball into the workdir. Every member must be one of the base's
    CARRIED_STAGES folders or files, or a Snakemake record of one of them; anything else stops this before a
    file is written. Returns the number of files restored."""
    folders = carried_folders(base_root)
    meta_dirs = {str(METADATA.parent), str(METADATA)}
    try:
        tar = tarfile.open(path)
    except (OSError, tarfile.TarError) as e:
        sys.exit(f"--regeneration-from {path}: cannot read it as a tarball ({e})")
    with tar:
        members = tar.getmembers()
        for m in members:
            name = m.name.rstrip("/")
            record = name.startswith(str(METADATA) + "/") and m.isfile()
            parent = m.isdir() and (name in meta_dirs or base_root.startswith(name + "/"))  # folders above them
            if name.startswith("/") or ".." in name.split("/") or not (
                    within(name, folders) or parent
                    or (record and within(metadata_subject(Path(name).relative_to(METADATA)), folders))):
                sys.exit(f"--regeneration-from {path}: member {m.name!r} is neither under {' or '.join(folders)} "
                         f"nor a Snakemake record of them. A tarball for --root {Path(base_root).parent} is what "
                         "`bench/quality.py --pack-regeneration` writes with that root")
        if not any(within(m.name, [f"{base_root}/regen"]) and m.isfile() for m in members):
            sys.exit(f"--regeneration-from {path}: it holds no file under {base_root}/regen: not a regeneration of "
                     f"this root (packed with another --root?)")
        tar.extractall(workdir, members=members, filter="data")
    files = sum(m.isfile() for m in members)
    log(f"restored {files} files of {' and '.join(folders)} (with their Snakemake records) from {path}")
    return files


def regenerates_through_server(config: dict) -> bool:
    backend = (config.get("regenerate") or {}).get("backend", "hf")
    return backend == "openai" and any(ds.get("regenerate") for ds in config["datasets"])


def server_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def regeneration_server(config: dict, args, log_path: Path):
    """The server regenerate.url names, started as `EXECUTABLE serve TARGET --port P ARGS...` and stopped
    (its whole process group) on the way out, or when this script is killed (bound)."""
    from eagle3build.engine import process
    from eagle3build.engine.openai import normalize_base_url

    url = normalize_base_url(config["regenerate"].get("url", "http://127.0.0.1:8000"))
    host_port = re.fullmatch(r"http://(127\.0\.0\.1|localhost):(\d+)", url)
    if not host_port:
        sys.exit(f"regenerate.url {url!r}: --serve-regeneration starts a server on this host, so the url must be "
                 "http://127.0.0.1:PORT (or localhost)")
    if server_ready(url):
        sys.exit(f"something already answers at {url}: stop it, or run without --serve-regeneration to use it")
    cmd = [*args.serve_executable, "serve", config["target"]["model"], "--port", host_port.group(2),
           *args.serve_args]
    log(f"starting the regeneration server: {' '.join(cmd)} (log {log_path})")
    proc = process.start(cmd, log_path, env={**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0"}, bound=True)
    ticks = process.start_ticks(proc.pid)
    try:
        process.wait_ready(proc, lambda: server_ready(url), args.serve_timeout_s, 1.0)
        log(f"regeneration server ready at {url}")
        yield
    except process.NotReady as e:
        sys.exit(f"the regeneration server {e}: {process.log_tail(log_path)}")
    finally:
        process.terminate(proc.pid, ticks, grace_s=30)
        log("regeneration server stopped")


def pack_once(args, config: dict) -> None:
    """--pack-regeneration, the first time in this run that the base's regeneration is built (the base builds in
    two runs with --parallel: what the others share, then the rest)."""
    if args.pack_regeneration and not args.regeneration_packed:
        pack_regeneration(args.workdir, config["output_root"], args.pack_regeneration)
        args.regeneration_packed = True


def first_set_first(config: dict) -> str:
    """Snakemake's --prioritize for the config's first eval set: the evaluations share the GPU one at a time,
    and Snakemake would otherwise pick their order itself (it ran Spec-Bench before MT-Bench), so a run cut
    off during evaluation would lose the headline set."""
    sets = (config.get("evaluate") or {}).get("sets") or []
    return f"--prioritize {config['output_root']}/eval/{sets[0]['name']}.json" if sets else ""


def build_variant(args, name: str, config: dict, config_path: Path, root: Path, base_root: Path,
                  shared: list[str], until: str = "", env: dict | None = None) -> dict:
    """Link the shared stages, serve regeneration where asked, run the workflow (up to the rules `until`
    names, or all of it); what it ran and took."""
    linked = {stage: link_tree(base_root / stage, root / stage) for stage in shared
              if name != BASE and (base_root / stage).is_dir()}
    if linked:
        log(f"{name}: shares the base's {', '.join(linked)} ({sum(linked.values())} new links)")
    cfg, logs = safe_path(config_path), args.work / "logs"
    prefix = f"[{name}] " if args.parallel > 1 else ""
    jobs, t_regen = {}, 0.0
    carried = args.regeneration_from and name == BASE
    if (args.serve_regeneration or carried) and regenerates_through_server(config):
        plan, _ = make(args.workdir, "dry-run", cfg, "--until regenerate", logs / f"{name}.log", env)
        planned = job_counts(plan).get("regenerate", 0)
        if planned and not args.serve_regeneration:
            sys.exit(f"--regeneration-from {args.regeneration_from}: Snakemake still plans {planned} regenerate "
                     f"job(s) for {cfg}: the carried answers are not those of this config and code (its datasets "
                     "or regenerate settings, or the regeneration code, changed since it was packed). Regenerate "
                     "with --serve-regeneration, or carry a regeneration packed from this checkout; the dry-run's "
                     f"reasons are in {logs / f'{name}.log'}")
        if planned:
            with regeneration_server(config, args, logs / f"{name}.regeneration-server.log"):
                output, t_regen = make(args.workdir, "run", cfg, "--until regenerate", logs / f"{name}.log", env,
                                       prefix)
            jobs = job_counts(output)
            if name == BASE:
                pack_once(args, config)  # now, before the rest: a run cut off later keeps the answers
    smk_args = f"--until {until}" if until else first_set_first(config)
    log(f"{name}: make run CONFIG={cfg}" + (f" SMK_ARGS='{smk_args}'" if smk_args else ""))
    output, seconds = make(args.workdir, "run", cfg, smk_args, logs / f"{name}.log", env, prefix)
    add_jobs(jobs, job_counts(output))
    if name == BASE:
        pack_once(args, config)
    return {"config": cfg, "output_root": config["output_root"], "shared_from_base": shared if name != BASE else [],
            "jobs": jobs, "until_regenerate_s": round(t_regen, 1), "run_s": round(seconds, 1)}


# ---------------------------------------------------------------- reports
def taus(per_k: dict) -> dict:
    return {k: round(row["mean_acceptance_length"], 4) for k, row in per_k.items()}


def set_summary(result: dict) -> dict:
    """One eval set's report reduced to tau@k overall and per category (and the same at each T > 0)."""
    def rows(res: dict) -> dict:
        per_k = res["k"]
        cats = sorted({c for row in per_k.values() for c in row["per_category"]})
        return {"tau": taus(per_k), "drafts": {k: row["drafts"] for k, row in per_k.items()},
                "per_category": {c: {k: round(row["per_category"][c]["mean_acceptance_length"], 4)
                                     for k, row in per_k.items() if c in row["per_category"]} for c in cats}}

    out = {"turns": result.get("turns"), **rows(result)}
    kept = ("mismatches", "simulation_agrees", "speedup", "float32_recheck")
    checked = {k: {key: row[key] for key in kept if key in row}
               for k, row in result["k"].items() if "mismatches" in row}
    if checked:
        out["sequential"] = checked
    if result.get("at_temperature"):
        out["at_temperature"] = {t: rows(res) for t, res in result["at_temperature"].items()}
    return out


def read_reports(out_root: Path, config: dict) -> dict:
    sets = {}
    for eval_set in config["evaluate"]["sets"]:
        report = json.loads((out_root / "eval" / f"{eval_set['name']}.json").read_text())
        sets[eval_set["name"]] = set_summary(report["sets"][eval_set["name"]])
    summary_path = out_root / "train" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    train = {k: summary[k] for k in ("steps", "best_step", "best_val", "train_samples", "val_samples",
                                     "peak_memory_gib") if k in summary}
    return {"sets": sets, "train": train}


def _cell(value) -> str:
    return "" if value is None else f"{value:.2f}"


def tables(variants: dict) -> str:
    """Markdown: one row per variant (tau at k = 3 and 7, or the k measured, per set; T > 0 beside), then
    per set a table of categories by variant."""
    first = next(iter(variants.values()))
    sets = list(first["sets"])
    ks = [k for k in ("3", "7") if k in first["sets"][sets[0]]["tau"]] or list(first["sets"][sets[0]]["tau"])
    temps = sorted({t for v in variants.values() for s in v["sets"].values() for t in s.get("at_temperature", {})})
    head = ["variant", "override"] + [f"{SET_TITLES.get(s, s)} τ@{k}" for s in sets for k in ks]
    head += [f"{SET_TITLES.get(s, s)} τ@{k} T={t}" for t in temps for s in sets for k in ks
             if any(k in v["sets"][s].get("at_temperature", {}).get(t, {}).get("tau", {}) for v in variants.values())]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in variants.items():
        row = [name, ", ".join(f"`{o}`" for o in v.get("override_keys", [])) or "(base)"]
        row += [_cell(v["sets"][s]["tau"].get(k)) for s in sets for k in ks]
        row += [_cell(v["sets"][s].get("at_temperature", {}).get(t, {}).get("tau", {}).get(k))
                for t in temps for s in sets for k in ks
                if any(k in w["sets"][s].get("at_temperature", {}).get(t, {}).get("tau", {})
                       for w in variants.values())]
        lines.append("| " + " | ".join(row) + " |")
    for s in sets:
        cats = sorted({c for v in variants.values() for c in v["sets"][s]["per_category"]})
        lines += ["", f"{SET_TITLES.get(s, s)}, τ@{' / τ@'.join(ks)} per category:", "",
                  "| category | " + " | ".join(variants) + " |", "|" + "---|" * (len(variants) + 1)]
        for c in cats:
            cells = [" / ".join(_cell(v["sets"][s]["per_category"].get(c, {}).get(k)) for k in ks)
                     for v in variants.values()]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def override_keys(override: dict, prefix: str = "") -> list[str]:
    """The dotted keys an override sets (its output_root aside): 'extract.storage_dtype=bf16'."""
    keys = []
    for key, value in override.items():
        if not prefix and key == "output_root":
            continue
        if isinstance(value, dict):
            keys += override_keys(value, f"{prefix}{key}.")
        else:
            shown = value if not isinstance(value, list) or len(value) <= 4 else f"[{len(value)} entries]"
            keys.append(f"{prefix}{key}={json.dumps(shown) if not isinstance(shown, str) else shown}")
    return keys


# ---------------------------------------------------------------- the smoke run's base config
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smoke_base() -> dict:
    """The base config's shape at CPU size: stories260K answering through the tests' fake OpenAI server (one
    greedy and one sampled pass), hidden states from the HF backend, a few training steps, a batched
    evaluation with one sequential question."""
    stories = SHARED / "assets" / "models" / "stories260K"
    if not stories.exists():
        sys.exit(f"--smoke needs {stories} (the shared assets)")
    demo = ROOT / "data" / "demo"
    conversations = {"path": str(demo / "conversations.jsonl"), "max_samples": 8}
    return {
        "output_root": "build",
        "target": {"model": str(stories), "chat_template": str(SMOKE_TEMPLATE)},
        "datasets": [{"name": "demo", **conversations, "regenerate": True},
                     {"name": "demo.s1", **conversations, "regenerate": {"temperature": 0.7, "top_p": 0.95, "seed": 1}}],
        "regenerate": {"backend": "openai", "url": f"http://127.0.0.1:{free_port()}", "max_new_tokens": 16,
                       "concurrency": 4},
        "prepare": {"max_length": 128, "shard_size": 8},
        # the HF backend: the workflow's preflight refuses the vLLM backend where vLLM is not installed
        "extract": {"backend": "hf", "storage_dtype": "fp8", "batch_tokens": 4096, "server_idle_s": 30},
        "vocab": {"draft_vocab_size": 64},
        "train": {"epochs": 1, "max_steps": 2, "batch_tokens": 512, "ttt_steps": 2, "gpus": 0},
        "evaluate": {"sets": [{"name": "demo_heldout", "path": str(demo / "eval_questions.jsonl")}], "k": [1, 3],
                     "max_new_tokens": 8, "max_samples": 2, "sequential_k": [3], "sequential_samples": 1,
                     "reference_batch_size": 4},
    }


# ---------------------------------------------------------------- the run
def plan(args) -> tuple[dict, dict, dict]:
    """Per variant: its override, its merged config (output_root <root>/<name>), the stages it shares."""
    base = smoke_base() if args.smoke else base_config(args.base)
    names = [BASE] + [n for n in args.variants if n != BASE]
    overrides = {n: override_of(n) for n in names}
    configs, shared = {}, {}
    for name in names:
        config = merged(base, overrides[name])
        config["output_root"] = str(args.root / name)
        configs[name], shared[name] = config, shared_stages(base, merged(base, overrides[name]))
    # variants training on the base's hidden states first: --free-hidden can then drop them before the
    # variants that extract their own
    order = sorted(names, key=lambda n: (n != BASE, "hidden" not in shared[n]))
    return {n: overrides[n] for n in order}, {n: configs[n] for n in order}, shared


def free_hidden(done: list[str], remaining: list[str], shared: dict, roots: dict) -> None:
    """Delete each hidden-state folder (its owner's and its links) once no remaining variant trains on it."""
    def owner(name):
        return BASE if name != BASE and "hidden" in shared[name] else name

    for own in {owner(n) for n in done}:
        if any(owner(n) == own for n in remaining):
            continue
        for name in [n for n in done if owner(n) == own]:
            if (roots[name] / "hidden").is_dir():
                shutil.rmtree(roots[name] / "hidden")
                log(f"{name}: deleted its hidden states (--free-hidden; a later run extracts and trains again)")


def run(args, done: Callable[[dict, dict], None] = lambda results, failed: None) -> tuple[dict, dict]:
    """Build every variant; (results, failed): per variant its result, or why its build failed.
    `done(results, failed)` is called after each variant, so what finished is kept if the run is cut off."""
    overrides, configs, shared = plan(args)
    roots = {n: args.workdir / c["output_root"] for n, c in configs.items()}
    paths = {n: args.root / "configs" / f"{n}.yaml" for n in configs}
    for name, config in configs.items():
        write_config(config, args.workdir / paths[name], name,
                     "the smoke base" if args.smoke else " + ".join(p.name for p in args.base))
    if args.configs_only:
        for name in configs:
            links = ", ".join(shared[name]) if name != BASE else "-"
            print(f"make run CONFIG={safe_path(paths[name])}   # (this script links the base's: {links or 'nothing'})")
        return {}, {}
    if args.regeneration_from:
        unpack_regeneration(args.workdir, configs[BASE]["output_root"], args.regeneration_from)
    if args.smoke:  # the fake stands in for `vllm serve` on the same path
        args.serve_regeneration = True
        args.serve_executable, args.serve_args = [sys.executable, str(ROOT / "tests" / "fake_openai_server.py")], []
    if args.parallel > 1:
        return run_parallel(args, overrides, configs, shared, roots, paths, done)
    results, names = {}, list(configs)
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        try:
            built = build_variant(args, name, configs[name], paths[name], roots[name], roots[BASE], shared[name])
        except SystemExit as e:  # make() failed: stop here (the next variants may need what it did not build)
            done(results, {name: str(e)})
            return results, {name: str(e)}
        results[name] = variant_result(name, overrides[name], built, roots[name], configs[name], t0)
        done(results, {})
        if args.free_hidden:
            free_hidden(names[:i + 1], names[i + 1:], shared, roots)
    return results, {}


def variant_result(name: str, override: dict, built: dict, root: Path, config: dict, t0: float) -> dict:
    result = {"override_keys": override_keys(override), **built, **read_reports(root, config),
              "wall_s": round(time.perf_counter() - t0, 1)}
    log(f"{name}: " + ", ".join(f"{s} τ@3 {v['tau'].get('3', 0):.3f}" for s, v in result["sets"].items()))
    return result


def device_groups(parallel: int) -> list[dict]:
    """The environment of each of `parallel` concurrent builds: a share of the host's cores (make's CORES:
    each build's train job takes its run's cores) and of the GPUs where there are at least as many GPUs as
    builds, else all GPUs for every build (they share the devices)."""
    import torch

    cores = {"CORES": str(max(1, len(os.sched_getaffinity(0)) // parallel))}
    count = torch.cuda.device_count()
    if count < parallel:
        return [dict(cores) for _ in range(parallel)]
    per = count // parallel
    return [{**cores, "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in range(i * per, (i + 1) * per))}
            for i in range(parallel)]


def run_parallel(args, overrides: dict, configs: dict, shared: dict, roots: dict, paths: dict,
                 done: Callable[[dict, dict], None]) -> tuple[dict, dict]:
    """The base builds every stage another variant takes from it; then every variant, the base's own rest
    included, builds `args.parallel` at a time (each in its own output root, so Snakemake's locks never meet).
    A variant that fails is reported; the others finish."""
    wanted = set().union(*(shared[n] for n in configs if n != BASE))
    # --until the last of them only: it brings everything upstream (naming an upstream rule too can leave
    # Snakemake "out of jobs ready to be started" before the last ones)
    upstream = set().union(*(upstream_stages(stage) for stage in wanted))
    until = " ".join(STAGE_RULES[stage] for stage in STAGE_RULES if stage in wanted - upstream)
    t0 = time.perf_counter()
    first = build_variant(args, BASE, configs[BASE], paths[BASE], roots[BASE], roots[BASE], shared[BASE],
                          until=until) if until else {"jobs": {}, "until_regenerate_s": 0.0, "run_s": 0.0}
    groups = queue.SimpleQueue()
    for env in device_groups(args.parallel):
        groups.put(env)

    def build(name: str) -> dict:
        env = groups.get()
        try:
            start = time.perf_counter() if name != BASE else t0
            built = build_variant(args, name, configs[name], paths[name], roots[name], roots[BASE], shared[name],
                                  env=env)
            if name == BASE:
                add_jobs(built["jobs"], first["jobs"])
                built["until_regenerate_s"] = first["until_regenerate_s"]
                built["run_s"] = round(built["run_s"] + first["run_s"], 1)
            return variant_result(name, overrides[name], built, roots[name], configs[name], start)
        finally:
            groups.put(env)

    results, failed = {}, {}
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        futures = {pool.submit(build, name): name for name in configs}
        for future in concurrent.futures.as_completed(futures):
            name = futures[future]
            try:
                results[name] = future.result()
            except SystemExit as e:  # make() failed: the others go on
                failed[name] = str(e)
                log(f"{name}: FAILED\n{e}")
            done({n: results[n] for n in configs if n in results}, failed)  # in the variants' order
    return {n: results[n] for n in configs if n in results}, failed


def device_name() -> str:
    import torch
    from results import cpu_device

    return torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_device()


def print_table(path: Path, device: str | None) -> None:
    from results import read_runs

    runs = [r for r in read_runs(path) if device in (None, r["device"])]
    if not runs:
        sys.exit(f"{path}: no run{f' on {device}' if device else ''}")
    for r in runs:
        print(f"\n{r['device']}, {r['date']}, {r['commit']}:\n\n{tables(r['variants'])}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, nargs="+", default=[BASE_CONFIG],
                   help="the base config, or several merged in order as Snakemake merges --configfile (e.g. "
                        "configs/smollm2-gpu.yaml configs/overrides/smollm2-gpu-short.yaml; "
                        "default configs/smollm2-gpu.yaml)")
    p.add_argument("--variants", nargs="+", default=None, help=f"default: all ({' '.join(VARIANTS)}); "
                   f"with --smoke: {' '.join(SMOKE_VARIANTS)}")
    p.add_argument("--root", type=Path, default=None,
                   help="the variants' output roots and configs go under it (relative: to --workdir); "
                        "default build-quality (build-quality-smoke with --smoke)")
    p.add_argument("--workdir", type=Path, default=ROOT, help="where `make run` runs (a workflow checkout)")
    p.add_argument("--serve-regeneration", action="store_true",
                   help="start the regeneration server for the variants that regenerate, stop it before extraction")
    p.add_argument("--serve-executable", nargs="+", default=VLLM_EXECUTABLE, help="argv prefix of `... serve MODEL`")
    p.add_argument("--serve-args", type=shlex.split, default="--gpu-memory-utilization 0.3",
                   help="more arguments of the regeneration server, one quoted string (argparse takes no list of "
                        "words that start with --): '--gpu-memory-utilization 0.3 --max-model-len 4096' "
                        "(default: '%(default)s')")
    p.add_argument("--serve-timeout-s", type=float, default=900)
    p.add_argument("--free-hidden", action="store_true",
                   help="delete hidden states once no remaining variant trains on them (for a disk that holds one set; "
                        "a later run extracts and trains those variants again)")
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="build N variants at once once the base has built what they share (with >= N GPUs each "
                        "gets its own share of them; else they share the GPUs)")
    p.add_argument("--pack-regeneration", type=Path, default=None, metavar="FILE",
                   help="once the base's regeneration is built, write FILE (tar.xz): its split conversations and "
                        "the target's answers with Snakemake's records of them, for --regeneration-from on another "
                        "host")
    p.add_argument("--regeneration-from", type=Path, default=None, metavar="FILE",
                   help="restore a --pack-regeneration tarball (of the same --root) before building: the base then "
                        "regenerates nothing, and no server is needed, where the tarball is current for its config "
                        "(else this stops with the reason)")
    p.add_argument("--configs-only", action="store_true", help="write the variants' configs and print their commands")
    p.add_argument("--smoke", action="store_true", help="CPU: stories260K, the tests' fake regeneration server, two variants")
    p.add_argument("--table", type=Path, default=None, help="print the tables of this results file and exit")
    p.add_argument("--device", default=None, help="with --table: only this device's run")
    p.add_argument("--out", type=Path, default=None,
                   help="results file (bench/results/ format: this run replaces its device's entry)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.table:
        print_table(args.table, args.device)
        return 0
    if args.parallel < 1 or (args.parallel > 1 and args.free_hidden):
        p.error("--parallel N needs N >= 1, and --free-hidden builds one variant at a time (drop one of them)")
    args.variants = args.variants or (SMOKE_VARIANTS if args.smoke else VARIANTS)
    args.root = args.root or Path("build-quality-smoke" if args.smoke else "build-quality")
    args.workdir = args.workdir.resolve()
    args.work = args.workdir / args.root
    args.regeneration_packed = False
    safe_path(args.root)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    t0 = time.perf_counter()

    def results_file(variants: dict, failed: dict) -> dict:
        """<root>/quality.json with the variants finished so far (and those that failed, with why)."""
        result = {"date": started, "base_config": "smoke" if args.smoke else " ".join(map(str, args.base)),
                  "smoke": args.smoke,
                  "wall_s": round(time.perf_counter() - t0, 1), "variants": variants}
        if failed:
            result["failed"] = failed
        write_json_atomic(args.work / "quality.json", result, indent=1)
        return result

    variants, failed = run(args, results_file)
    if not variants and not failed:
        return 0  # --configs-only
    if variants:
        result = results_file(variants, failed)
        if args.out:
            from results import record

            record("quality_smollm2", device_name(), result, args.out)
        print("\n" + tables(variants))
    if failed:
        sys.exit(f"variants failed: {', '.join(failed)} (their logs: {args.work / 'logs'}); "
                 f"finished: {', '.join(variants) or 'none'}" + (f", recorded in {args.out}" if args.out and variants else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

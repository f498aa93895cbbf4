"""Workflow overhead: the project's dry-run at 1,000 and 10,000 shards vs a bare Snakemake workflow
with the same number of jobs, measured side by side; and a no-op `make run` on the default config.

    python bench/workflow_overhead.py --shards 1000 10000 [--repeats 2] [--out bench/results/workflow_overhead.json]

The project's DAG for S shards has 4·S + 4 jobs (split, tokens, extract, vocab_count per shard; vocab,
train, export, evaluate). Two bare workflows with as many jobs, trivial `touch` commands: "bare" is one
`rule all` over one rule; "bare chain" has the project's DAG shape (four chained rules per shard feeding
three aggregate rules), so project / bare-chain is what the project's own logic (config validation, input
functions, scripts) adds to what Snakemake spends on that DAG.
A synthetic dataset with one conversation per shard (shard_size 1) gives S shards without real data.

--ablations also times copies of the project with one directive family stripped at a time (cumulative, so
each row says what that family costs per job): each rule's `run:` block replaced by a realistic `shell:` command
(what a port to shell would print per job), then by `shell: "true"`, then no `log:`; and, on its own, `script` —
every rule as a `script:` job (Snakemake reads every planned script job's source, even in a dry-run).
--job-start times an executed job as `script:`, as a spawned `run:` job, and as `run:` under
--force-use-threads with a child process (what the rules do). They are measurements, not options: the
project keeps every directive.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from workflow_util import copy_workflow  # noqa: E402

BARE = """
N = int(config["njobs"])
rule all:
    input: expand("out/{i}.txt", i=range(N))
rule one:
    output: "out/{i}.txt"
    shell: "echo {wildcards.i} > {output}"
"""

BARE_CHAIN = """
S = int(config["shards"])
rule all:
    input: "eval.txt"
rule split:
    output: "data/{i}.jsonl"
    shell: "touch {output}"
rule tokens:
    input: "data/{i}.jsonl"
    output: "tokens/{i}.st"
    shell: "touch {output}"
rule extract:
    input: "tokens/{i}.st"
    output: "hidden/{i}.st"
    shell: "touch {output}"
rule vocab_count:
    input: "tokens/{i}.st"
    output: "counts/{i}.st"
    shell: "touch {output}"
rule vocab:
    input: expand("counts/{i}.st", i=range(S))
    output: "mapping.st"
    shell: "touch {output}"
rule train:
    input: expand("hidden/{i}.st", i=range(S)), "mapping.st"
    output: "draft.st"
    shell: "touch {output}"
rule export:
    input: "draft.st"
    output: "export.txt"
    shell: "touch {output}"
rule evaluate:
    input: "export.txt"
    output: "eval.txt"
    shell: "touch {output}"
"""


def timed(cmd: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


BODY = r'run:\n\s+shell\(\s*stage_command\(\s*"(\w+)",[^)]*\)\s*\)'  # each rule's run: block


def _script(text: str) -> str:  # not cumulative: every rule as a `script:` job
    return re.sub(BODY, 'script: "../scripts/\\1.py"', text)


def _shell_command(text: str) -> str:
    return re.sub(BODY, 'shell: "{PY} -m eagle3build.\\1 '
                  '--input {input:q} --output {output:q} --params {params.version:q} --log {log:q}"', text)


def _shell_true(text: str) -> str:
    return re.sub(BODY, 'shell: "true"', text)


def _no_log(text: str) -> str:
    return re.sub(r" +log:\n +[^\n]+\n", "", _shell_true(text))


ABLATIONS = {"script": _script, "shell_command": _shell_command, "shell_true": _shell_true, "no_log": _no_log}


def project_dry_run(work: Path, shards: int, model: str, template: str | None, quiet: list[str],
                    ablation: str | None = None) -> tuple[float, int]:
    wd = copy_workflow(work / f"project-{shards}-{ablation}")
    if ablation:
        for smk in (wd / "rules").glob("*.smk"):
            smk.write_text(ABLATIONS[ablation](smk.read_text()))
        rules = "".join(smk.read_text() for smk in (wd / "rules").glob("*.smk") if smk.name != "common.smk")
        stripped = {"stage_command(": True, "log:": ablation == "no_log"}
        left = [directive for directive, gone in stripped.items() if gone and directive in rules]
        assert not left, f"ablation {ablation} left {left} in the rules: update ABLATIONS to the rules' text"
        if ablation == "shell_command":
            snakefile = wd / "Snakefile"
            snakefile.write_text(snakefile.read_text().replace('include: "rules/common.smk"\n',
                                                               'include: "rules/common.smk"\nPY = sys.executable\n'))
    line = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    (wd / "data.jsonl").write_text((line + "\n") * shards)
    cfg = {"target": {"model": model, "chat_template": template}, "datasets": [{"name": "synthetic", "path": "data.jsonl"}],
           "prepare": {"shard_size": 1}, "evaluate": {"sets": [{"name": "q", "path": "data.jsonl"}]}}
    (wd / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "snakemake", "--configfile", "cfg.yaml", "--cores", "2", "-n", *quiet, "all",
           "--resources", "gpu=1"]
    timed(cmd, wd)  # warm: record-count cache, __pycache__
    return timed(cmd, wd), 4 * shards + 4


def snakefile_dry_run(wd: Path, snakefile: str, config: str, quiet: list[str]) -> float:
    """Dry-run time of a bare workflow in `wd` (timed after one warm-up run)."""
    wd.mkdir()
    (wd / "Snakefile").write_text(snakefile)
    cmd = [sys.executable, "-m", "snakemake", "--config", config, "--cores", "2", "-n", *quiet, "all"]
    timed(cmd, wd)
    return timed(cmd, wd)


JOB_START = """
rule all:
    input: expand("out/{i}.txt", i=range(int(config["njobs"])))
rule one:
    output: "out/{i}.txt"
    log: "logs/{i}.log"
    params: x=1
"""


def job_start_cost(work: Path, n: int = 8) -> dict:
    """Seconds per executed job of a rule whose body only writes its output: as `script:` (a Python process
    per job); as `run:` (Snakemake runs a run block by spawning a Snakemake process per job, which parses
    the whole workflow again); and as `run:` under --force-use-threads (the block runs in a thread of the
    main process) handing the job to a Python child through `shell()`. Wall time of n jobs one after the
    other, minus a dry-run of the same DAG."""
    child = ("    run:\n        shell(\"{sys.executable} -c 'import sys; open(sys.argv[1], \\\"w\\\").write(\\\"x\\\")' "
             "{output[0]:q}\")\n")
    bodies = {"script": ('    script: "job.py"\n', []),
              "run": ('    run:\n        open(output[0], "w").write("x")\n', []),
              "run_threads_child": (child, ["--force-use-threads"])}
    cost = {}
    for name, (body, flags) in bodies.items():
        wd = work / f"jobstart-{name}"
        wd.mkdir()
        (wd / "Snakefile").write_text("import sys\n" + JOB_START + body)
        (wd / "job.py").write_text('open(snakemake.output[0], "w").write("x")\n')
        base = [sys.executable, "-m", "snakemake", "all", "--cores", "1", "--config", f"njobs={n}", *flags]
        dry = timed([*base, "--dry-run"], wd)
        cost[f"{name}_s_per_job"] = (timed(base, wd) - dry) / n
    return cost


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default=str(ROOT.parent / "shared" / "assets" / "models" / "stories260K"))
    p.add_argument("--template", default=str(ROOT / "tests" / "data" / "chat_template.jinja"))
    p.add_argument("--noop-config", default="config.yaml", help="config for the no-op `make run` timing ('' skips)")
    p.add_argument("--ablations", nargs="*", choices=sorted(ABLATIONS), default=None,
                   help="also time the project with directives stripped (all of them, or those named)")
    p.add_argument("--no-quiet", action="store_true", help="time dry-runs as `make dry-run` runs them, without --quiet")
    p.add_argument("--job-start", action="store_true", help="also time executed jobs: script: vs run: per job")
    p.add_argument("--out", type=Path, default=None,
                   help="results file (bench/results/ format: this run replaces its device's entry)")
    args = p.parse_args()
    quiet = [] if args.no_quiet else ["--quiet"]  # --quiet drops each job's "reason:" line (jobs are printed either way)
    results = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                          f"{subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores",
               "date": date.today().isoformat(), "python": platform.python_version(), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for shards in args.shards:
            proj, bare, chain = [], [], []
            names = () if args.ablations is None else args.ablations or ABLATIONS
            ablated = {name: [] for name in names}
            for r in range(args.repeats):  # interleaved: this VM's speed drifts between runs
                t, jobs = project_dry_run(work / f"r{r}", shards, args.model, args.template, quiet)
                proj.append(t)
                for name, times in ablated.items():
                    times.append(project_dry_run(work / f"r{r}", shards, args.model, args.template, quiet, name)[0])
                bare.append(snakefile_dry_run(work / f"r{r}" / f"bare-{jobs}", BARE, f"njobs={jobs - 1}", quiet))
                chain.append(snakefile_dry_run(work / f"r{r}" / f"chain-{shards}", BARE_CHAIN, f"shards={shards}", quiet))
            row = {"shards": shards, "jobs": jobs, "project_s": min(proj), "bare_s": min(bare),
                   "bare_chain_s": min(chain), "ratio": min(proj) / min(bare),
                   "ratio_vs_bare_chain": min(proj) / min(chain)}
            for name, times in ablated.items():
                row[f"{name}_s"], row[f"{name}_ratio"] = min(times), min(times) / min(bare)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            for r in range(args.repeats):
                shutil.rmtree(work / f"r{r}", ignore_errors=True)
    if args.job_start:
        with tempfile.TemporaryDirectory() as tmp:
            results["job_start"] = job_start_cost(Path(tmp))
        print(json.dumps({"job_start": results["job_start"]}), flush=True)
    if args.noop_config and (ROOT / "build" / "export").exists():
        cmd = ["make", "-s", "run", f"CONFIG={args.noop_config}"]
        timed(cmd, ROOT)
        results["noop_make_run_s"] = min(timed(cmd, ROOT) for _ in range(args.repeats))
        print(json.dumps({"noop_make_run_s": results["noop_make_run_s"]}))
    if args.out:
        from results import cpu_device, record

        record("workflow_overhead", cpu_device(), results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

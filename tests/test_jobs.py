"""The hand-off of a rule's job to its script (eagle3build/jobs.py): what the script sees, a command safe for any path."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

from snakemake.iocontainers import InputFiles, Namedlist, OutputFiles, Params, Wildcards

from eagle3build.jobs import Job, job_command

ROOT = Path(__file__).resolve().parents[1]


def test_job_round_trips_named_files_params_and_wildcards(tmp_path):
    log_dir = tmp_path / "odd {dir} with 'quotes' and spaces"
    inp = InputFiles(fromdict={"hidden": ["h/0.st", "h/1.st"], "mapping": "v/map.st"})
    out = OutputFiles(fromdict={"weights": "t/w.st"})
    params = Params(fromdict={"target": {"path": "m", "revision": None}, "lr": 1e-3, "ids": [2, 15, 27]})
    log = Namedlist([str(log_dir / "train.log")])
    wc = Wildcards(fromdict={"ds": "alpaca", "shard": "00003"})
    command = job_command("train", inp, out, params, log, wc, {"train": {"gpus": 0}}, "/repo dir", in_container=False)
    # shell() formats the command once more: the doubled braces come back as the path's own.
    argv = shlex.split(command.format())
    assert argv[:2] == [sys.executable, "/repo dir/scripts/train.py"] and len(argv) == 3
    spec = argv[-1]
    assert spec == str(log_dir / "train.job.json")
    job = Job(json.loads(open(spec).read()))
    assert job.rule == "train" and len(job.input) == 2  # (a real job's lists come flattened, named by range)
    assert job.input.hidden == ["h/0.st", "h/1.st"] and job.input.mapping == "v/map.st"
    assert job.output.weights == "t/w.st" and job.params.target == {"path": "m", "revision": None}
    assert job.params.ids == [2, 15, 27] and job.wildcards.shard == "00003" and job.config == {"train": {"gpus": 0}}
    assert job.log == [str(log_dir / "train.log")]
    assert job_command("train", inp, out, params, log, wc, {}, "/r", in_container=True).startswith("python3 /r/scripts/")


def test_every_rule_hands_its_job_to_its_script():
    rules = "".join(p.read_text() for p in (ROOT / "rules").glob("*.smk"))
    declared = set(re.findall(r"^rule (\w+):", rules, re.M))
    declared |= set(re.findall(r'^\s+name:\s+f"(\w+)_\{', rules, re.M))  # a rule per dataset: split_<i> runs split
    assert "split" in declared and "tokens" in declared, declared
    handed = set(re.findall(r'stage_command\(\s*"(\w+)"', rules))
    assert handed == declared and all((ROOT / "scripts" / f"{r}.py").exists() for r in declared)

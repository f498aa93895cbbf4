"""The hand-off of a rule's job (eagle3build/jobs.py): what the child sees, and a command safe for any path."""

from __future__ import annotations

import json
import shlex

from snakemake.iocontainers import InputFiles, Namedlist, OutputFiles, Params, Wildcards

from eagle3build.jobs import BODIES, Job, job_command


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
    assert argv[0] == "PYTHONPATH=/repo dir${PYTHONPATH:+:$PYTHONPATH}" and argv[-3:-1] == ["-m", "eagle3build.jobs"]
    spec = argv[-1]
    assert spec == str(log_dir / "train.job.json")
    job = Job(json.loads(open(spec).read()))
    assert job.rule == "train" and len(job.input) == 2  # (a real job's lists come flattened, named by range)
    assert job.input.hidden == ["h/0.st", "h/1.st"] and job.input.mapping == "v/map.st"
    assert job.output.weights == "t/w.st" and job.params.target == {"path": "m", "revision": None}
    assert job.params.ids == [2, 15, 27] and job.wildcards.shard == "00003" and job.config == {"train": {"gpus": 0}}
    assert job.log == [str(log_dir / "train.log")]
    assert "python3 -m" in job_command("train", inp, out, params, log, wc, {}, "/r", in_container=True)


def test_every_rule_has_a_body():
    rules = {"split", "regenerate", "tokens", "extract", "vocab_count", "vocab", "train", "export", "evaluate"}
    assert set(BODIES) == rules

"""How a rule's job reaches its script (`scripts/<rule>.py`, the rule's body) in a fresh process.

Each rule's `run:` block is one call, `shell(stage_command(rule, input, output, params, log, wildcards, ...))`:
`job_command` writes the job (its files, params, wildcards and the config) as JSON next to its log and
returns the command `python scripts/<rule>.py <that file>`; the script reads it back with `run_job` (torch and
the models never load into Snakemake's own process). `shell()` makes it a job of Snakemake's like any shell
command: logged, killed with the run, run inside the job's container under `--sdm apptainer`; config strings
reach the script through the file, never through the shell.

Why not `script:`: Snakemake reads the source of every planned `script:` job even in a dry-run, so a
dry-run's time grows with the jobs it plans; a `run:` block is not read until it runs (BENCHMARKS.md
measures the dry-run). The profiles set `force-use-threads`, so a `run:` block runs in a thread of
Snakemake's process instead of starting a new Snakemake process per job.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from eagle3build.atomic import write_json_atomic
from eagle3build.cli import run_rule


def _named(items) -> dict:
    """A Snakemake Namedlist as JSON: its items in order and its names (a name's value: a string or a list)."""
    return {"items": [str(x) if isinstance(x, os.PathLike | str) else x for x in items],
            "names": {name: value if not isinstance(value, os.PathLike) else str(value) for name, value in items.items()}}


def job_command(rule: str, input, output, params, log, wildcards, config: dict, basedir: str,
                in_container: bool = False, run_dir: str | None = None) -> str:
    """Write the job next to its log; return the command line that runs the rule's script on it (for `shell()`).

    `run_dir`: the run's folder of server state files and locks (never an output), handed over so that no
    script rebuilds the workflow's layout from the config."""
    spec = Path(str(log[0])).with_suffix(".job.json")
    spec.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(spec, {"rule": rule, "input": _named(input), "output": _named(output),
                             "params": _named(params), "log": [str(x) for x in log],
                             "wildcards": dict(wildcards.items()), "config": config, "run_dir": run_dir},
                      indent=1)
    # Inside the job's container the host's interpreter path means nothing; its `python3` runs the job.
    python = "python3" if in_container else sys.executable
    script = Path(basedir) / "scripts" / f"{rule}.py"
    command = f"{shlex.quote(python)} {shlex.quote(str(script))} {shlex.quote(str(spec))}"
    return command.replace("{", "{{").replace("}", "}}")  # shell() formats its command once more


class Named(list):
    """The script's view of a Namedlist: a list whose named entries are attributes too."""

    def __init__(self, spec: dict):
        super().__init__(spec["items"])
        self._names = spec["names"]

    def __getattr__(self, name: str):
        try:
            return self.__dict__["_names"][name]
        except KeyError:
            raise AttributeError(name) from None


class Job:
    """What a rule's script reads: input, output, params, log, wildcards, config, the run's folder."""

    def __init__(self, spec: dict):
        self.rule = spec["rule"]
        self.input, self.output, self.params = Named(spec["input"]), Named(spec["output"]), Named(spec["params"])
        self.log = list(spec["log"])
        self.wildcards = Named({"items": list(spec["wildcards"].values()), "names": spec["wildcards"]})
        self.config = spec["config"]
        self.run_dir = spec.get("run_dir")


def run_job(body: Callable[[Job], None], argv: list[str] | None = None) -> None:
    """A rule's script: run `body` on the job whose file the command line names (see `job_command`)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit(f"usage: python {sys.argv[0]} <job.json>   (the command a rule's run: block builds)")
    from eagle3build.engine.process import bind_to_workflow

    # A job killed with its workflow (or on its own) removes its temp files; none outlives the workflow.
    bind_to_workflow()
    run_rule(Job(json.loads(Path(argv[0]).read_text())), body)

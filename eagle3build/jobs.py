"""The body of every rule, and how a rule's job reaches it.

Each rule's `run:` block is one line, `shell(stage_command(rule, input, output, params, log, wildcards, ...))`:
`job_command` writes the job (its files, params, wildcards and the config) as JSON next to its log and
returns the command that runs `python -m eagle3build.jobs <that file>`, which calls the rule's body below
in a fresh process (torch and the models never load into Snakemake's own process). `shell()` makes it a
job of Snakemake's like any shell command: logged, killed with the run, run inside the job's container
under `--sdm apptainer`; config strings reach the child through the file, never through the shell.

Why not `script:`: Snakemake reads the source of every planned `script:` job even in a dry-run, which made
`make dry-run` 1.4–1.5× a bare workflow with as many jobs; a `run:` block is not read until it runs
(BENCHMARKS.md §4). The profiles set `force-use-threads`, so a `run:` block runs in a thread of Snakemake's
process instead of a new Snakemake process per job (2.4 s per job otherwise; 0.17 s this way).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from .atomic import write_json_atomic
from .cli import run_rule


# ---------------------------------------------------------------- the hand-off
def _named(items) -> dict:
    """A Snakemake Namedlist as JSON: its items in order and its names (a name's value: a string or a list)."""
    return {"items": [str(x) if isinstance(x, os.PathLike | str) else x for x in items],
            "names": {name: value if not isinstance(value, os.PathLike) else str(value) for name, value in items.items()}}


def job_command(rule: str, input, output, params, log, wildcards, config: dict, basedir: str,
                in_container: bool = False) -> str:
    """Write the job next to its log; return the command line that runs its body (for `shell()`)."""
    spec = Path(str(log[0])).with_suffix(".job.json")
    spec.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(spec, {"rule": rule, "input": _named(input), "output": _named(output),
                             "params": _named(params), "log": [str(x) for x in log],
                             "wildcards": dict(wildcards.items()), "config": config}, indent=1)
    # Inside the job's container the host's interpreter path means nothing; its `python3` runs the job.
    python = "python3" if in_container else sys.executable
    command = (f"PYTHONPATH={shlex.quote(str(basedir))}${{PYTHONPATH:+:$PYTHONPATH}} "
               f"{shlex.quote(python)} -m eagle3build.jobs {shlex.quote(str(spec))}")
    return command.replace("{", "{{").replace("}", "}}")  # shell() formats its command once more


class Named(list):
    """The child's view of a Namedlist: a list whose named entries are attributes too."""

    def __init__(self, spec: dict):
        super().__init__(spec["items"])
        self._names = spec["names"]

    def __getattr__(self, name: str):
        try:
            return self.__dict__["_names"][name]
        except KeyError:
            raise AttributeError(name) from None


class Job:
    """What a rule's body reads: input, output, params, log, wildcards, config."""

    def __init__(self, spec: dict):
        self.rule = spec["rule"]
        self.input, self.output, self.params = Named(spec["input"]), Named(spec["output"]), Named(spec["params"])
        self.log = list(spec["log"])
        self.wildcards = Named({"items": list(spec["wildcards"].values()), "names": spec["wildcards"]})
        self.config = spec["config"]


# ---------------------------------------------------------------- the rules' bodies
def split(job: Job) -> None:
    from .prepare import split_dataset

    ds = job.params.dataset
    print(split_dataset(ds["path"], ds["format"], list(job.output), job.params.shard_size, ds["max_samples"],
                        ds["split"], ds["name"], first_shard=int(job.wildcards.shard),
                        total_shards=job.params.shards))


def regenerate(job: Job) -> None:
    from .regenerate import regenerate_shard

    # Runtime knobs (endpoint, concurrency, retries, timeouts, batch size) from config: they do not
    # change what is generated, so they are not params and changing them reruns nothing.
    params = {**job.config["regenerate"], **job.params.sampling}
    regenerate_shard(job.input.conversations, job.output.conversations, job.output.report, dict(job.params.target),
                     params)


def tokens(job: Job) -> None:
    from .prepare import tokenize_shard

    tokenize_shard(job.input.conversations, job.output.tokens, job.output.report, dict(job.params.tokenizer),
                   job.params.max_length)


def extract(job: Job) -> None:
    p = job.params
    # Runtime knobs (batch size, devices, server and vLLM engine settings) come from the config, not
    # params: they do not change the stored bytes, so changing them must not re-extract.
    params = {**job.config["extract"], "backend": p.backend, "storage_dtype": p.storage_dtype,
              "aux_layer_ids": list(p.aux_layer_ids), "image": p.image}
    if p.backend == "vllm":
        from .vllm_backend import extract_shard_vllm

        extract_shard_vllm(job.input.tokens, job.output.hidden, {**params, "target": dict(p.target)}, p.run_dir)
        return
    from .extract import extract_shard, pending_token_shards

    out_root = os.path.dirname(os.path.dirname(os.path.dirname(job.output.hidden)))
    print(extract_shard(job.input.tokens, job.output.hidden, dict(p.target), params, p.run_dir,
                        pending_tokens=pending_token_shards(out_root, job.input.tokens)))


def vocab_count(job: Job) -> None:
    from .vocab import count_shard

    count_shard(job.input.tokens, job.output.counts, job.params.vocab_size)


def vocab(job: Job) -> None:
    from .vocab import build_mapping

    print(build_mapping(list(job.input.counts), job.output.mapping, job.output.report, job.params.draft_vocab_size,
                        job.params.vocab_size))


def train(job: Job) -> None:
    from .launch import launch

    launch(hidden_paths=list(job.input.hidden), mapping_path=job.input.mapping, target=dict(job.params.target),
           out_dir=os.path.dirname(job.output.weights), state_dir=job.params.state_dir, params=dict(job.params.train))


def export(job: Job) -> None:
    from .export import export as write_export

    write_export(job.input.weights, job.input.mapping, job.params.target["path"], job.params.out_dir,
                 dict(job.params.export))


def evaluate(job: Job) -> None:
    from .evaluate import evaluate as run_eval

    run_eval(os.path.dirname(job.input.draft), dict(job.params.target), [dict(job.params.eval_set)],
             job.output.metrics, job.output.plot, dict(job.params.settings))


BODIES: dict[str, Callable[[Job], None]] = {f.__name__: f for f in (
    split, regenerate, tokens, extract, vocab_count, vocab, train, export, evaluate)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m eagle3build.jobs <job.json>   (written by a rule's run: block)", file=sys.stderr)
        return 2
    job = Job(json.loads(Path(argv[0]).read_text()))
    run_rule(job, BODIES[job.rule])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""split rule: normalize one shard's range of a dataset into conversation JSONL."""
import os
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3build.jobs import run_job  # noqa: E402


def split(job):
    from eagle3build.data.prepare import split_dataset

    ds = job.params.dataset
    report = split_dataset(ds["path"], ds["format"], list(job.output), job.params.shard_size, ds["max_samples"],
                           ds["split"], ds["name"], first_shard=int(job.wildcards.shard),
                           total_shards=job.params.shards, revision=ds.get("revision"))
    print(report)


run_job(split)  # the job a rule's run: block handed over (eagle3build/jobs.py)

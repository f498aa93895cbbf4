"""split rule: normalize one shard's range of a dataset into conversation JSONL."""
import os
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3build.jobs import run_job  # noqa: E402


def split(job):
    from eagle3build.data.prepare import split_dataset
    from eagle3build.shardplan import plan_shards, record_count

    ds = job.params.dataset
    # The shard count as planned now (the cached count): the `shards` param is the count the tree was first
    # built with, or a shard's content digest (rules/common.smk).
    count = record_count(ds["path"], ds["format"], ds["split"], f"{job.config['output_root'].rstrip('/')}/.cache",
                         revision=ds.get("revision"))
    report = split_dataset(ds["path"], ds["format"], list(job.output), job.params.shard_size, ds["max_samples"],
                           ds["split"], ds["name"], first_shard=int(job.wildcards.shard),
                           total_shards=plan_shards(count, job.params.shard_size, ds["max_samples"]),
                           revision=ds.get("revision"))
    print(report)


run_job(split)  # the job a rule's run: block handed over (eagle3build/jobs.py)

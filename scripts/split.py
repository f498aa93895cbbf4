"""split rule: normalize one shard's range of a dataset into conversation JSONL."""
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, snakemake.scriptdir + "/..")  # noqa: F821
from eagle3build.cli import run_rule  # noqa: E402


def split(sm):
    from eagle3build.prepare import split_dataset

    ds = sm.params.dataset
    report = split_dataset(ds["path"], ds["format"], list(sm.output), sm.params.shard_size, ds["max_samples"],
                           ds["split"], ds["name"], first_shard=int(sm.wildcards.shard),
                           total_shards=sm.params.shards)
    print(report)


run_rule(snakemake, split)  # noqa: F821 (injected by Snakemake)

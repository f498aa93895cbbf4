"""vocab_count rule: loss-masked token counts of one shard."""
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, snakemake.scriptdir + "/..")  # noqa: F821
from eagle3build.cli import run_rule  # noqa: E402


def count(sm):
    from eagle3build.vocab import count_shard

    count_shard(sm.input.tokens, sm.output.counts, sm.params.vocab_size)


run_rule(snakemake, count)  # noqa: F821 (injected by Snakemake)

"""vocab_count rule: loss-masked token counts of one shard."""
from eagle3build.cli import run_rule


def count(sm):
    from eagle3build.vocab import count_shard

    count_shard(sm.input.tokens, sm.output.counts, sm.params.vocab_size)


run_rule(snakemake, count)  # noqa: F821 (injected by Snakemake)

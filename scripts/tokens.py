"""tokens rule: chat template + assistant-only loss mask for one shard."""
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, snakemake.scriptdir + "/..")  # noqa: F821
from eagle3build.cli import run_rule  # noqa: E402


def tokens(sm):
    from eagle3build.prepare import tokenize_shard

    tokenize_shard(sm.input.conversations, sm.output.tokens, sm.output.report, dict(sm.params.tokenizer),
                   sm.params.max_length)


run_rule(snakemake, tokens)  # noqa: F821 (injected by Snakemake)

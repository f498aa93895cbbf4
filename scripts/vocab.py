"""vocab rule: merge counts, keep the top K ids, write d2t/t2d and the coverage report."""
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, snakemake.scriptdir + "/..")  # noqa: F821
from eagle3build.cli import run_rule  # noqa: E402


def vocab(sm):
    from eagle3build.vocab import build_mapping

    report = build_mapping(list(sm.input.counts), sm.output.mapping, sm.output.report, sm.params.draft_vocab_size,
                           sm.params.vocab_size)
    print(report)


run_rule(snakemake, vocab)  # noqa: F821 (injected by Snakemake)

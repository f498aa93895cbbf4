"""evaluate rule: acceptance length of the exported draft against the target on one question set."""
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, snakemake.scriptdir + "/..")  # noqa: F821
from eagle3build.cli import run_rule  # noqa: E402


def evaluate(sm):
    import os

    from eagle3build.evaluate import evaluate as run_eval

    run_eval(os.path.dirname(sm.input.draft), dict(sm.params.target), [dict(sm.params.eval_set)], sm.output.metrics,
             sm.output.plot, dict(sm.params.settings))


run_rule(snakemake, evaluate)  # noqa: F821 (injected by Snakemake)

"""train rule: the draft head; several GPUs go through torchrun (DDP) inside this one job."""
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, snakemake.scriptdir + "/..")  # noqa: F821
from eagle3build.cli import run_rule  # noqa: E402


def train(sm):
    import os

    from eagle3build.launch import launch

    launch(hidden_paths=list(sm.input.hidden), mapping_path=sm.input.mapping, target=dict(sm.params.target),
           out_dir=os.path.dirname(sm.output.weights), state_dir=sm.params.state_dir, params=dict(sm.params.train))


run_rule(snakemake, train)  # noqa: F821 (injected by Snakemake)

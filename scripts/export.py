"""export rule: write the EAGLE-3 checkpoint (and optionally the speculators one)."""
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, snakemake.scriptdir + "/..")  # noqa: F821
from eagle3build.cli import run_rule  # noqa: E402


def export(sm):
    from eagle3build.export import export as write_export

    write_export(sm.input.weights, sm.input.mapping, sm.params.target["path"], sm.params.out_dir, dict(sm.params.export))


run_rule(snakemake, export)  # noqa: F821 (injected by Snakemake)

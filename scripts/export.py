"""export rule: write the EAGLE-3 checkpoint (and optionally the speculators one)."""
from eagle3build.cli import run_rule


def export(sm):
    from eagle3build.export import export as write_export

    write_export(sm.input.weights, sm.input.mapping, sm.params.target["path"], sm.params.out_dir, dict(sm.params.export))


run_rule(snakemake, export)  # noqa: F821 (injected by Snakemake)

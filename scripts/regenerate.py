"""regenerate rule: the target writes every assistant turn of one conversation shard."""
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, snakemake.scriptdir + "/..")  # noqa: F821
from eagle3build.cli import run_rule  # noqa: E402


def regenerate(sm):
    from eagle3build.regenerate import regenerate_shard

    # Runtime knobs (endpoint, concurrency, retries, timeouts, batch size) from config: they do not
    # change what is generated, so they are not params and changing them reruns nothing.
    params = {**sm.config["regenerate"], **sm.params.sampling}
    regenerate_shard(sm.input.conversations, sm.output.conversations, sm.output.report, dict(sm.params.target), params)


run_rule(snakemake, regenerate)  # noqa: F821 (injected by Snakemake)

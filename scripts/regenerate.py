"""regenerate rule: the target writes every assistant turn of one conversation shard."""
import os
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3build.jobs import run_job  # noqa: E402


def regenerate(job):
    from eagle3build.data.regenerate import regenerate_shard

    # Runtime knobs (endpoint, concurrency, retries, timeouts, batch size) from config: they do not
    # change what is generated, so they are not params and changing them reruns nothing.
    params = {**job.config["regenerate"], **job.params.sampling}
    regenerate_shard(job.input.conversations, job.output.conversations, job.output.report, dict(job.params.target), params)


run_job(regenerate)  # the job a rule's run: block handed over (eagle3build/jobs.py)

"""export rule: write the EAGLE-3 checkpoint (and optionally the speculators one)."""
import os
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3build.jobs import run_job  # noqa: E402


def export(job):
    from eagle3build.draft.export import export as write_export

    write_export(job.input.weights, job.input.mapping, job.params.target["path"], job.params.out_dir, dict(job.params.export))


run_job(export)  # the job a rule's run: block handed over (eagle3build/jobs.py)

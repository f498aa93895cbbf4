"""evaluate rule: acceptance length of the exported draft against the target on one question set."""
import os
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3build.jobs import run_job  # noqa: E402


def evaluate(job):
    from eagle3build.evaluate.hf import evaluate as run_eval

    run_eval(os.path.dirname(job.input.draft), dict(job.params.target), [dict(job.params.eval_set)], job.output.metrics,
             job.output.plot, dict(job.params.settings))


run_job(evaluate)  # the job a rule's run: block handed over (eagle3build/jobs.py)

"""evaluate rule: acceptance length of the exported draft against the target on one question set."""
import os
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3build.jobs import run_job  # noqa: E402


def evaluate(job):
    from eagle3build.extraction.job import release_devices

    if job.run_dir:  # the run's extraction servers hold GPUs this stage needs
        release_devices(job.run_dir, "evaluate")
    # The device is a runtime knob from config, not a param: changing it reruns nothing.
    settings = {**job.params.settings, "device": job.config["evaluate"]["device"]}
    # The set's place in evaluate.sets names it in errors; not a param (it changes no result).
    eval_set = dict(job.params.eval_set)
    names = [s["name"] for s in job.config["evaluate"]["sets"]]
    if eval_set["name"] in names:
        eval_set["index"] = names.index(eval_set["name"])
    args = (os.path.dirname(job.input.draft), dict(job.params.target), [eval_set], job.output.metrics,
            job.output.plot)
    if settings.get("backend", "hf") == "vllm":
        from eagle3build.evaluate.vllm import evaluate as run_vllm

        # So are the server's sizes, timeouts and environment (rules/evaluate.smk); its logs go beside the
        # job's log.
        settings["vllm"] = {**job.config["evaluate"]["vllm"], **settings["vllm"]}
        run_vllm(*args, settings, log_stem=os.path.splitext(job.log[0])[0])
    else:
        from eagle3build.evaluate.hf import evaluate as run_eval

        run_eval(*args, settings)


run_job(evaluate)  # the job a rule's run: block handed over (eagle3build/jobs.py)

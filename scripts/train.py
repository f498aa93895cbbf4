"""train rule: the draft head; several GPUs go through torchrun (DDP) inside this one job."""
import os
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3build.jobs import run_job  # noqa: E402


def train(job):
    from eagle3build.config import train_progress_keys
    from eagle3build.extraction.job import release_devices
    from eagle3build.train.launch import launch

    if job.run_dir:  # the run's extraction servers hold GPUs this stage needs
        release_devices(job.run_dir, "train")
    # Logging and resume-point knobs are not params (they change no weight, rules/train.smk): from config.
    progress = {k: job.config["train"][k] for k in train_progress_keys(job.config["train"])}
    launch(hidden_paths=list(job.input.hidden), mapping_path=job.input.mapping, target=dict(job.params.target),
           out_dir=os.path.dirname(job.output.weights), state_dir=job.params.state_dir,
           params={**progress, **job.params.train})


run_job(train)  # the job a rule's run: block handed over (eagle3build/jobs.py)

# Config validation, resolved values and small helpers shared by every rule.
import copy
import os
import re
import signal
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)

from snakemake.utils import validate

from eagle3build import FORMAT_VERSIONS
from eagle3build.config import (
    resolve_aux_layer_ids,
    target_config_int,
    target_text_config,
    validate_config,
    vllm_serves_target,
)
from eagle3build.engine.process import WORKFLOW_ENV, workflow_marker
from eagle3build.errors import ConfigError, UserError
from eagle3build.evaluate.settings import sampled_temperatures
from eagle3build.fingerprint import (
    change_since_baseline,
    dataset_fingerprint,
    shard_changes,
    shard_image,
    tokenizer_fingerprint,
    weights_change,
)
from eagle3build.shardplan import plan_shards, record_count, shard_digests
from eagle3build.trust import check_trust

# The config as given, before the schema fills in its defaults: a rule whose params are a section the
# schema defaults key by key passes the keys given, so a default added to the schema reruns nothing.
GIVEN_CONFIG = copy.deepcopy(config)
validate_config(config, validate)
# Before anything reads the target: no repo code may run (also on a dry-run) unless the policy allows it.
check_trust(config["target"])

OUT = config["output_root"].rstrip("/")
RUN_DIR = f"{OUT}/.run"  # servers' state files, locks and logs; never an output
# Names this process to its jobs: a job, and a server the run's jobs share, end when it does
# (eagle3build/engine/process.py). Not a param: it changes every run.
os.environ[WORKFLOW_ENV] = workflow_marker()


# ---- the target as the jobs that load it see it; it reaches them only through params
TARGET = {
    "path": config["target"]["model"],
    "revision": config["target"]["revision"],
    "trust_remote_code": config["target"]["trust_remote_code"],
    "chat_template": config["target"]["chat_template"],
    "dtype": config["target"]["dtype"],
}
TARGET_CFG = target_text_config(TARGET)
VOCAB_SIZE = target_config_int(TARGET, "vocab_size", TARGET_CFG)
# Checked for the engine that captures them (vLLM: distinct ids, no 0 on DeepSeek-family targets).
AUX_LAYER_IDS = resolve_aux_layer_ids(
    TARGET, config["extract"]["aux_layer_ids"], vllm_serves_target(config)
)
# The engine image (tag@digest) this run names: extract.image, else EAGLE3_IMAGE, which the image exports;
# "" where neither is set (a host run). A new image re-extracts (snakemake only hashes containers under
# --sdm apptainer).
IMAGE = config["extract"]["image"] or os.environ.get("EAGLE3_IMAGE", "")


HIDDEN_SHARD = f"{OUT}/hidden/{{ds}}/{{shard}}.safetensors"  # the extract rule's output


def extract_image(wildcards):
    """The extract rule's `image` param. A run that names an image passes it, so a shard made in another image
    (or by a run naming none) is extracted again. A run that names none claims no engine: it takes the image
    the existing shard records in its metadata (written by the job that made it), so hidden states made in
    an image stay current for it (a host dry-run after `make docker-run` plans nothing); a shard it extracts
    itself records "" (`check_image_labels` stops it re-extracting one that records an image).
    """
    # From the wildcards, not `output`: Snakemake does not record a param derived from a job's output.
    return IMAGE or shard_image(
        HIDDEN_SHARD.format(ds=wildcards.ds, shard=wildcards.shard)
    )


def check_image_labels(jobs):
    """Before any job runs (outputs are still there): a run naming no image must not re-extract a shard that
    records one (e.g. after the target's weights changed): the new hidden states would carry the name of an
    engine that did not make them, and a later run in that image would keep them."""
    if IMAGE:
        return
    labelled = sorted(
        (str(job.output.hidden), job.params.image)
        for job in jobs
        if job.rule.name == "extract" and job.params.image
    )
    if labelled:
        shards = "\n".join(f"  {path} (image {image})" for path, image in labelled[:5])
        more = f"\n  and {len(labelled) - 5} more" if len(labelled) > 5 else ""
        raise UserError(
            f"{len(labelled)} hidden shard(s) made in an engine image would be extracted again by this run, "
            f"which names no image (EAGLE3_IMAGE unset, extract.image null):\n{shards}{more}\n"
            "Run it in that image (make docker-run), or name this environment's engine: "
            "EAGLE3_IMAGE=<that image> if it is that engine, another name to re-extract every shard made "
            "elsewhere (or delete those shards: shards extracted by a run naming no image record none)."
        )


# ---- datasets and their shards (counts are known when the DAG is built: the dry-run shows every job)
def _shard_count(ds):
    n = record_count(
        ds["path"],
        ds["format"],
        ds["split"],
        cache_dir=f"{OUT}/.cache",
        revision=ds["revision"],
    )
    return plan_shards(n, config["prepare"]["shard_size"], ds["max_samples"])


REGEN_SAMPLING_KEYS = (
    "backend",
    "model",
    "temperature",
    "top_p",
    "max_new_tokens",
    "seed",
    "drop_truncated",
)


def regen_sampling(ds):
    """A regenerating dataset's settings: `regenerate`'s, with the dataset's own overrides on top."""
    if not ds["regenerate"]:
        return None
    own = ds["regenerate"] if isinstance(ds["regenerate"], dict) else {}
    return {k: own.get(k, config["regenerate"][k]) for k in REGEN_SAMPLING_KEYS}


# ---- what Snakemake cannot see change (eagle3build/fingerprint.py): the target's weights and tokenizer
# files edited in place, a dataset's content. Each is fingerprinted once per DAG build; its digest becomes a
# param of the rules that read it only once it differs from the first one recorded, so a tree built before
# fingerprints existed plans nothing.
FINGERPRINTS = f"{OUT}/.fingerprints"


def _changed(param, digest):
    """A rule's params entry for an input that changed since its baseline: {param: digest}, else nothing."""
    return {param: digest} if digest else {}


TOKENIZER_CHANGE = _changed(
    "tokenizer_files",
    change_since_baseline(
        FINGERPRINTS, "tokenizer", TARGET["path"], tokenizer_fingerprint(TARGET["path"])
    ),
)
WEIGHTS_CHANGE = _changed(
    "target_weights", weights_change(FINGERPRINTS, TARGET["path"], f"{OUT}/.cache")
)


def split_shards_param(ds, count):
    """The split rule's `shards` param: the shard count, as trees built so far recorded it, for every shard
    whose records are the baseline's; {"content": digest} for each shard whose records differ from it (or
    that it lacked). Appending a record re-splits only the shard it lands in (and any new one), so only
    those are tokenized and extracted again. A callable (one lookup per job) only while some shard differs.
    """
    fingerprint = dataset_fingerprint(ds["path"], cache_dir=f"{OUT}/.cache")
    if fingerprint is None:  # an hf: dataset: its revision param pins it
        return count
    shard_size = config["prepare"]["shard_size"]
    base_count, changed = shard_changes(
        FINGERPRINTS,
        ds["path"],
        {"shard_size": shard_size, "max_samples": ds["max_samples"]},
        change_since_baseline(FINGERPRINTS, "dataset", ds["path"], fingerprint)
        is not None,
        count,
        lambda: shard_digests(
            ds["path"],
            ds["format"],
            ds["split"],
            shard_size,
            ds["max_samples"],
            f"{OUT}/.cache",
            ds["revision"],
        ),
    )
    if not changed:
        return base_count
    values = {f"{i:05d}": {"content": d} for i, d in changed.items()}
    return lambda wildcards: values.get(wildcards.shard, base_count)


def dataset_input(path):
    """A dataset's file or folder as an input whose mtime does not count (`ancient`): a touch must not
    re-split (and re-extract) it; its content reaches the split rule through `split_shards_param`.
    """
    return [ancient(p) for p in local_file(path)]


DATASETS = {}
for _i, _ds in enumerate(config["datasets"]):
    if _ds["name"] in DATASETS:
        raise ConfigError(
            f"datasets[{_i}].name",
            f"'{_ds['name']}' is used twice; names must be unique",
        )
    if _ds["revision"] and not str(_ds["path"]).startswith("hf:"):
        raise ConfigError(
            f"datasets[{_i}].revision",
            f"'{_ds['path']}' is a local dataset; only hf: datasets have a hub revision (drop the key)",
        )
    _count = _shard_count(_ds)
    DATASETS[_ds["name"]] = {
        **_ds,
        "index": _i,
        "shards": [f"{s:05d}" for s in range(_count)],
        "regen_sampling": regen_sampling(_ds),
        "split_shards": split_shards_param(_ds, _count),
    }


def shard_paths(stage, ext, datasets=None):
    return [
        f"{OUT}/{stage}/{name}/{shard}.{ext}"
        for name in (datasets or DATASETS)
        for shard in DATASETS[name]["shards"]
    ]


def dataset_names(regenerated):
    """A wildcard constraint: the names of the datasets that regenerate (or of those that do not)."""
    names = [
        re.escape(n)
        for n, ds in DATASETS.items()
        if bool(ds["regenerate"]) == regenerated
    ]
    return "|".join(names) or "(?!)"  # (?!) matches nothing: no dataset of that kind


def local_file(path):
    """Inputs that are files of ours are tracked; hf: ids and hub models are not files."""
    if not path or str(path).startswith("hf:"):
        return []
    # A string no file system takes as a name (e.g. a template's text) is not a file: the job says so.
    try:
        return [path] if Path(path).exists() else []
    except OSError:
        return []


def final_targets():
    targets = [f"{OUT}/vocab/mapping.safetensors", f"{OUT}/export/eagle3/config.json"]
    # The hidden shards too: Snakemake does not remake a missing intermediate while what it feeds is
    # current, so a deleted (e.g. corrupted) shard would stay missing; a missing input of the target
    # rule is remade (then train and what follows rerun on it).
    targets += shard_paths("hidden", "safetensors")
    targets += [f"{OUT}/eval/{name}.json" for name in EVAL_SETS]
    return targets


EVAL_SETS = {s["name"]: s for s in config["evaluate"]["sets"]}


def stage_command(name, input, output, params, log, wildcards, container_img):
    """The command a rule's run: block hands to shell(): the rule's script on its job (eagle3build/jobs.py)."""
    from eagle3build.jobs import job_command

    return job_command(
        name,
        input,
        output,
        params,
        log,
        wildcards,
        config,
        workflow.basedir,
        in_container=bool(container_img),
        run_dir=RUN_DIR,
    )


def stop_extraction_servers():
    from eagle3build.extraction import job as extract
    from eagle3build.extraction import vllm as vllm_backend

    extract.stop_servers(RUN_DIR)
    vllm_backend.stop_servers(RUN_DIR)


def sigterm_as_ctrl_c():
    """SIGTERM (a scheduler, `kill`) stops the run the way Ctrl-C does. Snakemake 9.27's own SIGTERM handler
    takes its scheduler's non-reentrant lock; a signal that lands while the scheduler holds that lock
    deadlocks the process (seen in tests/test_crash_recovery.py's kill matrix). Ctrl-C's path
    (KeyboardInterrupt: running jobs cancelled, the lock released as the exception unwinds) has no such
    window. Installed when jobs start (onstart runs after the scheduler installed its handler).
    """
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def preflight():
    """Before jobs run (not on dry-runs): fail in seconds when the pieces do not fit."""
    from eagle3build.doctor import preflight as check
    from eagle3build.extraction.devices import forget_devices
    from eagle3build.extraction.plan import write_shard_plan

    check(config, "extract", echo=print)
    check_image_labels(workflow.dag.needrun_jobs())
    # Shard jobs look up the GPUs once per run (eagle3build/extraction/devices.py): this run looks again.
    forget_devices(RUN_DIR)
    # The extract jobs' disk check counts every hidden shard of the run not written yet.
    write_shard_plan(
        RUN_DIR,
        shard_paths("tokens", "safetensors"),
        shard_paths("hidden", "safetensors"),
    )


def target_weight_files():
    """The target's safetensors when local (train reads its lm_head and embedding from them). Their mtime
    does not count (`ancient`): a fresh copy of the same weights must not retrain; their content reaches
    the train rule through WEIGHTS_CHANGE."""
    folder = Path(TARGET["path"])
    return (
        [ancient(str(p)) for p in sorted(folder.glob("*.safetensors"))]
        if folder.is_dir()
        else []
    )


# The engine image pinned in docker/base-image (the Dockerfile's base, passed by make docker-build):
# with --sdm apptainer Snakemake runs the jobs in it; EAGLE3_IMAGE or extract.image replace it.
# Only the container gets the pin: a host run names no image (see extract_image).
BASE_IMAGE = Path(workflow.basedir, "docker", "base-image").read_text().strip()


def container_url(image):
    """A docker reference as the URL Apptainer pulls (without a scheme it would be a local file)."""
    return image if "://" in image else f"docker://{image}"


CONTAINER_IMAGE = container_url(IMAGE or BASE_IMAGE)


# ---- evaluation: evaluate.backend picks the decoder (rules/evaluate.smk)
EVAL_VLLM = config["evaluate"]["backend"] == "vllm"
EVAL_SERVER = config["evaluate"]["vllm"]


def evaluate_settings():
    """The evaluate rule's settings param: the hf backend's keys as they always were; vllm adds its own."""
    settings = {
        k: config["evaluate"][k]
        for k in ("k", "max_new_tokens", "max_samples", "sequential_k")
    }
    # sampling keys only when a temperature > 0 is asked: greedy-only configs keep their params (a list
    # without 0 is refused here, before any job runs)
    if sampled_temperatures(config["evaluate"]):
        settings |= {
            k: config["evaluate"][k]
            for k in ("temperatures", "top_p", "seed", "draft_sample_method")
        }
    if config["evaluate"]["sequential_samples"] is not None:
        # batched reference decodes: only configs that ask for them get the keys
        settings |= {
            k: config["evaluate"][k]
            for k in ("sequential_samples", "reference_batch_size")
        }
    if EVAL_VLLM:
        settings["backend"] = "vllm"
        settings["vllm"] = {
            k: EVAL_SERVER[k]
            for k in ("num_speculative_tokens", "baseline", "concurrency")
        }
    return settings

# train: the draft head with training-time test (resumes from train/state after a crash).
# export: the checkpoint vLLM and SGLang load.


def target_weight_files():
    """The target's safetensors are inputs when local, so a changed target retrains."""
    folder = Path(TARGET["path"])
    return sorted(str(p) for p in folder.glob("*.safetensors")) if folder.is_dir() else []


rule train:
    input:
        hidden=shard_paths("hidden", "safetensors"),
        mapping=f"{OUT}/vocab/mapping.safetensors",
        target_weights=target_weight_files(),
    output:
        weights=f"{OUT}/train/draft.safetensors",
        summary=f"{OUT}/train/summary.json",
        metrics=f"{OUT}/train/metrics.jsonl",
    params:
        train=config["train"],
        target={k: TARGET[k] for k in ("path", "revision")},
        state_dir=f"{OUT}/train/state",
        version=FORMAT_VERSIONS["train"],
    resources:
        gpu=max(1, config["train"]["gpus"]),
    log:
        f"{OUT}/logs/train.log",
    script:
        "../scripts/train.py"


rule export:
    input:
        weights=f"{OUT}/train/draft.safetensors",
        mapping=f"{OUT}/vocab/mapping.safetensors",
    output:
        config=f"{OUT}/export/eagle3/config.json",
        weights=f"{OUT}/export/eagle3/model.safetensors",
    params:
        export=config["export"],
        target={k: TARGET[k] for k in ("path", "revision")},
        out_dir=f"{OUT}/export",
        version=FORMAT_VERSIONS["export"],
    log:
        f"{OUT}/logs/export.log",
    script:
        "../scripts/export.py"

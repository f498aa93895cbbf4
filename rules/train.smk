# train: the draft head with training-time test (resumes from train/state after a crash).
# export: the checkpoint vLLM and SGLang load.
from eagle3build.config import train_rule_params
from eagle3build.train.warm_start import head_files


rule train:
    input:
        hidden=shard_paths("hidden", "safetensors"),
        mapping=f"{OUT}/vocab/mapping.safetensors",
        target_weights=target_weight_files(),
        # train.init_from: the head's files, so a changed head retrains (none when unset)
        init_from=head_files(config["train"]["init_from"]),
    output:
        weights=f"{OUT}/train/draft.safetensors",
        summary=f"{OUT}/train/summary.json",
        metrics=f"{OUT}/train/metrics.jsonl",
    log:
        f"{OUT}/logs/train.log",
    # Snakemake sets a job's OMP_NUM_THREADS (torch's host threads) to its threads, 1 unless given: the
    # trainer's host side (reading, packing and pinning the next batch) would then share one core. A cluster
    # job runs with --cores all on its node, so there this is the job's allocation (cpus_per_task).
    threads: workflow.cores
    resources:
        gpu=max(1, config["train"]["gpus"]),
    params:
        **WEIGHTS_CHANGE,  # the target folder's weights (its lm_head and embedding), once edited
        # only what changes the weights: logging and resume-point knobs are read from config by the job
        train={
            **train_rule_params(GIVEN_CONFIG.get("train", {}), config["train"]),
            "gpus": config["train"]["gpus"],
        },
        target={k: TARGET[k] for k in ("path", "revision")},
        state_dir=f"{OUT}/train/state",
        version=FORMAT_VERSIONS["train"],
    run:
        shell(
            stage_command(
                "train", input, output, params, log, wildcards, container_img
            )
        )


rule export:
    input:
        weights=f"{OUT}/train/draft.safetensors",
        mapping=f"{OUT}/vocab/mapping.safetensors",
    output:
        config=f"{OUT}/export/eagle3/config.json",
        weights=f"{OUT}/export/eagle3/model.safetensors",
    log:
        f"{OUT}/logs/export.log",
    params:
        export=config["export"],
        target={k: TARGET[k] for k in ("path", "revision")},
        out_dir=lambda wc, output: os.path.dirname(os.path.dirname(output.config)),
        version=FORMAT_VERSIONS["export"],
    run:
        shell(
            stage_command(
                "export", input, output, params, log, wildcards, container_img
            )
        )

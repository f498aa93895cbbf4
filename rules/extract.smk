# extract: one job per shard stores the target's aux + final hidden states.
# Only what changes the stored bytes is a param (model, revision, layers, dtypes, backend, image,
# format version); batch sizes, devices and server settings are read from config by the script
# because changing them must not redo hours of extraction. The run's list of token and hidden shards, for
# the disk check, reaches the jobs through the run dir (written by `preflight` in rules/common.smk), not as
# a param: it changes with every dataset added, which must not redo the extraction of the others.


rule extract:
    input:
        tokens=f"{OUT}/tokens/{{ds}}/{{shard}}.safetensors",
    output:
        hidden=HIDDEN_SHARD,
    log:
        f"{OUT}/logs/extract/{{ds}}/{{shard}}.log",
    resources:
        gpu=1,
    params:
        **WEIGHTS_CHANGE,  # the target folder's weights, config or modeling code, once edited
        target={
            k: TARGET[k] for k in ("path", "revision", "trust_remote_code", "dtype")
        },
        backend=config["extract"]["backend"],
        storage_dtype=config["extract"]["storage_dtype"],
        aux_layer_ids=AUX_LAYER_IDS,
        image=extract_image,  # this run's image, else the one the shard records
        version=FORMAT_VERSIONS["hidden"],
        run_dir=RUN_DIR,
    run:
        shell(
            stage_command(
                "extract", input, output, params, log, wildcards, container_img
            )
        )

# regenerate: the target rewrites every assistant turn of a dataset that asks for it (on-policy data).


rule regenerate:
    input:
        conversations=f"{OUT}/data/{{ds}}/{{shard}}.jsonl",
        chat_template=local_file(TARGET["chat_template"]),
    output:
        conversations=f"{OUT}/regen/{{ds}}/{{shard}}.jsonl",
        report=f"{OUT}/regen/{{ds}}/{{shard}}.report.json",
    log:
        f"{OUT}/logs/regen/{{ds}}/{{shard}}.log",
    resources:
        gpu=0 if config["regenerate"]["backend"] == "openai" else 1,
    params:
        **TOKENIZER_CHANGE,  # the target folder's tokenizer files and weights, once edited
        **WEIGHTS_CHANGE,
        target=TARGET,
        sampling=lambda wc: DATASETS[wc.ds]["regen_sampling"],  # per dataset: a change reruns only its own
        version=FORMAT_VERSIONS["regenerate"],
    run:
        shell(
            stage_command(
                "regenerate", input, output, params, log, wildcards, container_img
            )
        )

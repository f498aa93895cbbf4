# split: one job per shard normalizes its range of the dataset into JSONL (pattern outputs keep the
# DAG linear in the number of shards; JSONL lines before the range are skipped unparsed).
# tokens: one job per shard applies the chat template and builds the assistant-only loss mask.


rule split:
    input:
        lambda wc: local_file(DATASETS[wc.ds]["path"]),
    output:
        f"{OUT}/data/{{ds}}/{{shard}}.jsonl",
    log:
        f"{OUT}/logs/split/{{ds}}/{{shard}}.log",
    params:
        dataset=lambda wc: {
            k: DATASETS[wc.ds][k]
            for k in ("name", "path", "format", "split", "max_samples")
        },
        shards=lambda wc: len(DATASETS[wc.ds]["shards"]),
        shard_size=config["prepare"]["shard_size"],
        version=FORMAT_VERSIONS["split"],
    run:
        shell(
            stage_command(
                "split", input, output, params, log, wildcards, container_img
            )
        )


rule tokens:
    input:
        conversations=conversations_for,
        chat_template=local_file(TARGET["chat_template"]),
    output:
        tokens=f"{OUT}/tokens/{{ds}}/{{shard}}.safetensors",
        report=f"{OUT}/tokens/{{ds}}/{{shard}}.json",
    log:
        f"{OUT}/logs/tokens/{{ds}}/{{shard}}.log",
    params:
        tokenizer={
            k: TARGET[k]
            for k in ("path", "revision", "trust_remote_code", "chat_template")
        },
        max_length=config["prepare"]["max_length"],
        version=FORMAT_VERSIONS["tokens"],
    run:
        shell(
            stage_command(
                "tokens", input, output, params, log, wildcards, container_img
            )
        )

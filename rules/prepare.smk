# split: one job per dataset reads it once and writes its conversation shards (normalized JSONL).
# tokens: one job per shard applies the chat template and builds the assistant-only loss mask.

for _name, _ds in DATASETS.items():

    rule:
        name:
            f"split_{_ds['index']}"
        input:
            local_file(_ds["path"]),
        output:
            [f"{OUT}/data/{_name}/{s}.jsonl" for s in _ds["shards"]],
        log:
            f"{OUT}/logs/split/{_name}.log",
        params:
            dataset={
                k: _ds[k] for k in ("name", "path", "format", "split", "max_samples")
            },
            shard_size=config["prepare"]["shard_size"],
            version=FORMAT_VERSIONS["split"],
        script:
            "../scripts/split.py"


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
    script:
        "../scripts/tokens.py"

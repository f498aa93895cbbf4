# split: one rule per dataset (split_<i>, i its place in `datasets`), one job per shard: it normalizes its
# range of the dataset into JSONL (pattern outputs keep the DAG linear in the number of shards; JSONL lines
# before the range are skipped unparsed). A rule per dataset hands each job its dataset's file and settings
# as plain values; per-shard input functions cost every job of a 10,000-shard dry-run (BENCHMARKS.md).
# tokens: one job per shard applies the chat template and builds the assistant-only loss mask.

for _ds in DATASETS.values():

    rule:
        name:
            f"split_{_ds['index']}"
        input:
            dataset_input(_ds["path"]),
        output:
            f"{OUT}/data/{_ds['name']}/{{shard}}.jsonl",
        log:
            f"{OUT}/logs/split/{_ds['name']}/{{shard}}.log",
        params:
            dataset={
                **{
                    k: _ds[k]
                    for k in ("name", "path", "format", "split", "max_samples")
                },
                # a pinned hub commit of an hf: dataset: only when set, so other configs keep their params
                **({"revision": _ds["revision"]} if _ds["revision"] else {}),
            },
            # the shard count, or per shard its content digest once its records changed (common.smk)
            shards=_ds["split_shards"],
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
        conversations=f"{OUT}/data/{{ds}}/{{shard}}.jsonl",
        chat_template=local_file(TARGET["chat_template"]),
    output:
        tokens=f"{OUT}/tokens/{{ds}}/{{shard}}.safetensors",
        report=f"{OUT}/tokens/{{ds}}/{{shard}}.json",
    log:
        f"{OUT}/logs/tokens/{{ds}}/{{shard}}.log",
    wildcard_constraints:
        ds=dataset_names(regenerated=False),
    params:
        **TOKENIZER_CHANGE,  # the target folder's tokenizer files, once edited
        # prepare.thinking joins this param only when it is not the default, so configs that do not
        # set it keep their params and a built tree plans nothing.
        tokenizer={
            **{
                k: TARGET[k]
                for k in ("path", "revision", "trust_remote_code", "chat_template")
            },
            **(
                {"thinking": config["prepare"]["thinking"]}
                if config["prepare"]["thinking"] != "served"
                else {}
            ),
        },
        max_length=config["prepare"]["max_length"],
        version=FORMAT_VERSIONS["tokens"],
    run:
        shell(
            stage_command(
                "tokens", input, output, params, log, wildcards, container_img
            )
        )


# A dataset that regenerates is tokenized from the target's answers: the same rule, reading regen/.
# The two are told apart by dataset name (wildcard constraints, matched once per file) rather than by an
# input function that every tokens job would call (BENCHMARKS.md).
use rule tokens as tokens_regenerated with:
    input:
        conversations=f"{OUT}/regen/{{ds}}/{{shard}}.jsonl",
        chat_template=local_file(TARGET["chat_template"]),
    wildcard_constraints:
        ds=dataset_names(regenerated=True),

# vocab_count: loss-masked token counts per shard (independent of K, so a new K only re-merges).
# vocab: merge the counts and keep the top K ids as the draft vocabulary (d2t / t2d).


rule vocab_count:
    input:
        tokens=f"{OUT}/tokens/{{ds}}/{{shard}}.safetensors",
    output:
        counts=f"{OUT}/vocab/counts/{{ds}}/{{shard}}.safetensors",
    log:
        f"{OUT}/logs/vocab_count/{{ds}}/{{shard}}.log",
    params:
        vocab_size=VOCAB_SIZE,
        version=FORMAT_VERSIONS["vocab"],
    run:
        shell(
            stage_command(
                "vocab_count", input, output, params, log, wildcards, container_img
            )
        )


rule vocab:
    input:
        counts=shard_paths("vocab/counts", "safetensors"),
    output:
        mapping=f"{OUT}/vocab/mapping.safetensors",
        report=f"{OUT}/vocab/coverage.json",
    log:
        f"{OUT}/logs/vocab.log",
    params:
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        vocab_size=VOCAB_SIZE,
        version=FORMAT_VERSIONS["vocab"],
    run:
        shell(
            stage_command(
                "vocab", input, output, params, log, wildcards, container_img
            )
        )

# evaluate: chain speculative decoding with the target and the exported draft; acceptance length.


rule evaluate:
    input:
        draft=f"{OUT}/export/eagle3/model.safetensors",
        draft_config=f"{OUT}/export/eagle3/config.json",
        questions=lambda wc: local_file(EVAL_SETS[wc.evalset]["path"]),
        chat_template=local_file(TARGET["chat_template"]),
    output:
        metrics=f"{OUT}/eval/{{evalset}}.json",
        plot=report(
            f"{OUT}/eval/{{evalset}}.png",
            caption="../docs/report/evaluate.rst",
            category="Acceptance length",
        ),
    log:
        f"{OUT}/logs/evaluate/{{evalset}}.log",
    resources:
        gpu=1,
    params:
        target=TARGET,
        eval_set=lambda wc: EVAL_SETS[wc.evalset],
        settings={
            k: config["evaluate"][k]
            for k in ("k", "max_new_tokens", "max_samples", "sequential_k")
        },
        version=FORMAT_VERSIONS["evaluate"],
    run:
        shell(
            stage_command(
                "evaluate", input, output, params, log, wildcards, container_img
            )
        )

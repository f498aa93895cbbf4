# evaluate: chain speculative decoding with the target and the exported draft; acceptance length.
# evaluate.backend picks the decoder: hf (the HF target's loop, eagle3build/evaluate/hf.py) or vllm (the
# target served by vLLM with the draft, eagle3build/evaluate/vllm.py). The hf backend's params are what they
# always were; the vllm backend adds its own. Server sizes, timeouts and the environment change no result:
# the script reads them from config.
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
        gpu=(
            EVAL_SERVER["tensor_parallel_size"] * EVAL_SERVER["data_parallel_size"]
            if EVAL_VLLM
            else 1
        ),
    params:
        **TOKENIZER_CHANGE,  # the target folder's tokenizer files and weights, once edited
        **WEIGHTS_CHANGE,
        target=TARGET,
        eval_set=lambda wc: EVAL_SETS[wc.evalset],
        settings=evaluate_settings(),
        version=FORMAT_VERSIONS["evaluate"],
    run:
        shell(
            stage_command(
                "evaluate", input, output, params, log, wildcards, container_img
            )
        )

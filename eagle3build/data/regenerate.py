"""On-policy data: the target model writes every assistant turn of a conversation shard.

The user turns of each conversation are replayed in order; after each one the target answers, and that
answer (not the dataset's) is the context for the next user turn. System prompt and tools are kept,
the dataset's assistant answers are discarded. Training the draft on the target's own outputs is what
every EAGLE-3 anchor recommends (speculators' ablation: step-0 accuracy 0.280 -> 0.405).

Two backends:
- "hf": transformers batched `generate` (left padding; GPU in bf16 when there is one, else CPU fp32).
- "openai": an OpenAI-compatible server (`vllm serve`, SGLang) queried concurrently, with retries,
  timeouts and resume.
Both backends append every finished turn to `out_path + ".partial.jsonl"` (finished conversations, and the
context of unfinished ones), so a killed job restarts at the first turn it had not finished.

Thinking: the reasoning a target writes is kept on its assistant message as `reasoning_content` (the
field chat templates read): the openai backend takes what the server's reasoning parser returns
(`reasoning_content`, or `reasoning` as vLLM now names it); the hf backend splits the generated text
at the tokenizer's </think> token when it has <think>/</think> tokens (Kimi-style templates). Which
reasoning is trained is the tokens stage's choice (prepare.thinking).

Tool calls (eagle3build/data/replay.py): when the target's answer calls the tools the dataset's turn
called (by position and name), the dataset's tool results are replayed and the target continues;
otherwise the conversation stops at that call (counted as `stopped_at_tool_call`). The openai backend
gets the calls from the server's tool parser; the hf backend has none (calls stay text in the answer), nor
has a server started without one (engine/openai.py then asks with tool_choice "none"). Tool definitions
are sent, rendered and written in the one form of eagle3build/data/tools.py; a sample whose definitions
cannot be put in that form fails on its own (counted, named in the report), before any request.
A conversation whose generation fails is dropped from the output and counted, never kept with its old
answers.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from eagle3build import FORMAT_VERSIONS
from eagle3build.atomic import atomic_path, write_json_atomic
from eagle3build.config import resolve_section
from eagle3build.data.chat import load_target_tokenizer
from eagle3build.data.formats import iter_jsonl
from eagle3build.data.replay import PartialFile, Replay
from eagle3build.data.tools import ToolError, openai_tools, template_messages
from eagle3build.errors import ConfigError, UserError
from eagle3build.hf_target import eos_token_ids, load_target_model, resolve_device, target_path

# ---------------------------------------------------------------------------------------------------
# Backends: each yields (index, result dict) or (index, Exception) as conversations finish


class HFBackend:
    """Batched `generate`, one round per turn: round r answers the r-th user turn of every conversation.

    Each round's prompts are sorted by length and cut into batches of at most `batch_size` rows and
    `batch_tokens` padded tokens (rows x (longest prompt + max_new_tokens), which bounds the KV cache).
    `generate` costs about the same per decode step whatever the batch (host-bound for small targets), so
    the number of `generate` calls sets the time: a shard takes as many rounds as its longest
    conversation has turns, not that many per batch.
    """

    def __init__(self, target: dict, params: dict):
        import torch

        self.torch = torch
        self.params = params
        self.device = resolve_device(params["device"])
        self.tokenizer = load_target_tokenizer(target)
        self.tokenizer.padding_side = "left"
        self.model = load_target_model(target, self.device)
        self.eos = eos_token_ids(self.model, self.tokenizer)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token_id = self.eos[0]  # masked by the attention mask; never read
        self.model_name = target_path(target)
        self.think = self.think_tokens()

    def generation_config(self):
        from transformers import GenerationConfig

        sampling = self.params["temperature"] > 0
        return GenerationConfig(
            max_new_tokens=int(self.params["max_new_tokens"]),
            do_sample=sampling,
            temperature=float(self.params["temperature"]) if sampling else None,
            top_p=float(self.params["top_p"]) if sampling else None,
            eos_token_id=self.eos,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    @property
    def description(self) -> str:
        return self.model_name

    def encode(self, messages: list[dict], tools: list | None) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            template_messages(messages), tools=tools, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def batches(self, lengths: list[int]) -> list[list[int]]:
        """Positions into `lengths`, shortest first, cut by `batch_size` rows and `batch_tokens` padded tokens."""
        max_rows, max_tokens = int(self.params["batch_size"]), int(self.params["batch_tokens"])
        new = int(self.params["max_new_tokens"])
        out: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
            # sorted ascending, so row i is the longest of the batch it joins
            if out and len(out[-1]) < max_rows and (len(out[-1]) + 1) * (lengths[i] + new) <= max_tokens:
                out[-1].append(i)
            else:
                out.append([i])  # a single row always runs, even over the token budget
        return out

    def think_tokens(self) -> tuple[int, int] | None:
        """Ids of <think> and </think> when the tokenizer has them as single tokens."""
        ids = [self.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
        unknown = self.tokenizer.unk_token_id
        return None if any(i is None or i == unknown for i in ids) else (ids[0], ids[1])

    def split_reasoning(self, tokens: list[int], truncated: bool) -> tuple[str, str | None]:
        """(content, reasoning) of generated tokens: the reasoning is what precedes </think> (after an
        opening <think>, when the output has one); an output cut inside its thinking is all reasoning."""
        think = self.think

        def text(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=True)

        if think is None or not (think[1] in tokens or (truncated and tokens[:1] == [think[0]])):
            return text(tokens), None
        end = tokens.index(think[1]) if think[1] in tokens else len(tokens)
        head = tokens[1:end] if tokens[:1] == [think[0]] else tokens[:end]
        return text(tokens[end + 1 :]), text(head)

    def answer(self, prompts: list[list[int]], seed: int) -> list[tuple[str, bool, str | None]]:
        """(text, truncated, reasoning) for each prompt (token ids), generated as one left-padded batch."""
        from transformers import set_seed

        batch = self.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(self.device)
        set_seed(seed)  # same input, same batches -> same samples
        with self.torch.inference_mode():
            out = self.model.generate(**batch, generation_config=self.generation_config())
        answers = []
        for row in out[:, batch["input_ids"].shape[1] :].tolist():
            ends = [i for i, t in enumerate(row) if t in self.eos]
            truncated = not ends
            tokens = row if truncated else row[: ends[0]]
            content, reasoning = self.split_reasoning(tokens, truncated)
            answers.append((content, truncated, reasoning))
        return answers

    def run(self, replays: dict[int, Replay], on_turn: Callable[[int, Replay], None]) -> Iterator[tuple[int, Replay | Exception]]:
        """Yield each conversation as soon as the batch that answers its last turn is done (so a job killed
        mid-round keeps every finished batch), and log one line per batch (a CPU batch can take minutes)."""
        replays = dict(replays)
        for index in [i for i, r in replays.items() if r.next_prompt() is None]:
            yield index, replays.pop(index)
        round_no = 0
        while replays:
            waiting = list(replays.items())
            prompts = [self.encode(r.next_prompt(), r.tools) for _, r in waiting]
            batches = self.batches([len(p) for p in prompts])
            for batch_no, rows in enumerate(batches):
                started = time.perf_counter()
                seed = int(self.params["seed"]) + 100_003 * round_no + batch_no
                answers = self.answer([prompts[i] for i in rows], seed)
                finished = 0
                for i, (text, truncated, reasoning) in zip(rows, answers, strict=True):
                    index, replay = waiting[i]
                    replay.add_answer(text, truncated, reasoning=reasoning)
                    if replay.next_prompt() is None:
                        finished += 1
                        yield index, replays.pop(index)
                    else:
                        on_turn(index, replay)
                print(
                    f"regenerate: turn {round_no + 1}, batch {batch_no + 1}/{len(batches)}: {len(rows)} "
                    f"conversations ({finished} finished, {len(replays)} left) in "
                    f"{time.perf_counter() - started:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            round_no += 1


def _request_messages(messages: list[dict]) -> list[dict]:
    """The context as a server reads it. vLLM takes an assistant message's thinking from `reasoning`
    (its chat_utils hands it to the template as reasoning_content), SGLang from `reasoning_content`:
    both are sent, so a template that renders the thinking of turns after the last user message (a
    tool call's turn, before its result) sees it as the tokens stage will."""
    return [{**m, "reasoning": m["reasoning_content"]} if m.get("reasoning_content") else m for m in messages]


class OpenAIBackend:
    """Concurrent conversations against an OpenAI-compatible server; turns within one are sequential."""

    def __init__(self, params: dict):
        from eagle3build.engine.openai import ChatClient

        self.params = params
        if float(params["temperature"]) > 2:  # vLLM's SamplingParams: HTTP 400 for every request
            raise ConfigError(
                "regenerate.temperature",
                f"is {params['temperature']}; OpenAI-compatible servers (vLLM) accept 0 to 2",
            )
        self.client = ChatClient(
            params["url"],
            model=params["model"],
            api_key_env=params["api_key_env"],
            timeout_s=float(params["timeout_s"]),
            max_retries=int(params["max_retries"]),
            backoff_s=float(params["retry_backoff_s"]),
        )
        self.client.resolve_model()

    @property
    def description(self) -> str:
        return f"{self.client.model} @ {self.client.base_url}"

    def converse(self, index: int, replay: Replay, on_turn: Callable[[int, Replay], None]) -> Replay:
        p = self.params
        while (messages := replay.next_prompt()) is not None:
            answer = self.client.chat(
                _request_messages(messages),
                tools=replay.tools,
                temperature=float(p["temperature"]),
                top_p=float(p["top_p"]),
                max_tokens=int(p["max_new_tokens"]),
                seed=int(p["seed"]) + index,  # per request, so the result does not depend on scheduling
            )
            replay.add_answer(
                answer.content, answer.finish_reason == "length", answer.tool_calls, answer.reasoning
            )
            if replay.next_prompt() is not None:
                on_turn(index, replay)
        return replay

    def run(self, replays: dict[int, Replay], on_turn: Callable[[int, Replay], None]) -> Iterator[tuple[int, Replay | Exception]]:
        from eagle3build.engine.openai import RequestFailed

        with ThreadPoolExecutor(max_workers=int(self.params["concurrency"])) as pool:
            futures = {pool.submit(self.converse, i, r, on_turn): i for i, r in replays.items()}
            try:
                for future in as_completed(futures):
                    try:
                        yield futures[future], future.result()
                    except RequestFailed as e:
                        yield futures[future], e
            finally:  # on an exception or a kill, do not start the queued conversations
                for future in futures:
                    future.cancel()


# ---------------------------------------------------------------------------------------------------
# Stage entry point


def with_openai_tools(sample: dict) -> dict:
    """The sample with its tools in OpenAI's form (data/tools.py), as servers validate them and templates
    render them: what is sent is what the output keeps for the tokens stage. ToolError when they cannot be."""
    if "tools" not in sample:
        return sample
    tools = openai_tools(sample["tools"])
    return {**sample, "tools": tools} if tools else {k: v for k, v in sample.items() if k != "tools"}


def read_conversations(path: str) -> list[dict]:
    samples = []
    for record in iter_jsonl(path):
        if not isinstance(record.data.get("messages"), list):
            raise UserError(
                f"{record.where}: expected an object with a 'messages' list "
                "(docs/DESIGN.md, normalized conversation)"
            )
        samples.append(record.data)
    return samples


def _fingerprint(in_path: str, target: dict, params: dict) -> str:
    keys = ("backend", "temperature", "top_p", "max_new_tokens", "seed", "batch_size", "batch_tokens", "model")
    settings = {k: params[k] for k in keys}
    settings["target"] = {k: target.get(k) for k in ("path", "model", "revision", "chat_template")}
    settings["replay"] = 2  # tool rounds and reasoning in the saved states: older partial files do not resume
    digest = hashlib.sha256(Path(in_path).read_bytes())
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()


def regenerate_shard(in_path: str, out_path: str, out_report: str, target: dict, params: dict) -> dict:
    """Write `out_path` (same format as `in_path`, assistant turns by the target) and a JSON report.

    `params`: the `regenerate` config section (unset keys take the schema's defaults)."""
    params = resolve_section("regenerate", params)
    samples = read_conversations(in_path)
    skipped = [i for i, s in enumerate(samples) if not Replay(s).user_turns]
    partial = PartialFile(out_path + ".partial.jsonl", _fingerprint(in_path, target, params))
    done, progress = partial.load()
    resumed, resumed_turns = len(done), sum(state["turns_done"] for state in progress.values())
    errors: dict[int, str] = {}
    pending = {}
    for i, sample in enumerate(samples):
        if i in done or i in skipped:
            continue
        try:  # a definition no server accepts fails its conversation here, not as an HTTP 400
            replay = Replay(with_openai_tools(sample))
        except ToolError as e:
            errors[i] = f"field 'tools': {e}"
            continue
        pending[i] = replay.restore(progress[i]) if i in progress else replay

    if pending:
        backend = HFBackend(target, params) if params["backend"] == "hf" else OpenAIBackend(params)
        description = backend.description
        partial.start(done, progress)
        try:
            for index, result in backend.run(pending, partial.append_progress):
                if isinstance(result, Exception):
                    errors[index] = str(result)
                else:
                    done[index] = result.result()
                    partial.append(index, done[index])
        finally:
            partial.close()
    else:
        description = params["model"] if params["backend"] == "openai" else target_path(target)

    kept = [
        done[i]["sample"] for i in sorted(done) if not (params["drop_truncated"] and done[i]["truncated"])
    ]
    report = {
        "format_version": FORMAT_VERSIONS["regenerate"],
        "input": str(in_path),
        "backend": params["backend"],
        "model": description,
        "samples": len(samples),
        "ok": len(done),
        "failed": len(errors),
        "truncated": sum(r["truncated"] for r in done.values()),
        "skipped": len(skipped),
        "stopped_at_tool_call": sum(bool(r.get("stopped_at_tool_call")) for r in done.values()),
        "tool_results_replayed": sum(int(r.get("tool_results", 0)) for r in done.values()),
        "with_reasoning": sum(
            any(m.get("reasoning_content") for m in r["sample"]["messages"]) for r in done.values()
        ),
        "resumed": resumed,
        "resumed_turns": resumed_turns,
        "written": len(kept),
        "errors": [{"index": i, "id": samples[i].get("id"), "error": e} for i, e in sorted(errors.items())][
            :20
        ],
    }
    attempted = len(samples) - len(skipped)
    if errors and len(errors) > float(params["max_failed_fraction"]) * attempted:
        # Keep the partial file: a rerun retries only the failed conversations.
        first = report["errors"][0]
        raise UserError(
            f"{in_path}: {len(errors)} of {attempted} conversations failed (more than "
            f"regenerate.max_failed_fraction = {params['max_failed_fraction']}); first: sample "
            f"{first['id']!r}: {first['error']}. Fix that (the server, or the sample's data) and rerun: "
            f"finished conversations are kept in {partial.path}"
        )
    with atomic_path(out_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for sample in kept:
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")
    write_json_atomic(out_report, report)
    partial.remove()
    return report

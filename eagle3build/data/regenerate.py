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

Conversations cut short: a `tool` message answers the dataset's tool calls, which the regenerated
assistant turn no longer makes, so a conversation ends before its first `tool` message (counted as
`cut_at_tool`); a generated answer that calls a tool ends the conversation too (nobody runs the tool).
A conversation whose generation fails is dropped from the output and counted, never kept with its old
answers.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from eagle3build import FORMAT_VERSIONS
from eagle3build.atomic import atomic_path, write_json_atomic
from eagle3build.data.formats import iter_jsonl
from eagle3build.errors import ConfigError, UserError

DEFAULTS = {
    "backend": "hf",  # hf | openai
    "temperature": 0.0,  # 0 = greedy
    "top_p": 1.0,
    "max_new_tokens": 1024,  # per assistant turn
    "seed": 0,
    "drop_truncated": False,  # drop conversations where a turn hit max_new_tokens
    # hf backend
    "batch_size": 8,  # rows per generate call
    "batch_tokens": 262144,  # padded tokens per generate call: rows x (longest prompt + max_new_tokens)
    "device": "auto",  # auto = cuda when available, else cpu
    # openai backend
    "url": "http://127.0.0.1:8000",
    "model": None,  # served model name; None = the server's only model
    "api_key_env": "OPENAI_API_KEY",  # name of the environment variable holding the key
    "concurrency": 32,
    "timeout_s": 600.0,  # per request
    "max_retries": 5,
    "retry_backoff_s": 1.0,  # first retry delay; doubles each retry, capped at 30 s
    "max_failed_fraction": 0.05,  # more failures than this fails the job (partial file kept)
}


# ---------------------------------------------------------------------------------------------------
# Target loading (shared with evaluate.py)


def target_path(target: dict) -> str:
    path = target.get("path") or target.get("model")
    if not path:
        raise ConfigError("target.model", "is empty; give a local model dir or a hub id")
    return str(path)


def load_target_tokenizer(target: dict):
    """The target's tokenizer with its chat template (target['chat_template'], a Jinja file, overrides)."""
    from eagle3build.data.chat import load_tokenizer

    return load_tokenizer(
        target_path(target),
        revision=target.get("revision"),
        trust_remote_code=bool(target.get("trust_remote_code", False)),
        chat_template=target.get("chat_template"),
    )


def resolve_device(device: str = "auto"):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_target_model(target: dict, device):
    """Causal LM in eval mode on `device`: bf16 on GPU, fp32 on CPU unless target['dtype'] says otherwise."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = target.get("dtype") or "auto"
    if dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(
        target_path(target),
        revision=target.get("revision"),
        trust_remote_code=bool(target.get("trust_remote_code", False)),
        dtype=dtype,
    )
    return model.to(device).eval()


def eos_token_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos:
        raise UserError(f"'{model.name_or_path}' defines no eos token; generation could never stop")
    return eos


# ---------------------------------------------------------------------------------------------------
# Replaying one conversation


class Replay:
    """Walks a conversation's user turns; the target writes each assistant turn.

    `next_prompt()` gives the messages to answer next (None when the conversation is done);
    `add_answer()` records the target's answer, which becomes context for the next user turn.
    """

    def __init__(self, sample: dict):
        self.sample = sample
        self.context: list[dict] = []
        self.user_turns: list[dict] = []
        self.cut_at_tool = False
        for message in sample["messages"]:
            role = message.get("role")
            if role == "tool":
                self.cut_at_tool = True
                break
            if role == "user":
                self.user_turns.append(message)
            elif role == "system" and not self.user_turns:
                self.context.append(message)
            # dataset assistant answers (and any later system message) are discarded
        self.turns_done = 0
        self.truncated = False
        self.ended_by_tool_call = False

    @property
    def tools(self) -> list | None:
        return self.sample.get("tools") or None

    def next_prompt(self) -> list[dict] | None:
        if self.ended_by_tool_call or self.turns_done == len(self.user_turns):
            return None
        if len(self.context) == 0 or self.context[-1].get("role") != "user":
            self.context.append(self.user_turns[self.turns_done])
        return self.context

    def add_answer(self, content: str, truncated: bool, tool_calls: list | None = None) -> None:
        message = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
            self.ended_by_tool_call = True
        self.context.append(message)
        self.turns_done += 1
        self.truncated |= truncated

    STATE_KEYS = ("context", "turns_done", "truncated", "ended_by_tool_call")

    def state(self) -> dict:
        """What a resume needs to continue this conversation after its last finished turn."""
        return {key: getattr(self, key) for key in self.STATE_KEYS}

    def restore(self, state: dict) -> Replay:
        self.context = list(state["context"])
        self.turns_done = int(state["turns_done"])
        self.truncated = bool(state["truncated"])
        self.ended_by_tool_call = bool(state["ended_by_tool_call"])
        return self

    def result(self) -> dict:
        out = {k: v for k, v in self.sample.items() if k != "messages"}
        out["messages"] = self.context
        return {"sample": out, "truncated": self.truncated, "cut_at_tool": self.cut_at_tool}


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
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
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

    def answer(self, prompts: list[list[int]], seed: int) -> list[tuple[str, bool]]:
        """(text, truncated) for each prompt (token ids), generated as one left-padded batch."""
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
            answers.append((self.tokenizer.decode(tokens, skip_special_tokens=True), truncated))
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
                for i, (text, truncated) in zip(rows, answers, strict=True):
                    index, replay = waiting[i]
                    replay.add_answer(text, truncated)
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


class OpenAIBackend:
    """Concurrent conversations against an OpenAI-compatible server; turns within one are sequential."""

    def __init__(self, params: dict):
        from eagle3build.engine.openai import ChatClient

        self.params = params
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
                messages,
                tools=replay.tools,
                temperature=float(p["temperature"]),
                top_p=float(p["top_p"]),
                max_tokens=int(p["max_new_tokens"]),
                seed=int(p["seed"]) + index,  # per request, so the result does not depend on scheduling
            )
            replay.add_answer(answer.content, answer.finish_reason == "length", answer.tool_calls)
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
# Resume file


class PartialFile:
    """Finished turns, one JSON line each, after a header line with a fingerprint of the job.

    A line is either a finished conversation ({"index", "result"}) or the state of an unfinished one
    after a turn ({"index", "progress"}; the last one of an index counts). A kill can leave a
    half-written last line: lines that do not parse are ignored. A file written for another input or
    other generation settings is discarded rather than mixed in.
    """

    def __init__(self, path: str, fingerprint: str):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self._lock = threading.Lock()  # the openai backend appends from its worker threads

    def load(self) -> tuple[dict[int, dict], dict[int, dict]]:
        """(results of finished conversations, progress of unfinished ones) by sample index."""
        if not self.path.exists():
            return {}, {}
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            header = {}
        if header.get("fingerprint") != self.fingerprint:
            print(
                f"regenerate: ignoring {self.path} (written for another input or settings)", file=sys.stderr
            )
            return {}, {}
        done, progress = {}, {}
        for line in lines[1:]:
            try:
                record = json.loads(line)
                index = int(record["index"])
                if "result" in record:
                    done[index] = record["result"]
                else:
                    state = record["progress"]
                    progress[index] = {k: state[k] for k in Replay.STATE_KEYS}
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
        return done, {i: state for i, state in progress.items() if i not in done}

    def start(self, done: dict[int, dict], progress: dict[int, dict]) -> None:
        """Rewrite the file with only its valid records, so appends never follow a torn line."""
        with atomic_path(self.path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"fingerprint": self.fingerprint}) + "\n")
            for index, result in sorted(done.items()):
                f.write(json.dumps({"index": index, "result": result}, ensure_ascii=False) + "\n")
            for index, state in sorted(progress.items()):
                f.write(json.dumps({"index": index, "progress": state}, ensure_ascii=False) + "\n")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def _write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def append(self, index: int, result: dict) -> None:
        self._write({"index": index, "result": result})

    def append_progress(self, index: int, replay: Replay) -> None:
        self._write({"index": index, "progress": replay.state()})

    def close(self) -> None:
        self._file.close()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------
# Stage entry point


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
    digest = hashlib.sha256(Path(in_path).read_bytes())
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()


def _check_params(params: dict) -> None:
    if params["backend"] not in ("hf", "openai"):
        raise ConfigError("regenerate.backend", f"'{params['backend']}' is not one of hf, openai")
    for key in ("max_new_tokens", "batch_size", "batch_tokens", "concurrency"):
        if int(params[key]) < 1:
            raise ConfigError(f"regenerate.{key}", f"must be >= 1, got {params[key]}")
    if not 0 < float(params["top_p"]) <= 1:
        raise ConfigError("regenerate.top_p", f"must be in (0, 1], got {params['top_p']}")
    if float(params["temperature"]) < 0:
        raise ConfigError("regenerate.temperature", f"must be >= 0, got {params['temperature']}")


def regenerate_shard(in_path: str, out_path: str, out_report: str, target: dict, params: dict) -> dict:
    """Write `out_path` (same format as `in_path`, assistant turns by the target) and a JSON report."""
    params = {**DEFAULTS, **params}
    _check_params(params)
    samples = read_conversations(in_path)
    skipped = [i for i, s in enumerate(samples) if not Replay(s).user_turns]
    partial = PartialFile(out_path + ".partial.jsonl", _fingerprint(in_path, target, params))
    done, progress = partial.load()
    resumed, resumed_turns = len(done), sum(state["turns_done"] for state in progress.values())
    pending = {
        i: Replay(s).restore(progress[i]) if i in progress else Replay(s)
        for i, s in enumerate(samples)
        if i not in done and i not in skipped
    }

    errors: dict[int, str] = {}
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
        "cut_at_tool": sum(r["cut_at_tool"] for r in done.values()),
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
            f"{first['id']!r}: {first['error']}. Fix the server and rerun: finished conversations are kept "
            f"in {partial.path}"
        )
    with atomic_path(out_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for sample in kept:
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")
    write_json_atomic(out_report, report)
    partial.remove()
    return report

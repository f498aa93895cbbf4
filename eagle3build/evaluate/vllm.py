"""Acceptance length of an exported EAGLE-3 draft as vLLM serves it (`evaluate.backend: vllm`).

For targets the HF evaluator cannot hold on one device (a 1T-parameter target needs tensor parallel), the
target is served by `vllm serve` with the draft through vLLM's public speculative config,
`{"method": "eagle3", "model": <export dir>, "num_speculative_tokens": K}` (K =
evaluate.vllm.num_speculative_tokens, default max(evaluate.k)). Every question goes to
`/v1/chat/completions` (the server applies the chat template; temperature 0, max_tokens =
evaluate.max_new_tokens); turn n is asked after the server's own answer to turn n-1. Each temperature > 0
of evaluate.temperatures asks the set again with `temperature`, `top_p` and a per-request `seed` (vLLM's
rejection sampler verifies with the exact speculative-sampling rule; evaluate.draft_sample_method goes into
the speculative config then) and is reported under `at_temperature` in the hf evaluator's format.

Acceptance is read from the engine's Prometheus counters at `/metrics`, which follow the definitions of
`hf.AcceptanceStats`:

    drafts            vllm:spec_decode_num_drafts_total
    accepted          vllm:spec_decode_num_accepted_tokens_total
    accepted at p     vllm:spec_decode_num_accepted_tokens_per_pos_total{position="p"}, p < K

tau = 1 + accepted / drafts. For j < K, tau@j = 1 + sum_{p<j} accepted at p / drafts: the same rounds with
their acceptance cut at j (an estimate of a run at k = j, which would verify more often). Categories run one
after another and the counters are read before and after each, once the server is idle and two reads
agree, so every category gets its own difference; engines (data parallel) are summed.

tokens/s is completion tokens over the requests' wall time. A second server without the draft
(evaluate.vllm.baseline) answers the same prompts for the baseline and counts the turns whose answers differ
(`mismatches`). The report has the HF evaluator's format (`hf.plot` draws it) and `backend: "vllm"`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from eagle3build import FORMAT_VERSIONS
from eagle3build.atomic import write_json_atomic
from eagle3build.config import resolve_section
from eagle3build.engine import process
from eagle3build.engine.http import GaveUp, JsonClient, Rejected, with_retries
from eagle3build.engine.vllm_server import SERVED_MODEL_NAME, free_port, launch, serve_command, server_config
from eagle3build.errors import ConfigError, UserError
from eagle3build.evaluate.hf import AcceptanceStats, plot, read_eval_set
from eagle3build.evaluate.settings import decode_seed, sampled_temperatures, temperature_key
from eagle3build.hf_target import target_path

SECTION = "evaluate.vllm"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
IN_FLIGHT = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# An engine without flashinfer fails to import FlashInfer's sampling kernels; vLLM's own sampler serves
# greedy and sampled requests alike. evaluate.vllm.env may set it otherwise.
SERVER_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
SETTLE_S = 0.25  # between two reads of /metrics that must agree before a category's counters count
TOO_LONG = "maximum context length"  # in vLLM's HTTP 400 for prompt + max_tokens > max_model_len
_BACKOFF_S = 1.0  # first retry delay; doubles each attempt, capped at engine.http.BACKOFF_MAX_S

T = TypeVar("T")
R = TypeVar("R")


# ---------------------------------------------------------------------------------------------------
# The engine's counters


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters summed over engines, and the requests running or waiting."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: tuple[int, ...]
    in_flight: int = 0

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        per_position = zip(self.accepted_per_position, before.accepted_per_position, strict=True)
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, tuple(a - b for a, b in per_position),
                            self.in_flight)

    def stats(self, k: int) -> AcceptanceStats:
        """The counters as the hf evaluator's stats for draft length k <= K (later positions dropped)."""
        return AcceptanceStats(k, self.drafts, list(self.accepted_per_position[:k]))

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "accepted_per_position": list(self.accepted_per_position)}


def parse_metrics(text: str, k: int) -> SpecCounters:
    """The spec-decode counters of a Prometheus text page for a server drafting k tokens."""
    totals: dict[str, float] = {}
    per_position = [0.0] * k
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == ACCEPTED_PER_POS:
                    position = int(sample.labels.get("position", -1))
                    if not 0 <= position < k:
                        raise UserError(
                            f"/metrics counts accepted tokens at draft position {position}, outside the {k} "
                            f"positions the server was started with ({SECTION}.num_speculative_tokens)"
                        )
                    per_position[position] += sample.value
                elif sample.name in (DRAFTS, DRAFT_TOKENS, ACCEPTED, *IN_FLIGHT):
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except ValueError as e:
        raise UserError(f"/metrics is not a Prometheus text page ({e})") from e
    if DRAFTS not in totals:
        raise UserError(f"/metrics has no {DRAFTS}: the server does not decode speculatively")
    return SpecCounters(
        drafts=round(totals[DRAFTS]),
        draft_tokens=round(totals.get(DRAFT_TOKENS, 0.0)),
        accepted=round(totals.get(ACCEPTED, 0.0)),
        accepted_per_position=tuple(round(a) for a in per_position),
        in_flight=round(sum(totals.get(name, 0.0) for name in IN_FLIGHT)),
    )


# ---------------------------------------------------------------------------------------------------
# One served engine


class Server:
    """HTTP to one started server: chat requests and its counters. Thread-safe."""

    def __init__(self, port: int, cfg: dict, log_path: Path, max_new_tokens: int):
        self.http = JsonClient(f"http://127.0.0.1:{port}", float(cfg["request_timeout_s"]))
        self.cfg, self.log_path, self.max_new_tokens = cfg, log_path, max_new_tokens

    def _retried(self, attempt: Callable[[], T]) -> T:
        try:
            return with_retries(attempt, self.cfg["retries"], _BACKOFF_S, jitter=True)
        except GaveUp as e:
            raise UserError(
                f"vLLM request failed after {e.attempts} attempts: {e.last} (server log: {self.log_path}; "
                f"more attempts: {SECTION}.retries, a longer wait: {SECTION}.request_timeout_s)"
            ) from e

    def chat(self, messages: list[dict], sampling: dict | None = None) -> tuple[str, int] | None:
        """(answer, completion tokens) of a chat completion, greedy or with `sampling` ({temperature,
        top_p, seed}: vLLM's request fields); None when the prompt plus max_new_tokens does not fit the
        server's context."""
        body = {"model": SERVED_MODEL_NAME, "messages": messages, "temperature": 0.0,
                "max_tokens": self.max_new_tokens, **(sampling or {})}

        def parse(reply: dict) -> tuple[str, int]:
            content = reply["choices"][0]["message"].get("content") or ""
            return content, int(reply["usage"]["completion_tokens"])

        try:
            return self._retried(lambda: self.http.post_json("/v1/chat/completions", body, parse,
                                                             "a chat completion"))
        except Rejected as e:
            if e.status == 400 and TOO_LONG in e.body:
                return None
            raise UserError(f"vLLM rejected a chat request ({e}); server log: {self.log_path}") from e

    def counters(self, k: int) -> SpecCounters:
        """The counters once no request runs or waits and two reads SETTLE_S apart agree: the engine
        publishes a step's counts after that step, which may come after the answer it finished."""
        timeout_s = float(self.cfg["request_timeout_s"])
        deadline, last = time.monotonic() + timeout_s, None
        while True:
            try:
                now = parse_metrics(self._retried(lambda: self.http.get_text("/metrics")), k)
            except Rejected as e:
                raise UserError(f"vLLM's /metrics answered {e}; server log: {self.log_path}") from e
            if now == last and now.in_flight == 0:
                return now
            if time.monotonic() > deadline:
                raise UserError(
                    f"the spec-decode counters at /metrics did not settle within {SECTION}.request_timeout_s="
                    f"{timeout_s} (requests in flight: {now.in_flight}; server log: {self.log_path})"
                )
            last = now
            time.sleep(SETTLE_S)


@contextlib.contextmanager
def serving(cfg: dict, target: dict, engine_args: list[str], log_path: Path,
            max_new_tokens: int) -> Iterator[Server]:
    """`vllm serve` the target with `engine_args` until the block ends (then its process group stops); a
    killed job's server gets SIGTERM (bound), on which vLLM stops its engine (vLLM 0.25.0: the API server's
    SIGTERM handler in entrypoints/launcher.py shuts the engine client down), so it does not keep the GPUs
    from the next run."""
    port = int(cfg["port"] or free_port())
    cmd = serve_command(cfg, target, port, engine_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc = launch(cmd, cfg, log_path, port, SECTION, SERVER_ENV, bound=True)
    ticks = process.start_ticks(proc.pid)
    try:
        server = Server(port, cfg, log_path, max_new_tokens)
        server.chat([{"role": "user", "content": "warm up"}])  # first-request costs stay out of the timing
        yield server
    finally:
        process.terminate(proc.pid, ticks)


# ---------------------------------------------------------------------------------------------------
# Questions


@dataclass
class Turn:
    messages: list[dict]  # the prompt: the conversation up to and including this turn's user message
    answer: str
    tokens: int
    sampling: dict | None = None  # the request's sampling fields (None: greedy)


@dataclass
class SetRun:
    """One eval set through the speculative server."""

    questions: int
    conversations: list[list[Turn]] = field(default_factory=list)
    skipped: int = 0  # turns too long for the server, with every later turn of their question
    seconds: float = 0.0
    by_category: dict[str, SpecCounters] = field(default_factory=dict)
    total: SpecCounters | None = None


def in_pool(fn: Callable[[T], R], items: list[T], concurrency: int) -> list[R]:
    """fn over items, `concurrency` at a time, results in order; the first failure cancels the rest."""
    with ThreadPoolExecutor(concurrency, thread_name_prefix="vllm-eval") as pool:
        futures = [pool.submit(fn, item) for item in items]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise


@dataclass(frozen=True)
class Sampling:
    """A temperature > 0 with evaluate.top_p and evaluate.seed: each request gets a seed of its own
    (from the question and turn), so a rerun asks the engine for the same draws."""

    temperature: float
    top_p: float
    seed: int

    def request(self, question: dict, turn: int) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p,
                "seed": decode_seed(self.seed, question["id"], turn)}


def converse(server: Server, question: dict, sampling: Sampling | None = None) -> tuple[list[Turn], int]:
    """Ask a question's turns in order, each after the server's own answer to the one before.
    Returns the turns answered and how many were skipped (the first too long, and every later one)."""
    messages: list[dict] = []
    turns = []
    for n, text in enumerate(question["turns"]):
        messages = [*messages, {"role": "user", "content": text}]
        fields = sampling.request(question, n) if sampling else None
        reply = server.chat(messages, fields)
        if reply is None:
            return turns, len(question["turns"]) - n
        turns.append(Turn(messages, *reply, fields))
        messages = [*messages, {"role": "assistant", "content": reply[0]}]
    return turns, 0


def run_speculative(server: Server, questions: list[dict], k: int, concurrency: int,
                    sampling: Sampling | None = None) -> SetRun:
    """Every question, one category after another, with the engine's counters read around each."""
    categories: dict[str, list[dict]] = {}
    for question in questions:
        categories.setdefault(question["category"], []).append(question)
    run = SetRun(len(questions))
    first = before = server.counters(k)
    for category, asked in categories.items():
        start = time.perf_counter()
        answered = in_pool(lambda q: converse(server, q, sampling), asked, concurrency)
        run.seconds += time.perf_counter() - start
        after = server.counters(k)
        run.by_category[category], before = after - before, after
        for turns, skipped in answered:
            run.conversations.append(turns)
            run.skipped += skipped
    run.total = before - first
    return run


def run_baseline(server: Server, run: SetRun, concurrency: int) -> dict:
    """The speculative run's prompts answered by the target alone (with the same sampling fields): its
    speed and the answers that differ (greedy only: sampled answers differ by nature, mismatches None)."""
    def replay(turns: list[Turn]) -> list[tuple[str, int] | None]:
        return [server.chat(turn.messages, turn.sampling) for turn in turns]

    start = time.perf_counter()
    replies = in_pool(replay, run.conversations, concurrency)
    seconds = time.perf_counter() - start
    pairs = [(turn, reply) for turns, answers in zip(run.conversations, replies, strict=True)
             for turn, reply in zip(turns, answers, strict=True)]
    tokens = sum(reply[1] for _, reply in pairs if reply is not None)
    sampled = any(turn.sampling for turn, _ in pairs)
    mismatches = None if sampled else sum(reply is None or reply[0] != turn.answer for turn, reply in pairs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
            "mismatches": mismatches}


# ---------------------------------------------------------------------------------------------------
# Report


def set_report(run: SetRun, baseline: dict | None, ks: list[int], k_served: int) -> dict:
    """One set in the hf evaluator's format: a row per k <= K, timed (tokens/s, speedup) for K."""
    turns = [turn for conversation in run.conversations for turn in conversation]
    tokens = sum(turn.tokens for turn in turns)
    tokens_per_s = tokens / run.seconds if run.seconds else 0.0
    base = ({k: baseline[k] for k in ("tokens", "seconds", "tokens_per_s")} if baseline
            else {"tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0, "skipped": True})
    per_k = {}
    for k in ks:
        row = run.total.stats(k).summary()
        if k == k_served:
            row.update(tokens=tokens, seconds=run.seconds, tokens_per_s=tokens_per_s,
                       speedup=tokens_per_s / base["tokens_per_s"] if base["tokens_per_s"] else 0.0,
                       mismatches=baseline["mismatches"] if baseline else None)
        row["per_category"] = {name: c.stats(k).summary() for name, c in sorted(run.by_category.items())}
        per_k[str(k)] = row
    return {
        "questions": run.questions,
        "turns": len(turns),
        "turns_skipped_too_long": run.skipped,
        "sequential_k": [k_served],
        "baseline": base,
        "k": per_k,
        "engine_counters": run.total.to_dict(),
    }


def sampled_report(run: SetRun, baseline: dict | None, ks: list[int], k_served: int, sampling: Sampling,
                   draft_sample_method: str) -> dict:
    """One set at a temperature > 0, in the format of the hf evaluator's `at_temperature` entries."""
    report = set_report(run, baseline, ks, k_served)
    report["k"][str(k_served)].pop("mismatches", None)  # sampled answers are not compared
    keys = ("turns", "turns_skipped_too_long", "baseline", "k", "engine_counters")
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed,
            "draft_sample_method": draft_sample_method, **{key: report[key] for key in keys}}


# ---------------------------------------------------------------------------------------------------
# Stage entry point


def exported_draft(draft_dir: str) -> Path:
    path = Path(draft_dir)
    missing = [name for name in ("config.json", "model.safetensors") if not (path / name).is_file()]
    if missing:
        raise UserError(
            f"{path}: no exported EAGLE-3 draft here ({', '.join(missing)} missing); evaluate.backend: vllm "
            "serves the export stage's output (export/eagle3), so run the workflow through export first"
        )
    return path.resolve()


def template_args(target: dict) -> list[str]:
    """`--chat-template` for the target's own template file (target.chat_template), as the HF side uses."""
    template = target.get("chat_template")
    if not template:
        return []
    if not Path(template).is_file():
        raise ConfigError("target.chat_template", f"no such file: {template}")
    return ["--chat-template", str(Path(template).resolve())]


def evaluate(draft_dir: str, target: dict, eval_sets: list[dict], out_json: str, out_png: str, params: dict,
             log_stem: str | None = None) -> dict:
    """Evaluate the exported draft in `draft_dir` through vLLM on question files; write metrics JSON and a
    plot in the hf evaluator's format.

    `params`: keys of the `evaluate` config section (unset keys, and those of `evaluate.vllm`, take the
    schema's defaults). The servers' logs are `{log_stem}.vllm-speculative.log` and
    `{log_stem}.vllm-baseline.log` (default log_stem: out_json without its suffix)."""
    params = resolve_section("evaluate", params)
    samplings = [Sampling(t, float(params["top_p"]), int(params["seed"])) for t in sampled_temperatures(params)]
    sets = {s["name"]: read_eval_set(s, params["max_samples"]) for s in eval_sets}  # before any server starts
    cfg = server_config(SECTION, params["vllm"])
    k_served = int(cfg["num_speculative_tokens"] or max(params["k"]))
    ks = sorted({k for k in params["k"] if k <= k_served} | {k_served})
    draft = exported_draft(draft_dir)
    served = {"model": target_path(target), "revision": target.get("revision"),
              "trust_remote_code": target.get("trust_remote_code")}
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k_served}
    if samplings:  # how the engine drafts at T > 0 (vLLM >= 0.25; greedy-only runs keep their command)
        spec["draft_sample_method"] = params["draft_sample_method"]
    stem = str(log_stem or Path(out_json).with_suffix(""))
    new_tokens, concurrency = int(params["max_new_tokens"]), int(cfg["concurrency"])

    template = template_args(target)
    spec_args = [*template, "--speculative-config", json.dumps(spec)]
    # Every temperature runs on its own (categories apart), so each gets its own counter differences.
    with serving(cfg, served, spec_args, Path(f"{stem}.vllm-speculative.log"), new_tokens) as server:
        runs = {name: run_speculative(server, qs, k_served, concurrency) for name, qs in sets.items()}
        sampled = {name: [run_speculative(server, qs, k_served, concurrency, s) for s in samplings]
                   for name, qs in sets.items()}
    baselines = dict.fromkeys(sets)
    sampled_baselines = {name: [None] * len(samplings) for name in sets}
    if cfg["baseline"]:
        with serving(cfg, served, template, Path(f"{stem}.vllm-baseline.log"), new_tokens) as server:
            baselines = {name: run_baseline(server, run, concurrency) for name, run in runs.items()}
            sampled_baselines = {name: [run_baseline(server, run, concurrency) for run in sampled[name]]
                                 for name in sets}
    results = {
        "format_version": FORMAT_VERSIONS["evaluate"],
        "backend": "vllm",
        "draft": str(draft_dir),
        "target": target_path(target),
        "device": f"vllm (tensor_parallel_size={cfg['tensor_parallel_size']}, "
                  f"data_parallel_size={cfg['data_parallel_size']})",
        "dtype": str(target.get("dtype") or "auto"),
        "k": ks,
        "max_new_tokens": new_tokens,
        "num_speculative_tokens": k_served,
        "concurrency": concurrency,
        "sets": {name: set_report(runs[name], baselines[name], ks, k_served) for name in sets},
    }
    if samplings:
        results.update(temperatures=[0.0, *(s.temperature for s in samplings)], top_p=samplings[0].top_p,
                       seed=samplings[0].seed, draft_sample_method=params["draft_sample_method"])
        for name in sets:
            results["sets"][name]["at_temperature"] = {
                temperature_key(s.temperature): sampled_report(run, base, ks, k_served, s,
                                                               params["draft_sample_method"])
                for s, run, base in zip(samplings, sampled[name], sampled_baselines[name], strict=True)
            }
    write_json_atomic(out_json, results)
    plot(results, out_png)
    return results

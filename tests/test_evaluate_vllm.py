"""The vllm evaluation backend against tests/fake_vllm_spec_server.py: metrics parsing, the per-category
contract (known accepted counts in, the report's tau out), the servers' lifecycle and the errors."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from eagle3build.engine import process
from eagle3build.errors import ConfigError, UserError
from eagle3build.evaluate.vllm import (
    ACCEPTED_PER_POS,
    SpecCounters,
    evaluate,
    parse_metrics,
)

FAKE = str(Path(__file__).with_name("fake_vllm_spec_server.py"))
FIXTURE = Path(__file__).parent / "fixtures" / "vllm_0.25.0_metrics.txt"

# What vLLM's stat logger writes (prometheus_client's text format): counters with the `_total` suffix and
# a `_created` gauge each, labels sorted, one series per engine; unrelated families around them.
VLLM_PAGE = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1234.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="target"} 0.0
vllm:num_requests_running{engine="1",model_name="target"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="target"} 6.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.7649e+09
vllm:spec_decode_num_drafts_created{engine="1",model_name="target"} 1.7649e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="target"} 18.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 17.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="target"} 9.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="0"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="2"} 1.0
"""


# ---------------------------------------------------------------- parsing the engine's page
def test_vllm_page_is_summed_over_engines():
    counters = parse_metrics(VLLM_PAGE, 3)
    assert counters == SpecCounters(drafts=16, draft_tokens=48, accepted=26, accepted_per_position=(13, 9, 4))
    summary = counters.stats(3).summary()
    assert summary["mean_acceptance_length"] == pytest.approx(1 + 26 / 16)  # tau = 1 + accepted / drafts
    assert summary["acceptance_rate_per_position"] == pytest.approx([13 / 16, 9 / 16, 4 / 16])
    # tau@j = 1 + sum_{p<j} accepted at p / drafts
    assert counters.stats(1).summary()["mean_acceptance_length"] == pytest.approx(1 + 13 / 16)
    assert counters.stats(2).summary()["mean_acceptance_length"] == pytest.approx(1 + 22 / 16)


def test_page_written_by_prometheus_client_parses_the_same():
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels,
                     registry=registry)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                      [*labels, "position"], registry=registry)
    drafts.labels("m", "0").inc(4)
    for position, count in enumerate([3, 1]):
        per_pos.labels("m", "0", str(position)).inc(count)
    page = generate_latest(registry).decode()
    assert f"{ACCEPTED_PER_POS}{{" in page  # the `_total` suffix the engine's page has
    counters = parse_metrics(page, 2)
    assert counters.drafts == 4 and counters.accepted_per_position == (3, 1)


def test_counter_difference_is_per_category():
    before = SpecCounters(10, 30, 12, (7, 4, 1))
    after = SpecCounters(14, 42, 18, (10, 6, 2), in_flight=0)
    assert after - before == SpecCounters(4, 12, 6, (3, 2, 1))


@pytest.mark.parametrize("page, message", [
    ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n",
     "does not decode speculatively"),
    (VLLM_PAGE, "evaluate.vllm.num_speculative_tokens"),  # positions 0..2 on a server asked for k = 2
    ("vllm:spec_decode_num_drafts_total{engine=0 3\n", "not a Prometheus text page"),
])  # fmt: skip
def test_unexpected_pages_are_errors(page, message):
    with pytest.raises(UserError, match=message):
        parse_metrics(page, 2)


def test_recorded_page_of_a_real_engine():
    """A /metrics page recorded from vLLM 0.25.0 serving an EAGLE-3 draft (tests/fixtures)."""
    if not FIXTURE.exists():
        pytest.skip("no recorded vLLM page in tests/fixtures")
    text = FIXTURE.read_text()
    positions = {line.split('position="')[1].split('"')[0] for line in text.splitlines()
                 if line.startswith(ACCEPTED_PER_POS)}
    counters = parse_metrics(text, len(positions))
    assert counters.drafts > 0 and counters.accepted == sum(counters.accepted_per_position)
    assert 0 < counters.draft_tokens <= counters.drafts * len(positions)  # fewer near max_model_len
    assert list(counters.accepted_per_position) == sorted(counters.accepted_per_position, reverse=True)


# ---------------------------------------------------------------- the backend against the fake engine
def write_questions(path: Path, questions: list[dict]) -> str:
    path.write_text("".join(json.dumps(q) + "\n" for q in questions))
    return str(path)


def fake_export(tmp_path: Path) -> str:
    export = tmp_path / "export" / "eagle3"
    export.mkdir(parents=True)
    (export / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (export / "model.safetensors").write_bytes(b"")
    return str(export)


def params(tmp_path: Path, k=(1, 2, 3), max_new_tokens: int = 16, **server) -> dict:
    env = {"FAKE_VLLM_ARGV": str(tmp_path / "argv.jsonl"), **server.pop("env", {})}
    vllm = {"executable": [sys.executable, FAKE], "env": env, "startup_timeout_s": 30,
            "request_timeout_s": 10, "retries": 1, **server}
    return {"k": list(k), "max_new_tokens": max_new_tokens, "backend": "vllm", "vllm": vllm}


TARGET = {"path": "org/fake-target", "revision": "a" * 40, "trust_remote_code": True, "dtype": "bfloat16"}

# Per turn, the accepted tokens of each verification round the fake engine reports (k = 3).
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["a poem accept:3", "shorter accept:21"]},
    {"question_id": 2, "category": "math", "turns": ["two plus two accept:0013"]},
    {"question_id": 3, "category": "writing", "turns": ["a story accept:32"]},
    {"question_id": 4, "category": "math", "turns": ["seven times six accept:1"]},
]
ROUNDS = {"writing": [3, 2, 1, 3, 2], "math": [0, 0, 1, 3, 1]}


def expected_tau(rounds: list[int], j: int) -> float:
    """tau@j from the rounds' accepted counts: 1 + sum_{p<j} (rounds accepting more than p) / rounds."""
    return 1 + sum(min(a, j) for a in rounds) / len(rounds)


def _pids(log: Path) -> list[int]:
    lines = log.read_text().splitlines()
    return [int(line.split()[4]) for line in lines if line.startswith("fake vllm serve: pid")]


def test_tau_per_category_and_overall_from_the_engine_counters(tmp_path):
    """The contract: known accepted counts per round in, the hf evaluator's report out (categories apart,
    tau@j for every k <= K, tokens/s against the server without the draft), the servers stopped."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    target = {**TARGET, "chat_template": str(template)}
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS)
    out_json, out_png = tmp_path / "eval" / "set.json", tmp_path / "eval" / "set.png"
    # Two engines (data parallel) and counters that move after the answers, as a real engine's may.
    settings = params(tmp_path, data_parallel_size=2, tensor_parallel_size=2, concurrency=2,
                      env={"FAKE_VLLM_METRICS_LAG_S": "0.3", "FAKE_VLLM_STEP_S": "0.02"})
    result = evaluate(fake_export(tmp_path), target, [{"name": "set", "path": questions}], str(out_json),
                      str(out_png), settings, log_stem=str(tmp_path / "logs" / "set"))

    assert json.loads(out_json.read_text()) == result
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert result["backend"] == "vllm" and result["k"] == [1, 2, 3] and result["num_speculative_tokens"] == 3
    report = result["sets"]["set"]
    assert report["questions"] == 4 and report["turns"] == 5 and report["turns_skipped_too_long"] == 0
    assert report["sequential_k"] == [3]
    for j in (1, 2, 3):
        row = report["k"][str(j)]
        for category, rounds in ROUNDS.items():
            metrics = row["per_category"][category]
            assert metrics["drafts"] == len(rounds)
            assert metrics["mean_acceptance_length"] == pytest.approx(expected_tau(rounds, j))
        everything = ROUNDS["writing"] + ROUNDS["math"]
        assert row["mean_acceptance_length"] == pytest.approx(expected_tau(everything, j))
        assert row["acceptance_rate_per_position"] == pytest.approx(
            [sum(a > p for a in everything) / len(everything) for p in range(j)])
    timed = report["k"]["3"]
    assert timed["tokens"] == report["baseline"]["tokens"] > 0 and timed["mismatches"] == 0
    assert timed["tokens_per_s"] > 0 and timed["speedup"] > 1  # the fake verifies several tokens a step
    assert "speedup" not in report["k"]["1"]
    assert report["engine_counters"]["accepted"] == sum(ROUNDS["writing"] + ROUNDS["math"])

    spec_start, base_start = (json.loads(line) for line in (tmp_path / "argv.jsonl").read_text().splitlines())
    argv = spec_start["argv"]
    assert argv[:2] == ["serve", "org/fake-target"] and "--trust-remote-code" in argv
    for flag, value in [("--served-model-name", "eagle3build-target"), ("--tensor-parallel-size", "2"),
                        ("--data-parallel-size", "2"), ("--revision", "a" * 40),
                        ("--chat-template", str(template.resolve()))]:
        assert argv[argv.index(flag) + 1] == value
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    export = str((tmp_path / "export" / "eagle3").resolve())
    assert spec == {"method": "eagle3", "model": export, "num_speculative_tokens": 3}
    assert "--speculative-config" not in base_start["argv"]
    assert spec_start["env"] == base_start["env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    logs = [tmp_path / "logs" / f"set.vllm-{kind}.log" for kind in ("speculative", "baseline")]
    for pid in (pid for log in logs for pid in _pids(log)):
        assert not process.alive(pid), "a server outlived the evaluation"


def test_turns_too_long_are_skipped_with_their_later_turns_and_the_baseline_can_be_skipped(tmp_path):
    questions = write_questions(tmp_path / "q.jsonl", [
        {"question_id": 1, "category": "long", "turns": ["short accept:2", "w " * 60 + "accept:3", "never"]},
        {"question_id": 2, "category": "short", "turns": ["fits accept:1"]},
    ])  # fmt: skip
    out_json = tmp_path / "set.json"
    result = evaluate(fake_export(tmp_path), TARGET, [{"name": "set", "path": questions}], str(out_json),
                      str(tmp_path / "set.png"), params(tmp_path, k=[2], max_model_len=64, baseline=False))
    report = result["sets"]["set"]
    assert report["turns"] == 2 and report["turns_skipped_too_long"] == 2
    assert report["k"]["2"]["per_category"]["long"]["mean_acceptance_length"] == pytest.approx(3.0)
    assert report["k"]["2"]["per_category"]["short"]["mean_acceptance_length"] == pytest.approx(2.0)
    assert report["baseline"]["skipped"] and report["k"]["2"]["speedup"] == 0.0
    assert report["k"]["2"]["mismatches"] is None
    assert len((tmp_path / "argv.jsonl").read_text().splitlines()) == 1  # no second server


def test_a_server_that_fails_to_start_is_reported_with_its_log(tmp_path):
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    settings = params(tmp_path, env={"FAKE_VLLM_STARTUP": "crash"})
    with pytest.raises(UserError) as error:
        evaluate(fake_export(tmp_path), TARGET, [{"name": "set", "path": questions}],
                 str(tmp_path / "set.json"), str(tmp_path / "set.png"), settings)
    message = str(error.value)
    assert "exited with status 1" in message and "CUDA out of memory (fake)" in message
    assert str(tmp_path / "set.vllm-speculative.log") in message
    assert not (tmp_path / "set.json").exists()


def test_a_server_that_never_gets_healthy_names_the_timeout_key(tmp_path):
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    settings = params(tmp_path, startup_timeout_s=1, env={"FAKE_VLLM_STARTUP": "delay:30"})
    start = time.monotonic()
    with pytest.raises(UserError, match=r"evaluate\.vllm\.startup_timeout_s=1"):
        evaluate(fake_export(tmp_path), TARGET, [{"name": "set", "path": questions}],
                 str(tmp_path / "set.json"), str(tmp_path / "set.png"), settings)
    assert time.monotonic() - start < 20
    pid = _pids(tmp_path / "set.vllm-speculative.log")[0]
    assert not process.alive(pid)


def test_errors_name_the_config_keys(tmp_path):
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    sets = [{"name": "set", "path": questions}]
    out = str(tmp_path / "set.json"), str(tmp_path / "set.png")
    with pytest.raises(UserError, match="evaluate.backend: vllm") as error:
        evaluate(str(tmp_path / "no-export"), TARGET, sets, *out, params(tmp_path))
    assert "config.json" in str(error.value)
    with pytest.raises(ConfigError, match=r"evaluate\.vllm\.executable"):
        evaluate(fake_export(tmp_path), TARGET, sets, *out, params(tmp_path, executable="/no/such/vllm"))
    export = str(tmp_path / "export" / "eagle3")
    with pytest.raises(ConfigError, match=r"evaluate\.vllm\.tensor_parallel_size"):
        evaluate(export, TARGET, sets, *out, params(tmp_path, tensor_parallel_size=0))
    with pytest.raises(ConfigError, match=r"target\.chat_template"):
        no_template = {**TARGET, "chat_template": str(tmp_path / "none.jinja")}
        evaluate(export, no_template, sets, *out, params(tmp_path))


# ---------------------------------------------------------------- the rule
def test_the_rule_adds_the_vllm_settings_only_for_the_vllm_backend(tmp_path):
    """The hf backend's params stay as they were (tests/test_rule_params.py); the vllm backend adds the
    settings that change its result, not the server's sizes or timeouts."""
    from conftest import STORIES
    from test_chain import chain_config
    from workflow_util import copy_workflow, planned_params, write_config

    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    config = chain_config()
    server = {"num_speculative_tokens": 5, "tensor_parallel_size": 8}
    config["evaluate"] |= {"backend": "vllm", "vllm": server}
    wd = copy_workflow(tmp_path)
    write_config(wd, config)
    (planned,) = planned_params(wd)["evaluate"]
    settings = {"k": [1, 3, 5], "max_new_tokens": 32, "max_samples": None, "sequential_k": [3],
                "backend": "vllm", "vllm": {"num_speculative_tokens": 5, "baseline": True, "concurrency": 1}}
    assert f"'settings': {settings!r}" in planned

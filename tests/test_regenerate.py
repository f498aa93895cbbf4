import json
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import STORY_CHAT_TEMPLATE as TEMPLATE

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_openai_server import FakeOpenAIServer, fake_answer  # noqa: E402

from eagle3build.data.regenerate import HFBackend, regenerate_shard  # noqa: E402
from eagle3build.data.replay import PartialFile  # noqa: E402
from eagle3build.errors import UserError  # noqa: E402

torch.set_num_threads(1)
SHARED = Path(__file__).resolve().parents[2] / "shared"
STORIES = SHARED / "assets" / "models" / "stories260K"

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
# as vLLM validates and renders them (ChatCompletionToolsParam.model_dump()): what is sent and kept
SENT_TOOLS = [
    {"type": "function",
     "function": {"name": "get_weather", "description": None, "parameters": {"type": "object"}}}
]
CONVERSATIONS = [
    {
        "id": "chat:0",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "OLD ANSWER 1"},
            {"role": "user", "content": "and then?"},
            {"role": "assistant", "content": "OLD ANSWER 2"},
        ],
    },
    {"id": "question:1", "messages": [{"role": "user", "content": "what is two plus two"}]},
    {"id": "empty:2", "messages": [{"role": "system", "content": "no user turn here"}]},
    {
        "id": "tool:3",
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function"}]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "OLD: it is sunny"},
            {"role": "user", "content": "thanks"},
        ],
    },
]


def write_shard(path: Path, samples: list[dict]) -> str:
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return str(path)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def openai_params(server: FakeOpenAIServer, **overrides) -> dict:
    params = {
        "backend": "openai",
        "url": server.url + "/v1",
        "concurrency": 4,
        "timeout_s": 5.0,
        "max_retries": 3,
        "retry_backoff_s": 0.01,
        "max_new_tokens": 64,
    }
    return {**params, **overrides}


def run(tmp_path, samples, params, target=None):
    shard = write_shard(tmp_path / "in.jsonl", samples)
    out, report_path = str(tmp_path / "out.jsonl"), str(tmp_path / "out.json")
    report = regenerate_shard(shard, out, report_path, target or {"path": "unused"}, params)
    assert json.loads(Path(report_path).read_text()) == report
    return read_jsonl(out), report


def test_multi_turn_replay_uses_generated_answers_as_context(tmp_path):
    with FakeOpenAIServer() as server:
        out, report = run(tmp_path, CONVERSATIONS, openai_params(server))
    assert [s["id"] for s in out] == ["chat:0", "question:1", "tool:3"]
    chat = out[0]["messages"]
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "user", "assistant"]
    assert chat[0]["content"] == "be brief"
    assert chat[2]["content"] == fake_answer(chat[:2])[0] == "reply 1: ereht olleh"
    assert chat[4]["content"] == fake_answer(chat[:4])[0]
    assert "OLD" not in json.dumps(out)
    # The second turn's request carried the target's own first answer, not the dataset's.
    second = [r for r in server.requests if len(r["messages"]) == 4]
    assert len(second) == 1 and second[0]["messages"][2]["content"] == "reply 1: ereht olleh"
    # The target answered without the dataset's tool call: its results are skipped, the next user
    # turn continues the conversation.
    tool = out[2]
    assert tool["tools"] == SENT_TOOLS
    assert [m["role"] for m in tool["messages"]] == ["user", "assistant", "user", "assistant"]
    assert "sunny" not in json.dumps(tool)
    tool_requests = [r for r in server.requests if r["messages"][0]["content"] == "weather in Paris?"]
    assert tool_requests[0]["tools"] == SENT_TOOLS
    assert report["samples"] == 4
    assert (report["ok"], report["failed"], report["skipped"], report["truncated"]) == (3, 0, 1, 0)
    assert report["stopped_at_tool_call"] == 0 and report["tool_results_replayed"] == 0
    assert report["written"] == 3
    assert not (tmp_path / "out.jsonl.partial.jsonl").exists()


def test_retries_on_500_and_garbage_and_hang(tmp_path):
    samples = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3)]
    with FakeOpenAIServer(hang_s=3.0) as server:
        server.fail_next, server.garbage_next, server.hang_next = 2, 1, 1
        start = time.monotonic()
        out, report = run(
            tmp_path, samples, openai_params(server, concurrency=1, timeout_s=0.5, max_retries=4)
        )
        elapsed = time.monotonic() - start
    assert report["ok"] == 3 and report["failed"] == 0
    assert [s["messages"][1]["content"] for s in out] == [f"reply 1: {i} noitseuq" for i in range(3)]
    assert len(server.requests) == 3 + 4  # each misbehaving answer cost one more request
    assert elapsed < 3.0  # the hung request was abandoned at its timeout, not waited for


def test_failed_samples_are_dropped_and_counted(tmp_path):
    samples = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]
    with FakeOpenAIServer() as server:
        server.fail_if_contains = "q2"
        out, report = run(tmp_path, samples, openai_params(server, max_retries=2, max_failed_fraction=0.5))
    assert [s["id"] for s in out] == ["q0", "q1", "q3"]
    assert report["failed"] == 1 and report["ok"] == 3
    assert report["errors"][0]["id"] == "q2" and "HTTP 500" in report["errors"][0]["error"]
    assert sum(r["messages"][0]["content"] == "q2" for r in server.requests) == 3  # 1 try + 2 retries


def test_too_many_failures_raise_and_resume_retries_only_those(tmp_path):
    samples = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(5)]
    with FakeOpenAIServer() as server:
        server.fail_if_contains = "q3"
        params = openai_params(server, max_retries=0, max_failed_fraction=0.0)
        with pytest.raises(UserError, match="1 of 5 conversations failed"):
            run(tmp_path, samples, params)
        assert not (tmp_path / "out.jsonl").exists()
        partial = tmp_path / "out.jsonl.partial.jsonl"
        assert len(partial.read_text().splitlines()) == 1 + 4
        with partial.open("a") as f:  # a kill in the middle of a write leaves a torn line
            f.write('{"index": 3, "resu')
        server.fail_if_contains = None
        server.requests.clear()
        out, report = run(tmp_path, samples, params)
    assert [r["messages"][0]["content"] for r in server.requests] == ["q3"]
    assert report["resumed"] == 4 and report["ok"] == 5 and report["failed"] == 0
    assert [s["id"] for s in out] == [f"q{i}" for i in range(5)]
    assert not partial.exists()


def test_resume_continues_a_conversation_at_its_first_unfinished_turn(tmp_path):
    turns = ["first question", "second question", "third question"]
    sample = {"id": "long", "messages": [m for t in turns for m in ({"role": "user", "content": t},
                                                                      {"role": "assistant", "content": "OLD"})]}
    with FakeOpenAIServer() as server:
        server.fail_if_contains = "third"  # the job dies in the conversation's last turn
        params = openai_params(server, max_retries=0, max_failed_fraction=0.0)
        with pytest.raises(UserError, match="1 of 1 conversations failed"):
            run(tmp_path, [sample], params)
        server.fail_if_contains = None
        server.requests.clear()
        out, report = run(tmp_path, [sample], params)
    # only the third turn is asked again, after the two answers the first run got
    assert len(server.requests) == 1
    asked = server.requests[0]["messages"]
    assert [m["content"] for m in asked if m["role"] == "user"] == turns
    assert [m["content"] for m in asked if m["role"] == "assistant"] == [
        fake_answer(asked[:1])[0], fake_answer(asked[:3])[0]]
    assert report["resumed"] == 0 and report["resumed_turns"] == 2 and report["ok"] == 1
    assert [m["role"] for m in out[0]["messages"]] == ["user", "assistant"] * 3
    assert "OLD" not in json.dumps(out)


def test_hf_backend_resumes_mid_conversation(tmp_path, stories_target):
    from eagle3build.config import section_defaults
    from eagle3build.data.regenerate import _fingerprint
    from eagle3build.data.replay import Replay

    samples = [
        {"id": "a", "messages": [{"role": "user", "content": "Once upon a time there was a cat."},
                                 {"role": "user", "content": "What did the cat do?"}]},
        {"id": "b", "messages": [{"role": "user", "content": "Tom had a red ball."}]},
    ]
    params = {"backend": "hf", "batch_size": 4, "max_new_tokens": 12, "device": "cpu"}
    # the partial file of a job killed after round 1: b finished, a after its first turn
    shard = write_shard(tmp_path / "in.jsonl", samples)
    partial = PartialFile(str(tmp_path / "out.jsonl.partial.jsonl"),
                          _fingerprint(shard, stories_target, {**section_defaults("regenerate"), **params}))
    b_done = {**samples[1], "messages": [samples[1]["messages"][0], {"role": "assistant", "content": "B DONE"}]}
    a_half = Replay(samples[0])
    a_half.next_prompt()
    a_half.add_answer("SAVED ANSWER", True)
    partial.start({1: {"sample": b_done, "truncated": False, "stopped_at_tool_call": False}}, {0: a_half.state()})
    partial.close()
    out, report = run(tmp_path, samples, params, stories_target)
    assert report["resumed"] == 1 and report["resumed_turns"] == 1 and report["ok"] == 2
    a = out[0]["messages"]
    assert a[1]["content"] == "SAVED ANSWER"  # kept, not regenerated
    assert a[3]["content"] == reference_greedy(stories_target, a[:3], 12)  # the target answers after it
    assert out[1]["messages"][1]["content"] == "B DONE"


def test_partial_file_from_other_settings_is_ignored(tmp_path):
    samples = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(2)]
    with FakeOpenAIServer() as server:
        server.fail_if_contains = "q1"
        with pytest.raises(UserError):
            run(tmp_path, samples, openai_params(server, max_retries=0, max_failed_fraction=0.0))
        server.fail_if_contains = None
        server.requests.clear()
        _, report = run(tmp_path, samples, openai_params(server, max_retries=0, temperature=0.7))
    assert report["resumed"] == 0 and len(server.requests) == 2


def test_concurrency_and_input_order(tmp_path):
    samples = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(8)]
    with FakeOpenAIServer(delay_s=0.2) as server:
        start = time.monotonic()
        out, _ = run(tmp_path, samples, openai_params(server, concurrency=4))
        elapsed = time.monotonic() - start
    assert server.max_in_flight == 4
    assert elapsed < 8 * 0.2
    assert [s["id"] for s in out] == [f"q{i}" for i in range(8)]


def test_truncated_counted_and_optionally_dropped(tmp_path):
    samples = [
        {"id": "short", "messages": [{"role": "user", "content": "a"}]},
        {"id": "long", "messages": [{"role": "user", "content": "a b c d e f"}]},
    ]
    with FakeOpenAIServer() as server:
        out, report = run(tmp_path, samples, openai_params(server, max_new_tokens=4))
        assert report["truncated"] == 1 and len(out) == 2
        out, report = run(tmp_path, samples, openai_params(server, max_new_tokens=4, drop_truncated=True))
    assert [s["id"] for s in out] == ["short"] and report["written"] == 1


def test_no_server_is_a_user_error(tmp_path):
    params = {"backend": "openai", "url": "http://127.0.0.1:9", "timeout_s": 1.0}
    with pytest.raises(UserError, match="no OpenAI-compatible server"):
        run(tmp_path, CONVERSATIONS[:1], params)


def test_wrong_model_name_is_a_user_error(tmp_path):
    with FakeOpenAIServer() as server:
        with pytest.raises(UserError, match="regenerate.model"):
            run(tmp_path, CONVERSATIONS[:1], openai_params(server, model="other"))


# ---------------------------------------------------------------------------------------------------
# tools: LLaMA-Factory's glaive_toolcall_en_demo.json writes bare {name, description, parameters} as a
# JSON string; vLLM takes only OpenAI's {"type": "function", "function": {...}}


GLAIVE_TOOLS = [{
    "name": "search_recipes",
    "description": "Search for recipes based on ingredients",
    "parameters": {
        "type": "object",
        "properties": {"ingredients": {"type": "array", "items": {"type": "string"}}},
        "required": ["ingredients"],
    },
}]
GLAIVE_RECORD = {
    "conversations": [
        {"from": "human", "value": "I have chicken and rice. Can you find a recipe?"},
        {"from": "function_call",
         "value": json.dumps({"name": "search_recipes", "arguments": {"ingredients": ["chicken", "rice"]}})},
        {"from": "observation", "value": '{"recipes": ["Chicken fried rice"]}'},
        {"from": "gpt", "value": "Try chicken fried rice."},
        {"from": "human", "value": "thanks"},
        {"from": "gpt", "value": "You're welcome."},
    ],
    "tools": json.dumps(GLAIVE_TOOLS),
}
OPENAI_GLAIVE_TOOLS = [{"type": "function", "function": GLAIVE_TOOLS[0]}]


def glaive_samples() -> list[dict]:
    """The record as the split stage writes it, and as a shard written before tools were normalised."""
    from eagle3build.data.formats import Record, normalize

    split, _ = normalize(Record(GLAIVE_RECORD, "glaive_toolcall_en_demo.json record 0"), "sharegpt")
    return [{"id": "glaive:0", **split}, {"id": "glaive:1", "messages": split["messages"],
                                          "tools": GLAIVE_RECORD["tools"]}]


class RecordingTemplate:
    """A tokenizer stand-in whose template writes the tools and tool calls as JSON, as tool templates do."""

    def __init__(self):
        self.seen: list[tuple[list, list | None]] = []

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
        self.seen.append((messages, tools))
        turns = "".join(f"<{m['role']}>{m['content']}{json.dumps(m.get('tool_calls'))}</s>" for m in messages)
        return json.dumps(tools) + turns + ("<assistant>" if add_generation_prompt else "")


def test_glaive_tools_reach_vllm_and_the_template_in_openai_form(tmp_path):
    from eagle3build.data.chat import render_conversation

    assert glaive_samples()[0]["tools"] == OPENAI_GLAIVE_TOOLS  # the split stage stores OpenAI's form
    with FakeOpenAIServer() as server:
        server.tool_call_when, server.tool_name = "recipe", "search_recipes"
        out, report = run(tmp_path, glaive_samples(), openai_params(server, max_failed_fraction=0.0))
    assert (report["ok"], report["failed"], report["tool_results_replayed"]) == (2, 0, 2)
    assert all(r["tools"] == OPENAI_GLAIVE_TOOLS and "tool_choice" not in r for r in server.requests)
    for sample in out:
        messages = sample["messages"]
        assert sample["tools"] == OPENAI_GLAIVE_TOOLS
        roles = [m["role"] for m in messages]
        assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant"]
        assert messages[2]["content"] == '{"recipes": ["Chicken fried rice"]}'
        assert messages[3]["content"] == 'tool said: {"recipes": ["Chicken fried rice"]}'
        # the tokens stage renders what the target was sent: the same tools, the call's arguments parsed
        # from JSON as vLLM hands them to the template
        template = RecordingTemplate()
        render_conversation(template, sample, specials=())
        assert all(tools == OPENAI_GLAIVE_TOOLS for _, tools in template.seen)
        sent_call = messages[1]["tool_calls"][0]["function"]
        rendered_call = template.seen[0][0][1]["tool_calls"][0]["function"]
        assert rendered_call == {**sent_call, "arguments": json.loads(sent_call["arguments"])}


def test_server_without_tool_parser_is_asked_with_tool_choice_none(tmp_path, capsys):
    [sample, _] = glaive_samples()
    with FakeOpenAIServer() as server:  # `vllm serve MODEL`: no --enable-auto-tool-choice
        out, report = run(tmp_path, [sample], openai_params(server, max_failed_fraction=0.0))
    assert (report["ok"], report["failed"]) == (1, 0)
    # the first request took vLLM's default ("auto") and was refused; it and every later one go with "none"
    assert [r.get("tool_choice") for r in server.requests] == [None, "none", "none"]
    assert all(r["tools"] == OPENAI_GLAIVE_TOOLS for r in server.requests)
    assert [m["role"] for m in out[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert "parses no tool calls" in capsys.readouterr().err


def test_tool_definition_without_a_name_fails_only_its_sample(tmp_path):
    good, bad = glaive_samples()
    bad = {**bad, "tools": json.dumps([{"description": "a tool without a name"}])}
    with FakeOpenAIServer() as server:
        server.tool_call_when, server.tool_name = "recipe", "search_recipes"
        out, report = run(tmp_path, [good, bad], openai_params(server, max_failed_fraction=0.5))
        assert [s["id"] for s in out] == ["glaive:0"] and report["failed"] == 1
        [error] = report["errors"]
        assert error["id"] == "glaive:1" and "tools[0] has no function name" in error["error"]
        assert len(server.requests) == 3  # the good sample's call, answer after its result, turn 2; no other
        with pytest.raises(UserError, match=r"sample 'glaive:1': field 'tools': tools\[0\]"):
            run(tmp_path, [bad], openai_params(server, max_failed_fraction=0.0))


def test_fake_server_refuses_bare_tools_as_vllm_does():
    import requests

    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "tools": GLAIVE_TOOLS}
    with FakeOpenAIServer() as server:
        reply = requests.post(server.url + "/v1/chat/completions", json=body, timeout=5)
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("Bad Request", "body.tools.0.function", 400)
        # the words vLLM 0.25.0 answered the glaive file with
        assert error["message"].startswith(
            "1 validation error:\n  {'type': 'missing', 'loc': ('body', 'tools', 0, 'function'), "
            "'msg': 'Field required', 'input': {'name': 'search_recipes'"
        )
        url = server.url + "/v1/chat/completions"
        wrong_model = requests.post(url, json={**body, "model": "x"}, timeout=5)
        no_parser = requests.post(url, json={**body, "tools": OPENAI_GLAIVE_TOOLS}, timeout=5)
        hot = requests.post(url, json={**body, "tools": None, "temperature": 2.5}, timeout=5)
    assert wrong_model.status_code == 400  # the body is checked before the model
    assert no_parser.status_code == 400
    assert no_parser.json()["error"]["message"].startswith('"auto" tool choice requires')
    assert hot.status_code == 400 and hot.json()["error"]["param"] == "temperature"


def test_temperature_out_of_server_range_is_a_config_error(tmp_path):
    from eagle3build.errors import ConfigError

    with FakeOpenAIServer() as server, pytest.raises(ConfigError, match="regenerate.temperature"):
        run(tmp_path, CONVERSATIONS[1:2], openai_params(server, temperature=2.5))
    assert not server.requests


# ---------------------------------------------------------------------------------------------------
# hf backend on a real (tiny) model



@pytest.fixture
def stories_target(tmp_path):
    if not STORIES.is_dir():
        pytest.skip(f"shared assets not found at {STORIES}")
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    return {
        "path": str(STORIES),
        "revision": None,
        "trust_remote_code": False,
        "chat_template": str(template),
    }


def reference_greedy(target: dict, messages: list[dict], max_new_tokens: int) -> str:
    """Unbatched greedy generate, written out by hand from transformers' own API."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target["path"])
    tokenizer.chat_template = Path(target["chat_template"]).read_text()
    model = AutoModelForCausalLM.from_pretrained(target["path"], dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new, skip_special_tokens=True)


def test_hf_batches_shortest_first_within_row_and_token_limits():
    backend = HFBackend.__new__(HFBackend)  # batching needs only the params
    backend.params = {"batch_size": 3, "batch_tokens": 100, "max_new_tokens": 10}
    lengths = [50, 5, 20, 6, 7, 95, 8]
    batches = backend.batches(lengths)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:  # padded to the batch's longest prompt, plus the answer budget
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * (max(lengths[i] for i in b) + 10) <= 100
    # rows cap [5, 6, 7]; [8, 20] fit 2 x 30; 50 alone (3 x 60 > 100); 95 alone, over budget but runs
    assert batches == [[1, 3, 4], [6, 2], [0], [5]]


def test_hf_backend_greedy_multi_turn_batched(tmp_path, stories_target, monkeypatch):
    calls = []
    answer = HFBackend.answer
    monkeypatch.setattr(HFBackend, "answer", lambda self, prompts, seed: calls.append(len(prompts)) or answer(self, prompts, seed))
    saved = []
    progress = PartialFile.append_progress
    monkeypatch.setattr(PartialFile, "append_progress",
                        lambda self, i, replay: saved.append((i, replay.turns_done)) or progress(self, i, replay))
    samples = [
        {
            "id": "a",
            "messages": [
                {"role": "user", "content": "Once upon a time there was a cat."},
                {"role": "assistant", "content": "OLD"},
                {"role": "user", "content": "What did the cat do?"},
            ],
        },
        {"id": "b", "messages": [{"role": "user", "content": "Lily went to the park with her mom."}]},
        {"id": "c", "messages": [{"role": "user", "content": "Tom had a red ball."}]},
    ]
    params = {"backend": "hf", "batch_size": 2, "max_new_tokens": 24, "device": "cpu"}
    out, report = run(tmp_path, samples, params, stories_target)
    assert (report["ok"], report["failed"], report["skipped"]) == (3, 0, 0)
    a = out[0]["messages"]
    assert [m["role"] for m in a] == ["user", "assistant", "user", "assistant"]
    assert "OLD" not in json.dumps(out)
    # Each batched, left-padded answer equals an unbatched greedy decode of the same context,
    # and turn 2 is answered after the model's own turn-1 answer.
    assert a[1]["content"] == reference_greedy(stories_target, a[:1], 24)
    assert a[3]["content"] == reference_greedy(stories_target, a[:3], 24)
    assert out[1]["messages"][1]["content"] == reference_greedy(stories_target, out[1]["messages"][:1], 24)
    assert out[2]["messages"][1]["content"] == reference_greedy(stories_target, out[2]["messages"][:1], 24)
    # A 24-token budget stops (almost) every story mid-sentence: the count must say so.
    assert report["truncated"] >= 1
    # Round 1 answers the three first turns (batches of 2), round 2 the one second turn;
    # the unfinished conversation's state after round 1 went to the partial file.
    assert calls == [2, 1, 1]
    assert saved == [(0, 1)]


def test_hf_backend_kill_mid_round_keeps_finished_batches(tmp_path, stories_target, monkeypatch, capsys):
    """A job killed in the middle of a turn's batches resumes with every batch finished before the kill."""
    samples = [{"id": str(i), "messages": [{"role": "user", "content": f"Story {i}: once upon a time"}]}
               for i in range(3)]
    params = {"backend": "hf", "batch_size": 1, "max_new_tokens": 8, "device": "cpu"}
    calls = []
    answer = HFBackend.answer

    def killed_on_third_call(self, prompts, seed):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise KeyboardInterrupt  # what a SIGINT from Snakemake looks like in the job
        return answer(self, prompts, seed)

    monkeypatch.setattr(HFBackend, "answer", killed_on_third_call)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, samples, params, stories_target)
    partial = read_jsonl(tmp_path / "out.jsonl.partial.jsonl")
    assert sum("result" in line for line in partial) == 2  # both finished batches, though the turn was not
    assert not (tmp_path / "out.jsonl").exists()
    log = capsys.readouterr().err
    assert "turn 1, batch 1/3: 1 conversations (1 finished, 2 left)" in log
    assert "batch 2/3" in log and "batch 3/3" not in log

    calls.clear()
    monkeypatch.setattr(HFBackend, "answer", lambda self, prompts, seed: calls.append(len(prompts)) or answer(self, prompts, seed))
    out, report = run(tmp_path, samples, params, stories_target)
    assert calls == [1]  # only the conversation the kill interrupted
    assert report["resumed"] == 2 and report["ok"] == 3
    assert [s["id"] for s in out] == ["0", "1", "2"]


def test_hf_backend_sampling_is_seeded(tmp_path, stories_target):
    samples = [{"id": "b", "messages": [{"role": "user", "content": "Lily went to the park."}]}]
    params = {"backend": "hf", "max_new_tokens": 16, "device": "cpu", "temperature": 1.0, "seed": 3}
    first, _ = run(tmp_path, samples, params, stories_target)
    again, _ = run(tmp_path, samples, params, stories_target)
    other, _ = run(tmp_path, samples, {**params, "seed": 4}, stories_target)
    assert first == again
    assert first != other


def test_hf_backend_without_template_is_a_user_error(tmp_path, stories_target):
    target = {**stories_target, "chat_template": None}
    with pytest.raises(UserError, match="target.chat_template"):
        run(tmp_path, CONVERSATIONS[1:2], {"backend": "hf", "device": "cpu"}, target)

"""Thinking targets and tokenizers without offsets, on the Kimi-like stand-in (tests/standins/kimi.py: a
slow tiktoken tokenizer loaded through auto_map remote code, a template that renders reasoning_content
as <think>…</think> only after the last user message): the loss mask, prepare.thinking, the doctor's
mask check, and regeneration that keeps reasoning and continues through tool calls."""

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_openai_server import FakeOpenAIServer  # noqa: E402
from standins.kimi import CHAT_TEMPLATE, write_tokenizer  # noqa: E402

from eagle3build.data.chat import (  # noqa: E402
    MaskError,
    conversation_samples,
    load_tokenizer,
    token_span_mask,
)
from eagle3build.data.prepare import tokenize_shard  # noqa: E402
from eagle3build.data.regenerate import HFBackend, regenerate_shard  # noqa: E402
from eagle3build.doctor.context import Context  # noqa: E402
from eagle3build.doctor.mask import check_mask  # noqa: E402
from eagle3build.doctor.target import check_tokenizer, check_trust_policy  # noqa: E402
from eagle3build.errors import ConfigError  # noqa: E402
from eagle3build.shards import read_tokens  # noqa: E402

EOT = "<|im_end|>"
THINKING = [
    {"role": "system", "content": "Think first."},
    {"role": "user", "content": "What is 6 times 7?"},
    {"role": "assistant", "content": "It is 42.", "reasoning_content": "6 times 7 is 42."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "How can I help you today?", "reasoning_content": "A greeting."},
]
CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
WITH_TOOL = [
    {"role": "user", "content": "The weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 degrees"},
    {"role": "assistant", "content": "Sunny, 21 degrees.", "reasoning_content": "The tool answered."},
]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def kimi(kimi_dir):
    tok = load_tokenizer(str(kimi_dir), trust_remote_code=True)
    assert not tok.is_fast  # no offsets: the token-id path is the one under test
    return tok


def runs_of(tok, item):
    """Decoded runs of masked tokens, and the unmasked text."""
    ids, mask = token_span_mask(tok, item.text, item.spans)
    runs, current, context = [], [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token)
        else:
            context.append(token)
            if current:
                runs.append(current)
                current = []
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs], tok.decode(context)


def test_kimi_mask_is_exactly_the_assistant_parts(kimi):
    [item] = conversation_samples(kimi, {"messages": THINKING})
    runs, context = runs_of(kimi, item)
    # history keeps an empty think block, the newest turn (after the last user message) its reasoning
    assert runs == [
        "<think></think>It is 42." + EOT,
        "<think>A greeting.</think>How can I help you today?" + EOT,
    ]
    assert context.endswith("<|im_assistant|>assistant<|im_middle|>")
    assert all(m["content"] in context for m in THINKING if m["role"] != "assistant")
    assert "6 times 7 is 42." not in item.text  # the template hides history reasoning


def test_kimi_tool_call_turns(kimi):
    [item] = conversation_samples(kimi, {"messages": WITH_TOOL, "tools": TOOLS})
    runs, context = runs_of(kimi, item)
    call = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    # both assistant turns follow the last user message: the template renders both reasonings
    assert runs == [
        "<think>Call the tool.</think>" + call + EOT,
        "<think>The tool answered.</think>Sunny, 21 degrees." + EOT,
    ]
    assert "sunny, 21 degrees" in context and "## Return of call_0" in context


def test_prepare_thinking_train_and_drop(kimi):
    conversation = {"messages": THINKING}
    first, whole = conversation_samples(kimi, conversation, "train")
    # the first turn's reasoning, hidden in history, is trained in its own sample, as it was generated
    assert runs_of(kimi, first)[0] == ["<think>6 times 7 is 42.</think>It is 42." + EOT]
    assert runs_of(kimi, whole)[0] == ["<think>A greeting.</think>How can I help you today?" + EOT]
    [dropped] = conversation_samples(kimi, conversation, "drop")
    assert runs_of(kimi, dropped)[0] == [
        "<think></think>It is 42." + EOT,
        "<think></think>How can I help you today?" + EOT,
    ]
    with pytest.raises(ConfigError, match="prepare.thinking"):
        conversation_samples(kimi, conversation, "sometimes")


def test_template_that_ignores_reasoning_gets_it_inside_the_content(kimi):
    plain = kimi.__class__.__new__(kimi.__class__)
    plain.__dict__.update(kimi.__dict__)
    plain.chat_template = (
        "{% for m in messages %}<|im_user|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_user|>assistant<|im_middle|>{% endif %}"
    )
    [item] = conversation_samples(plain, {"messages": THINKING})
    assert item.reasoning_as_text
    assert runs_of(plain, item)[0] == [
        "<think>6 times 7 is 42.</think>It is 42." + EOT,
        "<think>A greeting.</think>How can I help you today?" + EOT,
    ]


def test_boundary_inside_a_token_is_a_mask_error(kimi):
    # "th" + "e answer": BPE merges "the" across the generation prompt's end
    assert len(kimi("the", add_special_tokens=False)["input_ids"]) == 1
    text = "<|im_user|>user<|im_middle|>hi<|im_end|>A: the answer<|im_end|>"
    start = text.index("e answer")
    with pytest.raises(MaskError, match="inside a token"):
        token_span_mask(kimi, text, [(start, len(text))])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_tokens_stage_with_a_slow_remote_code_tokenizer(tmp_path, kimi_dir, kimi):
    template = tmp_path / "merging.jinja"  # the answer's first token merges with the prompt's end
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}th{% endif %}"
        "{{ m['content'] }}<|im_end|>{% endfor %}{% if add_generation_prompt %}assistant: th{% endif %}"
    )
    rows = [{"id": "t:0", "messages": THINKING}, {"id": "t:1", "messages": WITH_TOOL, "tools": TOOLS}]
    conversations = write_jsonl(tmp_path / "conv.jsonl", rows)
    tokenizer = {"path": str(kimi_dir), "revision": None, "trust_remote_code": True, "chat_template": None}
    out = tmp_path / "tokens.safetensors"
    report = tokenize_shard(conversations, str(out), str(tmp_path / "r.json"), tokenizer, 4096)
    assert report["samples_kept"] == 2 and report["thinking"] == "served" and not report["dropped"]
    assert report["tokenizer_class"] == "StandinTikTokenTokenizer"
    shard = read_tokens(str(out))
    ids, mask = (t.tolist() for t in shard.sample(0))
    [item] = conversation_samples(kimi, {"messages": THINKING})
    assert (ids, mask) == tuple(
        x if isinstance(x, list) else x.tolist() for x in token_span_mask(kimi, item.text, item.spans)
    )
    report = tokenize_shard(conversations, str(out), str(tmp_path / "r.json"), tokenizer, 4096, "train")
    assert report["samples_kept"] == 3 and report["samples_from_thinking_turns"] == 1
    # a template that puts a mask boundary inside a token: the samples are dropped with the reason
    merged = {
        "id": "t:2",
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "e end"}],
    }
    apart = {
        "id": "t:3",
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " fine"}],
    }
    tokenizer["chat_template"] = str(template)
    report = tokenize_shard(
        write_jsonl(tmp_path / "c2.jsonl", [merged, apart]),
        str(out),
        str(tmp_path / "r.json"),
        tokenizer,
        4096,
    )
    assert report["dropped"] == {"mask_boundary_inside_token": 1} and report["samples_kept"] == 1
    assert "inside a token" in report["dropped_examples"][0]["detail"]


def doctor_context(model, trust, **target):
    return Context({"target": {"model": str(model), "revision": None, "trust_remote_code": trust, **target}})


def test_doctor_mask_check(tmp_path, kimi_dir):
    ctx = doctor_context(kimi_dir, True)
    assert check_tokenizer(ctx).status == "ok"
    check = check_mask(ctx)
    assert check.status == "ok" and "token ids" in check.detail, check
    template = tmp_path / "unstable.jinja"
    # numbering turns from the end changes every earlier turn when one is appended
    template.write_text(
        "{% for m in messages %}[{{ messages|length - loop.index0 }}] {{ m['content'] }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}[A] {% endif %}"
    )
    ctx = doctor_context(kimi_dir, True, chat_template=str(template))
    check_tokenizer(ctx)
    check = check_mask(ctx)
    assert check.status == "fail" and "target.chat_template" in check.fix, check


SHARED = Path(__file__).resolve().parents[2] / "shared"
FAST = {
    "smollm2": Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct",
    "llama3_1": SHARED / "assets" / "tokenizers" / "llama3_1",
    "qwen3": SHARED / "assets" / "tokenizers" / "qwen3",
}


@pytest.mark.parametrize("name", sorted(FAST))
@pytest.mark.parametrize("thinking", ["served", "train"])
def test_doctor_mask_check_on_fast_tokenizers(name, thinking):
    if not FAST[name].is_dir():
        pytest.skip(f"{FAST[name]} is absent")
    ctx = doctor_context(FAST[name], False)
    ctx.config["prepare"] = {"thinking": thinking}
    assert check_tokenizer(ctx).status == "ok"
    started = time.perf_counter()
    check = check_mask(ctx)
    assert check.status == "ok" and "character offsets" in check.detail, check
    assert time.perf_counter() - started < 10  # seconds, not a run


def test_preflight_of_the_tokens_stage_checks_the_mask(tmp_path):
    from standins.kimi import vocab_size

    from eagle3build import doctor

    model = write_tokenizer(tmp_path / "kimi")
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "num_hidden_layers": 4,
                "hidden_size": 64,
                "vocab_size": vocab_size(),
            }
        )
    )
    config = {
        "target": {"model": str(model), "revision": None, "trust_remote_code": True},
        "prepare": {"thinking": "train"},
    }
    checks = {c.name: c for c in doctor.preflight(config, "tokens")}
    assert checks["mask"].status == "ok" and "prepare.thinking: train" in checks["mask"].detail


def test_doctor_does_not_run_an_untrusted_tokenizer(tmp_path, kimi_dir, monkeypatch):
    marker = tmp_path / "marker"
    monkeypatch.setenv("STANDIN_REMOTE_CODE_MARKER", str(marker))
    ctx = doctor_context(kimi_dir, False)
    checks = [check_trust_policy(ctx), check_tokenizer(ctx)]
    assert checks[1].status != "ok" and ctx.tokenizer is None
    assert any(c.status == "fail" and "target.trust_remote_code" in c.detail + c.fix for c in checks)
    assert check_mask(ctx).status == "skip"
    assert not marker.exists()


def test_hf_backend_splits_generated_thinking(kimi):
    backend = HFBackend.__new__(HFBackend)  # splitting needs only the tokenizer
    backend.tokenizer = kimi
    backend.think = backend.think_tokens()
    enc = lambda text: kimi(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    tokens = enc("<think>6 times 7 is 42.</think>It is 42.")
    assert backend.split_reasoning(tokens, False) == ("It is 42.", "6 times 7 is 42.")
    assert backend.split_reasoning(enc("<think>6 times"), True) == ("", "6 times")  # cut while thinking
    assert backend.split_reasoning(enc("It is 42."), False) == ("It is 42.", None)
    backend.think = None  # a tokenizer without <think>/</think> tokens: the text stays as it is
    assert backend.split_reasoning(enc("It is 42."), False) == ("It is 42.", None)


def test_hf_backend_answer_keeps_the_reasoning(kimi):
    """`answer` on a model whose generate writes a Kimi thinking turn: reasoning and content apart."""
    import torch

    enc = lambda text: kimi(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    written = enc("<think>6 times 7 is 42.</think>It is 42.<|im_end|>[PAD][PAD]")

    class Model:
        def generate(self, input_ids, attention_mask, generation_config):
            return torch.cat([input_ids, torch.tensor([written] * len(input_ids))], dim=1)

    backend = HFBackend.__new__(HFBackend)
    backend.torch, backend.device, backend.model, backend.tokenizer = torch, "cpu", Model(), kimi
    backend.params = {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0}
    backend.eos = [kimi.convert_tokens_to_ids("<|im_end|>")]
    kimi.padding_side = "left"
    backend.think = backend.think_tokens()
    prompt = enc(
        "<|im_user|>user<|im_middle|>What is 6 times 7?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    assert backend.answer([prompt], seed=0) == [("It is 42.", False, "6 times 7 is 42.")]


def openai_params(server, **overrides):
    return {
        "backend": "openai",
        "url": server.url + "/v1",
        "concurrency": 2,
        "timeout_s": 5.0,
        "max_retries": 1,
        "retry_backoff_s": 0.01,
        "max_new_tokens": 64,
        **overrides,
    }


def regenerate(tmp_path, samples, params):
    out, report = tmp_path / "out.jsonl", tmp_path / "out.json"
    result = regenerate_shard(
        write_jsonl(tmp_path / "in.jsonl", samples), str(out), str(report), {"path": "unused"}, params
    )
    return [json.loads(line) for line in out.read_text().splitlines()], result


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_regenerate_keeps_reasoning(tmp_path, field, kimi):
    samples = [
        {
            "id": "q",
            "messages": [
                {"role": "user", "content": "What is 6 times 7?"},
                {"role": "assistant", "content": "OLD"},
            ],
        }
    ]
    with FakeOpenAIServer() as server:
        server.reasoning_field = field  # vLLM's name, and SGLang's (vLLM's before it was renamed)
        out, report = regenerate(tmp_path, samples, openai_params(server))
    answer = out[0]["messages"][1]
    assert answer["reasoning_content"] == "thinking about: What is 6 times 7?"
    assert report["with_reasoning"] == 1
    [item] = conversation_samples(kimi, out[0])
    assert runs_of(kimi, item)[0] == [f"<think>{answer['reasoning_content']}</think>{answer['content']}{EOT}"]


def test_regenerate_continues_through_tool_calls(tmp_path):
    continued = {
        "id": "tool:0",
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "OLD"},
            {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "OLD"},
        ],
    }
    other = {**CALL, "function": {"name": "get_time", "arguments": "{}"}}
    unknown = {
        "id": "tool:1",
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "weather in Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [other]},
            {"role": "tool", "content": "noon"},
            {"role": "user", "content": "thanks"},
        ],
    }
    with FakeOpenAIServer() as server:
        server.tool_call_when = "weather"
        server.reasoning_field = "reasoning"
        out, report = regenerate(tmp_path, [continued, unknown], openai_params(server))
    messages = out[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    call = messages[1]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and messages[1]["reasoning_content"]
    # the dataset's result answers the target's own call
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": call["id"]}
    assert messages[3]["content"] == "tool said: sunny"
    # the request after the tool result carried the call's thinking under both names servers read
    after_tool = next(r for r in server.requests if r["messages"][-1]["role"] == "tool")
    sent = after_tool["messages"][1]
    assert sent["reasoning"] == sent["reasoning_content"] == messages[1]["reasoning_content"]
    assert "OLD" not in json.dumps(out)
    # no result in the dataset for the call the target made: the conversation stops at the call
    assert [m["role"] for m in out[1]["messages"]] == ["user", "assistant"]
    assert out[1]["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert report["stopped_at_tool_call"] == 1 and report["tool_results_replayed"] == 1


def test_kimi_template_is_the_standin_template(kimi):
    assert kimi.chat_template == CHAT_TEMPLATE


def test_replay_resumes_between_a_tool_result_and_the_answer():
    from eagle3build.data.replay import Replay

    sample = {"messages": WITH_TOOL + [{"role": "user", "content": "thanks"}]}
    replay = Replay(sample)
    replay.next_prompt()
    replay.add_answer("", False, [{**CALL, "id": "new_0"}], reasoning="Call the tool.")
    saved = json.loads(json.dumps(replay.state()))  # through the partial file
    resumed = Replay(sample).restore(saved)
    prompt = resumed.next_prompt()
    assert prompt[-1] == {"role": "tool", "tool_call_id": "new_0", "content": "sunny, 21 degrees"}
    assert prompt[-2]["reasoning_content"] == "Call the tool."
    resumed.add_answer("Sunny.", False)  # answers the same user turn; the next prompt is the next user turn
    assert resumed.next_prompt()[-1] == {"role": "user", "content": "thanks"}
    resumed.add_answer("You're welcome.", False)
    assert resumed.next_prompt() is None
    result = resumed.result()
    assert result["tool_results"] == 1 and not result["stopped_at_tool_call"]

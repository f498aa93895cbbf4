"""The assistant-only loss mask on real chat templates: the masked tokens decode to exactly each
assistant turn as the target generates it, closed by its end-of-turn token, and to nothing else."""

import json
from pathlib import Path

import pytest

from eagle3build.data.chat import (
    _overlap,
    char_spans_to_mask,
    conversation_samples,
    load_tokenizer,
    render_conversation,
    token_span_mask,
)
from eagle3build.data.formats import Record, normalize
from eagle3build.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared"
TOKENIZERS = SHARED / "assets" / "tokenizers"
SMOLLM2 = REPO / "models" / "SmolLM2-135M-Instruct"
GLAIVE = SHARED / "assets" / "data" / "train" / "glaive_toolcall_en_demo.json"

# The closing marker each template puts after an assistant turn, and what the newest turn starts with.
TEMPLATES = {
    "llama3_1": (TOKENIZERS / "llama3_1", "<|eot_id|>", ""),
    "qwen3": (TOKENIZERS / "qwen3", "<|im_end|>", "<think>\n\n</think>\n\n"),
    "smollm2": (SMOLLM2, "<|im_end|>", ""),
}

WITH_SYSTEM = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is the boiling point of water?"},
    {"role": "assistant", "content": "Water boils at 100 degrees Celsius at sea level."},
    {"role": "user", "content": "And at the top of Everest?"},
    {"role": "assistant", "content": "Only about 70 degrees, because the air pressure is much lower."},
]
WITHOUT_SYSTEM = WITH_SYSTEM[1:]  # SmolLM2 injects its default system prompt here


def tokenizer_for(name):
    path, eot, newest = TEMPLATES[name]
    if not path.is_dir():
        pytest.skip(f"{path} is absent (needs ../shared, or `python -m eagle3build.smollm2` for SmolLM2)")
    return load_tokenizer(str(path)), eot, newest


def masked_runs(tok, conversation):
    """Decode each maximal run of masked tokens."""
    rendered = render_conversation(tok, conversation)
    enc = tok(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
    mask = char_spans_to_mask(enc["offset_mapping"], rendered.spans)
    runs, current = [], []
    for token, trained in zip(enc["input_ids"], mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs], enc["input_ids"], mask, rendered


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("messages", [WITH_SYSTEM, WITHOUT_SYSTEM], ids=["system", "default_system"])
def test_mask_is_exactly_the_assistant_turns(name, messages):
    tok, eot, newest = tokenizer_for(name)
    runs, ids, mask, rendered = masked_runs(tok, {"messages": messages})
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    expected = [a + eot for a in answers[:-1]] + [newest + answers[-1] + eot]
    assert runs == expected
    # nothing of the prompt side is trained: the unmasked text still holds every system/user message
    context = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert all(m["content"] in context for m in messages if m["role"] != "assistant")
    assert not any(a in context for a in answers)
    if name == "smollm2" and messages is WITHOUT_SYSTEM:
        assert "You are a helpful AI assistant named SmolLM" in context  # the injected default system text


def test_qwen3_rewrites_earlier_reasoning_turns():
    tok, eot, _ = tokenizer_for("qwen3")
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6."},
    ]
    runs, *_ = masked_runs(tok, {"messages": messages})
    # history drops the earlier reasoning (the template rewrites that turn); the newest keeps it
    assert runs == ["4." + eot, "<think>\nadd again\n</think>\n\n6." + eot]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tool_call_conversation_from_glaive(name):
    tok, eot, newest = tokenizer_for(name)
    if not GLAIVE.is_file():
        pytest.skip("needs ../shared/assets/data")
    record = json.loads(GLAIVE.read_text())[0]
    conversation, _ = normalize(Record(record, "glaive[0]"), "sharegpt")
    runs, _, _, rendered = masked_runs(tok, conversation)
    assistant = [m for m in conversation["messages"] if m["role"] == "assistant"]
    expected = []
    for k, message in enumerate(assistant):
        if message.get("tool_calls"):
            call = message["tool_calls"][0]["function"]
            payload = json.dumps({"name": call["name"], "arguments": call["arguments"]})
            # qwen3 renders the call natively; templates without tool support get it as JSON text
            body = f"<tool_call>\n{payload}\n</tool_call>" if name == "qwen3" else payload
        else:
            body = message["content"]
        expected.append((newest if k == len(assistant) - 1 else "") + body + eot)
    assert runs == expected
    assert rendered.calls_as_text == (name != "qwen3")
    tool_output = next(m["content"] for m in conversation["messages"] if m["role"] == "tool")
    assert all(tool_output not in r for r in runs)


def test_template_file_overrides_and_missing_template_is_a_config_error(tmp_path):
    stories = SHARED / "assets" / "models" / "stories260K"
    if not stories.is_dir():
        pytest.skip("needs ../shared/assets/models/stories260K")
    with pytest.raises(ConfigError, match=r"target\.chat_template.*no chat template"):
        load_tokenizer(str(stories))
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tok = load_tokenizer(str(stories), chat_template=str(template))
    runs, *_ = masked_runs(
        tok,
        {
            "messages": [
                {"role": "user", "content": "Once upon a time"},
                {"role": "assistant", "content": "there was a cat."},
            ]
        },
    )
    assert runs == ["there was a cat.</s>"]
    with pytest.raises(ConfigError, match=r"target\.chat_template.*not found"):
        load_tokenizer(str(stories), chat_template=str(tmp_path / "missing.jinja"))


def test_remote_code_tokenizer_needs_trust_remote_code(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "auto_map": {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]},
                "tokenizer_class": "CustomTokenizer",
            }
        )
    )
    (tmp_path / "tokenization_custom.py").write_text("raise RuntimeError('remote code must not run')\n")
    with pytest.raises(ConfigError, match=r"target\.trust_remote_code"):
        load_tokenizer(str(tmp_path), trust_remote_code=False)


def test_unstable_template_is_reported():
    tok, *_ = tokenizer_for("smollm2")
    # a template that numbers turns from the end changes every earlier turn when one is appended
    tok.chat_template = (
        "{% for m in messages %}[{{ messages|length - loop.index0 }}] {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}[A] {% endif %}"
    )
    with pytest.raises(UserError, match="not prefix-stable"):
        render_conversation(tok, {"messages": WITHOUT_SYSTEM})


def test_overlap_and_mask_helpers():
    assert _overlap("<think></think>answer<end>\n", "answer<end>\nuser: hi") == len("answer<end>\n")
    assert _overlap("abc", "xyz") == 0
    assert _overlap("aab", "aabaab") == 3
    mask = char_spans_to_mask([(0, 3), (3, 5), (5, 5), (5, 9)], [(3, 6)])
    assert mask.tolist() == [0, 1, 1, 1]


THINKING_IN_CONTENT = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4."},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6."},
]
THINKING_FIELD = [
    {"role": "system", "content": "Think first."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "add them"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6.", "reasoning_content": "add again"},
]


def shapes():
    """Every conversation shape of this file: system, default system, multi-turn, thinking, tool calls."""
    out = {"system": WITH_SYSTEM, "default_system": WITHOUT_SYSTEM, "thinking_in_content": THINKING_IN_CONTENT,
           "thinking_field": THINKING_FIELD}
    if GLAIVE.is_file():
        out["glaive_tool_call"] = normalize(Record(json.loads(GLAIVE.read_text())[0], "glaive[0]"), "sharegpt")[0]["messages"]
    return out


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("thinking", ["served", "train", "drop"])
def test_token_id_mask_equals_the_offsets_mask(name, thinking):
    """The mask built without offsets (for slow tokenizers) is the offsets mask, token for token."""
    tok, *_ = tokenizer_for(name)
    compared = 0
    for shape, messages in shapes().items():
        for item in conversation_samples(tok, {"messages": messages}, thinking):
            enc = tok(item.text, add_special_tokens=False, return_offsets_mapping=True)
            ids, mask = token_span_mask(tok, item.text, item.spans)
            assert ids == enc["input_ids"], shape
            assert mask.tolist() == char_spans_to_mask(enc["offset_mapping"], item.spans).tolist(), shape
            assert mask.any()
            compared += 1
    assert compared >= 5


def test_qwen3_renders_reasoning_content_only_in_the_newest_turn():
    tok, eot, _ = tokenizer_for("qwen3")
    runs, *_ = masked_runs(tok, {"messages": THINKING_FIELD})
    assert runs == ["4." + eot, "<think>\nadd again\n</think>\n\n6." + eot]


def test_token_id_mask_with_a_dummy_prefix_tokenizer(tmp_path):
    """SentencePiece adds a space to every call, so the pieces between boundaries do not spell the
    text apart: each boundary is then checked by the ids of the text before it. Where that holds (after
    a newline) the mask is the offsets mask; where the answer's first token absorbs the prompt's last
    space it is a MaskError, never a wrong mask."""
    from eagle3build.data.chat import MaskError

    stories = SHARED / "assets" / "models" / "stories260K"
    if not stories.is_dir():
        pytest.skip("needs ../shared/assets/models/stories260K")
    template = tmp_path / "newline.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:\n{% endif %}"
    )
    tok = load_tokenizer(str(stories), chat_template=str(template))
    conversation = {"messages": [
        {"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": "there was a cat."},
        {"role": "user", "content": "Then?"}, {"role": "assistant", "content": "It slept."},
    ]}
    item = render_conversation(tok, conversation)
    pieces = tok([item.text[: item.spans[0][0]], item.text[item.spans[0][0] :]], add_special_tokens=False)
    whole = tok(item.text, add_special_tokens=False, return_offsets_mapping=True)
    assert sum(pieces["input_ids"], []) != whole["input_ids"]  # the pieces apart are not the whole
    ids, mask = token_span_mask(tok, item.text, item.spans)
    assert ids == whole["input_ids"]
    assert mask.tolist() == char_spans_to_mask(whole["offset_mapping"], item.spans).tolist()
    tok.chat_template = template.read_text().replace(":\n", ": ")
    item = render_conversation(tok, conversation)
    with pytest.raises(MaskError, match="inside a token"):
        token_span_mask(tok, item.text, item.spans)

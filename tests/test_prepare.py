"""The tokens stage (tokenize_shard) and the mask viewer, on the shipped demo data."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3build.data.formats import count_records
from eagle3build.data.prepare import format_sample, split_dataset, tokenize_shard
from eagle3build.errors import UserError
from eagle3build.shardplan import plan_shards
from eagle3build.shards import read_tokens

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared"
QWEN3 = SHARED / "assets" / "tokenizers" / "qwen3"
DEMO = REPO / "data" / "demo"

torch.set_num_threads(1)


def tokenizer_config(path=QWEN3, chat_template=None):
    if not Path(path).is_dir():
        pytest.skip(f"{path} is absent (needs ../shared)")
    return {"path": str(path), "revision": None, "trust_remote_code": False, "chat_template": chat_template}


def write_conversations(path, conversations):
    path.write_text("".join(json.dumps({"id": f"t:{i}", **c}) + "\n" for i, c in enumerate(conversations)))
    return str(path)


def chat(*turns):
    return {"messages": [{"role": role, "content": text} for role, text in turns]}


def test_demo_data_shape():
    conversations = [json.loads(line) for line in (DEMO / "conversations.jsonl").read_text().splitlines()]
    assert 150 <= len(conversations) <= 200
    assert len({json.dumps(c) for c in conversations}) == len(conversations)  # no duplicates
    assert sum(c["messages"][0]["role"] == "system" for c in conversations) >= 30
    assert sum(sum(m["role"] == "assistant" for m in c["messages"]) > 1 for c in conversations) >= 30
    questions = [json.loads(line) for line in (DEMO / "eval_questions.jsonl").read_text().splitlines()]
    assert 20 <= len(questions) <= 30 and len({q["category"] for q in questions}) >= 3
    assert any(len(q["turns"]) == 2 for q in questions)
    prompts = {m["content"] for c in conversations for m in c["messages"] if m["role"] == "user"}
    assert not prompts & {t for q in questions for t in q["turns"]}  # held out


def test_demo_split_and_tokens_end_to_end(tmp_path):
    tokenizer = tokenizer_config()
    source = str(DEMO / "conversations.jsonl")
    n = plan_shards(count_records(source), 100, None)
    shards = [str(tmp_path / "data" / f"{i:05d}.jsonl") for i in range(n)]
    split = split_dataset(source, "auto", shards, 100, None, None, "demo")
    assert split["conversations_written"] == count_records(source) and not split["skipped"]

    out, report_path = tmp_path / "tokens.safetensors", tmp_path / "tokens.json"
    report = tokenize_shard(shards[0], str(out), str(report_path), tokenizer, max_length=512)
    assert json.loads(report_path.read_text()) == report
    assert report["samples_in"] == report["samples_kept"] == 100 and report["dropped"] == {}
    assert report["tokenizer_class"] == "Qwen2Tokenizer"
    shard = read_tokens(out)
    assert shard.num_samples == 100 and shard.meta["max_length"] == 512
    assert shard.meta["tokenizer"] == str(QWEN3) and shard.meta["tokenizer_class"] == "Qwen2Tokenizer"
    assert report["tokens"] == len(shard.input_ids) and report["loss_tokens"] == int(shard.loss_mask.sum())
    assert 60 <= report["tokens"] / 100 <= 150
    # every sample starts with context (the prompt) and ends with a trained end-of-turn token
    end_of_turn = 151645  # <|im_end|>
    for i in range(shard.num_samples):
        ids, mask = shard.sample(i)
        assert mask[0] == 0 and mask.any()
        assert ids[mask.bool()][-1] == end_of_turn
    # deterministic: a second run writes the same tensors and metadata
    again = tmp_path / "again.safetensors"
    tokenize_shard(shards[0], str(again), str(tmp_path / "again.json"), tokenizer, max_length=512)
    second = read_tokens(again)
    assert second.meta == shard.meta
    assert all(
        torch.equal(getattr(second, k), getattr(shard, k)) for k in ("input_ids", "loss_mask", "cu_seqlens")
    )


def test_truncation_and_drop_reasons(tmp_path):
    tokenizer = tokenizer_config()
    long_prompt = "tell me a story " * 40
    conversations = [
        chat(("user", "Hi"), ("assistant", "Hello! How can I help today?")),  # kept whole
        chat(("user", "Hi"), ("assistant", "word " * 200)),  # truncated, still has loss tokens
        chat(("user", long_prompt), ("assistant", "Once upon a time.")),  # answer cut away entirely
        chat(("user", "Only a question")),  # prompts only
    ]
    path = write_conversations(tmp_path / "c.jsonl", conversations)
    report = tokenize_shard(
        path, str(tmp_path / "t.safetensors"), str(tmp_path / "t.json"), tokenizer, max_length=64
    )
    assert report["samples_in"] == 4 and report["samples_kept"] == 2
    assert report["dropped"] == {"no_loss_tokens": 1, "no_assistant_turn": 1}
    assert {e["id"]: e["reason"] for e in report["dropped_examples"]} == {
        "t:2": "no_loss_tokens",
        "t:3": "no_assistant_turn",
    }
    assert report["truncated"] == 2
    shard = read_tokens(tmp_path / "t.safetensors")
    assert shard.lengths[1] == 64 and shard.lengths[0] < 64
    assert bool(shard.sample(1)[1][-1])  # the cut answer is trained up to the last kept token


def test_template_errors_drop_samples_or_fail_the_shard(tmp_path):
    template = tmp_path / "strict.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer = tokenizer_config(chat_template=str(template))
    ok, bad = (
        chat(("user", "a"), ("assistant", "b")),
        chat(("system", "s"), ("user", "a"), ("assistant", "b")),
    )
    path = write_conversations(tmp_path / "c.jsonl", [ok, bad])
    report = tokenize_shard(path, str(tmp_path / "t.safetensors"), str(tmp_path / "t.json"), tokenizer, 64)
    assert report["samples_kept"] == 1 and report["dropped"] == {"template_error": 1}
    assert "no system" in report["dropped_examples"][0]["detail"]
    path = write_conversations(tmp_path / "d.jsonl", [bad, bad])
    with pytest.raises(UserError, match="template failed on every conversation.*target.chat_template"):
        tokenize_shard(path, str(tmp_path / "u.safetensors"), str(tmp_path / "u.json"), tokenizer, 64)
    assert not (tmp_path / "u.safetensors").exists() and not (tmp_path / "u.json").exists()


def test_tools_render_in_vllms_form_and_bad_ones_drop_the_sample(tmp_path):
    """A shard written before tools were normalised (glaive's bare {name, ...}): the template gets each
    tool as vLLM renders it while the target answers; a tool without a name drops only its sample."""
    from transformers import AutoTokenizer

    tokenizer = tokenizer_config()
    bare = {"name": "search_recipes", "description": "Find recipes", "parameters": {"type": "object"}}
    good = {**chat(("user", "a recipe?"), ("assistant", "Try rice.")), "tools": json.dumps([bare])}
    bad = {**chat(("user", "a recipe?"), ("assistant", "Try rice.")), "tools": [{"description": "no name"}]}
    path = write_conversations(tmp_path / "c.jsonl", [good, bad])
    report = tokenize_shard(path, str(tmp_path / "t.safetensors"), str(tmp_path / "t.json"), tokenizer, 512)
    assert report["samples_kept"] == 1 and report["dropped"] == {"bad_tools": 1}
    assert report["dropped_examples"][0]["id"] == "t:1"
    assert "tools[0] has no function name" in report["dropped_examples"][0]["detail"]
    qwen3 = AutoTokenizer.from_pretrained(str(QWEN3))
    text = qwen3.decode(read_tokens(tmp_path / "t.safetensors").sample(0)[0].tolist())
    assert json.dumps({"type": "function", "function": {**bare}}, ensure_ascii=False) in text


def test_format_sample_marks_trained_runs():
    pieces = ["<s>", "Q", ":", " hi", "A", ":", " yo", "</s>"]
    mask = [0, 0, 0, 0, 0, 0, 1, 1]
    assert format_sample(pieces, mask, color=False) == "<s>Q: hiA:[[ yo</s>]]"
    colored = format_sample(pieces, mask, color=True)
    assert "\x1b[" in colored and "[[" not in colored


def test_show_cli_plain_output(tmp_path):
    tokenizer = tokenizer_config()
    path = write_conversations(
        tmp_path / "c.jsonl",
        [
            chat(("user", "Name a colour."), ("assistant", "Blue.")),
            chat(
                ("system", "Be brief."),
                ("user", "2+2?"),
                ("assistant", "4."),
                ("user", "3+3?"),
                ("assistant", "6."),
            ),
        ],
    )
    tokens = tmp_path / "t.safetensors"
    tokenize_shard(path, str(tokens), str(tmp_path / "t.json"), tokenizer, 128)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3build.data.prepare",
            "show",
            str(tokens),
            "--index",
            "1",
            "--tokenizer",
            str(QWEN3),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    text, legend = result.stdout.rstrip("\n").rsplit("\n", 1)
    assert "\x1b[" not in result.stdout  # not a TTY: no colour codes
    assert text.count("[[") == 2
    assert "[[4.<|im_end|>]]" in text and "[[<think>\n\n</think>\n\n6.<|im_end|>]]" in text
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text
    shard = read_tokens(tokens)
    ids, mask = shard.sample(1)
    assert f"{len(ids)} tokens, {int(mask.sum())} trained" in legend and "[[...]]" in legend
    config = tmp_path / "config.yaml"
    config.write_text("target:\n  model: x\n  trust_remote_code: false\n")
    via_make = subprocess.run(  # `make show` passes the workflow config; the shard names its tokenizer
        [
            sys.executable,
            "-m",
            "eagle3build.data.prepare",
            "show",
            str(tokens),
            "--index",
            "1",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert via_make.returncode == 0 and via_make.stdout == result.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "eagle3build.data.prepare", "show", str(tokens), "--index", "9"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert bad.returncode == 2 and "out of range; the shard has 2 samples" in bad.stderr


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_one_job_per_shard_writes_what_one_job_for_all_writes(tmp_path, suffix):
    """The workflow splits shard by shard; each shard must equal the same shard of a whole-dataset split."""
    records = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
               for i in range(11)]
    records[4] = {"messages": []}  # skipped: leaves a gap, shifts nothing
    src = tmp_path / f"d{suffix}"
    src.write_text("\n".join(json.dumps(r) for r in records) if suffix == ".jsonl" else json.dumps(records))
    whole = [str(tmp_path / f"whole-{i}.jsonl") for i in range(3)]
    split_dataset(str(src), "auto", whole, 4, None, None, "d")
    for i in range(3):
        part = str(tmp_path / f"part-{i}.jsonl")
        split_dataset(str(src), "auto", [part], 4, None, None, "d", first_shard=i, total_shards=3)
        assert Path(part).read_text() == Path(whole[i]).read_text()
    assert [json.loads(x)["id"] for x in Path(whole[1]).read_text().splitlines()] == ["d:5", "d:6", "d:7"]
    with pytest.raises(UserError, match="changed since the workflow was planned"):
        split_dataset(str(src), "auto", [str(tmp_path / "x.jsonl")], 4, None, None, "d", first_shard=1,
                      total_shards=2)

"""Dataset readers: every format and container, the shared training files, bad input, streaming memory."""

import gzip
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle3build.data.formats import count_records, iter_conversations
from eagle3build.data.prepare import split_dataset
from eagle3build.errors import ConfigError, UserError
from eagle3build.shardplan import plan_shards

SHARED = Path(__file__).resolve().parents[2] / "shared"
TRAIN = SHARED / "assets" / "data" / "train"
EVAL = SHARED / "assets" / "data" / "eval"
REPO = Path(__file__).resolve().parents[1]


def conversations(source, fmt="auto", split=None):
    """The normalized conversations of a source (skipped records left out)."""
    return [c for _, _, c, _ in iter_conversations(str(source), fmt, split) if isinstance(c, dict)]


def write_jsonl(path, records, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------- formats
def test_sharegpt_roles_tools_and_function_calls(tmp_path):
    record = {
        "conversations": [
            {"from": "system", "value": "Be nice."},
            {"from": "human", "value": "Weather in Oslo?"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'},
            {"from": "observation", "value": '{"temp": 3}'},
            {"from": "gpt", "value": "It is 3 degrees."},
        ],
        "tools": json.dumps([{"name": "get_weather", "parameters": {}}]),
    }
    [conv] = conversations(write_jsonl(tmp_path / "a.jsonl", [record]))
    assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    call = conv["messages"][2]
    assert call["content"] == ""
    assert call["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    assert conv["messages"][3]["content"] == '{"temp": 3}'
    # stored in OpenAI's form, as vLLM validates and renders it (eagle3build/data/tools.py)
    assert conv["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": None, "parameters": {}}}
    ]


def test_tool_definitions_in_every_shape_become_vllms_form():
    from eagle3build.data.tools import ToolError, openai_tools

    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    expected = {"type": "function", "function": {"name": "f", "description": "d", "parameters": schema}}
    bare = {"name": "f", "description": "d", "parameters": schema}
    shapes = [
        [expected],  # OpenAI's form, as is
        [{"function": bare}],  # "type" left out, as vLLM allows
        [bare],  # glaive / LLaMA-Factory / xLAM
        [{"type": "function", **bare}],  # the Responses API's flat form
        json.dumps([bare]),  # the whole list as a JSON string
        [json.dumps(bare)],  # one tool as a JSON string
        [{**bare, "parameters": json.dumps(schema)}],  # the schema as a JSON string
        [{**bare, "function": None, "type": None}],  # an Arrow row of mixed shapes
        bare,  # one tool, not in a list
    ]
    for tools in shapes:
        assert openai_tools(tools) == [expected], tools
    # model_dump()'s key order (templates write tools with tojson): declared fields, absent ones as None,
    # "strict" only when set, then extra keys
    [tool] = openai_tools([{"x-extra": 1, "name": "g", "strict": True}])
    assert list(tool) == ["type", "function"]
    assert list(tool["function"].items()) == [
        ("name", "g"), ("description", None), ("parameters", None), ("strict", True), ("x-extra", 1)]
    assert openai_tools(openai_tools([tool])) == [tool]  # idempotent: the tokens stage renders stored tools
    assert openai_tools("[]") is None and openai_tools(None) is None
    for bad, words in [
        ([{"description": "no name"}], "tools[0] has no function name"),
        ([{"type": "custom", "name": "f"}], "only 'function' tools"),
        ([{"name": "f", "parameters": [1]}], "'parameters' must be a JSON schema object"),
        ("{not json", "is a string but not JSON"),
    ]:
        with pytest.raises(ToolError, match=re.escape(words)):
            openai_tools(bad)


def test_bad_tool_definition_names_the_record(tmp_path):
    record = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}],
              "tools": json.dumps([{"description": "nameless"}])}
    with pytest.raises(UserError, match=r"b\.jsonl line 1: field 'tools': tools\[0\] has no function name"):
        conversations(write_jsonl(tmp_path / "b.jsonl", [record]))


def test_sharegpt_dpo_uses_chosen(tmp_path):
    record = {
        "conversations": [{"from": "human", "value": "Q"}],
        "chosen": {"from": "gpt", "value": "good"},
        "rejected": {"from": "gpt", "value": "bad"},
    }
    [conv] = conversations(write_jsonl(tmp_path / "dpo.jsonl", [record]))
    assert conv["messages"] == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "good"}]


def test_openai_alpaca_hh_questions(tmp_path):
    [c] = conversations(
        write_jsonl(
            tmp_path / "o.jsonl",
            [
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                        {"role": "assistant", "content": "Yo"},
                    ],
                    "label": True,
                }
            ],
        )
    )
    assert c["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]

    [c] = conversations(
        write_jsonl(
            tmp_path / "al.jsonl",
            [{"system": "S", "history": [["h1", "a1"]], "instruction": "Sum", "input": "1 2", "output": "3"}],
        )
    )
    assert c["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "h1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "Sum\n\n1 2"},
        {"role": "assistant", "content": "3"},
    ]

    [c] = conversations(
        write_jsonl(
            tmp_path / "hh.jsonl",
            [
                {
                    "chosen": "\n\nHuman: one\n\nAssistant: two\n\nHuman: three\n\nAssistant: four",
                    "rejected": "x",
                }
            ],
        )
    )
    assert c["messages"] == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four"},
    ]
    [c] = conversations(write_jsonl(tmp_path / "text.jsonl", [{"text": "Human: a\n\nAssistant: b"}]))
    assert [m["role"] for m in c["messages"]] == ["user", "assistant"]

    [q, d, s] = conversations(
        write_jsonl(
            tmp_path / "q.jsonl",
            [
                {"question_id": 1, "category": "x", "turns": ["first", "second"]},
                {"class": " Vicuna ", "data": ["p1", "p2"]},
                {"class": "c", "data": "only"},
            ],
        )
    )
    assert q["messages"] == [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}]
    assert [m["content"] for m in d["messages"]] == ["p1", "p2"]
    assert s["messages"] == [{"role": "user", "content": "only"}]


def test_json_list_jsonl_and_gzip_agree(tmp_path):
    records = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(5)]
    (tmp_path / "l.json").write_text(json.dumps(records, indent=1))
    with gzip.open(tmp_path / "l.json.gz", "wt") as f:
        json.dump(records, f)
    sources = [
        tmp_path / "l.json",
        tmp_path / "l.json.gz",
        write_jsonl(tmp_path / "l.jsonl", records),
        write_jsonl(tmp_path / "l.jsonl.gz", records, gz=True),
    ]
    results = [conversations(s) for s in sources]
    assert all(r == results[0] for r in results) and len(results[0]) == 5
    assert [count_records(str(s)) for s in sources] == [5, 5, 5, 5]


def test_hf_sources(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(7)
    ]
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    for source in (f"hf:{saved}", str(saved)):
        assert count_records(source) == 7
        got = conversations(source)
        assert [c["messages"][0]["content"] for c in got] == [f"q{i}" for i in range(7)]
    # a folder of data files goes through datasets.load_dataset (like a hub id does)
    files = tmp_path / "files"
    files.mkdir()
    write_jsonl(files / "train.jsonl", rows)
    assert len(conversations(f"hf:{files}")) == 7
    with pytest.raises(UserError, match="cannot load the Hugging Face dataset"):
        count_records(f"hf:{tmp_path / 'missing'}")


@pytest.mark.skipif(
    not TRAIN.is_dir(), reason="needs ../shared/assets/data (a full checkout with shared assets)"
)
@pytest.mark.parametrize(
    "name, expected, at_least",
    [
        ("alpaca_en_demo.json", 999, 999),
        ("glaive_toolcall_en_demo.json", 300, 300),
        ("dpo_en_demo.json", 300, 300),
        ("kto_en_demo.json", 300, 300),
        ("hh_rlhf_harmless_base_test.jsonl.gz", 2312, 2290),
        ("ultrachat_eval_prompts.json", 385, 385),
        ("alpaca_eval/gpt4.json", 805, 805),
        ("alpaca_eval/claude-3-opus-20240229.json", 805, 805),
        ("alpaca_eval/Meta-Llama-3-70B-Instruct.json", 805, 805),
        ("alpaca_eval/example_outputs.json", 805, 805),
        ("alpaca_eval/gpt4_1106_preview.json", 805, 805),
    ],
)
def test_shared_training_files_load(name, expected, at_least):
    source = TRAIN / name
    assert count_records(str(source)) == expected
    convs = conversations(source)
    assert at_least <= len(convs) <= expected
    for conv in convs:
        roles = [m["role"] for m in conv["messages"]]
        assert roles and set(roles) <= {"system", "user", "assistant", "tool"}
    answered = sum(
        any(m["role"] == "assistant" and (m["content"] or m.get("tool_calls")) for m in c["messages"])
        for c in convs
    )
    # prompt files have no answers; hh-rlhf has a few prompts whose last "Assistant:" is empty
    assert answered == 0 if name == "ultrachat_eval_prompts.json" else answered >= 0.99 * len(convs)


@pytest.mark.skipif(not TRAIN.is_dir(), reason="needs ../shared/assets/data")
def test_shared_glaive_tool_calls_and_eval_questions():
    convs = conversations(TRAIN / "glaive_toolcall_en_demo.json")
    with_calls = [c for c in convs if any(m.get("tool_calls") for m in c["messages"])]
    assert len(with_calls) > 100 and all(c.get("tools") for c in with_calls)
    mt = conversations(EVAL / "mt_bench_question.jsonl")
    assert len(mt) == 80 and all([m["role"] for m in c["messages"]] == ["user", "user"] for c in mt)


# ---------------------------------------------------------------- bad input
def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": []}\n\n{"messages": [}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl line 3: malformed JSON"):
        conversations(path)
    listing = tmp_path / "bad.json"
    listing.write_text('[\n {"instruction": "a", "output": "b"},\n {"instruction": "a" "output": "b"}\n]')
    with pytest.raises(UserError, match=r"bad\.json line 3: malformed JSON"):
        conversations(listing)


def test_unknown_format_names_config_key():
    with pytest.raises(
        ConfigError, match=r"datasets\[i\]\.format.*unknown format 'chatml'.*sharegpt, openai"
    ):
        conversations("x.jsonl", "chatml")


def test_undetectable_format_names_config_key(tmp_path):
    with pytest.raises(ConfigError, match=r"datasets\[i\]\.format.*keys \['prompt'\]"):
        conversations(write_jsonl(tmp_path / "u.jsonl", [{"prompt": "x"}]))


def test_missing_fields_name_record_and_field(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "c"}])
    with pytest.raises(UserError, match=r"m\.jsonl line 2: missing field 'output'"):
        conversations(path)
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "human"}]}])
    with pytest.raises(UserError, match=r"s\.jsonl line 1 conversations\[0\]: missing field 'value'"):
        conversations(path)
    path = write_jsonl(tmp_path / "r.jsonl", [{"conversations": [{"from": "narrator", "value": "x"}]}])
    with pytest.raises(UserError, match=r"line 1 conversations\[0\]: unknown speaker 'narrator'"):
        conversations(path)


def test_non_utf8_names_line_and_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    data = b'{"text": "Human: ok\\n\\nAssistant: ok"}\n{"text": "Human: caf\xe9"}\n'
    path.write_bytes(data)
    with pytest.raises(UserError, match=rf"latin1\.jsonl line 2: invalid UTF-8 at byte {data.index(0xE9)}\b"):
        conversations(path)
    listing = tmp_path / "latin1.json"
    data = b'[\n{"instruction": "caf\xe9", "output": "x"}\n]'
    listing.write_bytes(data)
    with pytest.raises(UserError, match=rf"latin1\.json line 2: invalid UTF-8 at byte {data.index(0xE9)}\b"):
        conversations(listing)


def test_empty_and_out_of_order_records_are_skipped_with_location(tmp_path):
    records = [
        {"conversations": []},  # empty
        {
            "conversations": [
                {"from": "human", "value": "a"},
                {"from": "human", "value": "b"},
                {"from": "gpt", "value": "c"},
            ]
        },  # two user turns in a row
        {
            "conversations": [
                {"from": "gpt", "value": "Hello, how can I help?"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
            ]
        },  # a greeting first: dropped, record kept
        {"conversations": [{"from": "human", "value": "q"}, {"from": "system", "value": "late"}]},
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    out = [str(tmp_path / "out" / "00000.jsonl")]
    report = split_dataset(str(path), "auto", out, 10, None, None, "mixed")
    assert report["skipped"] == {"empty": 1, "roles_out_of_order": 2}
    assert report["leading_assistant_turns_dropped"] == 1
    where = {e["record"]: e["detail"] for e in report["skipped_examples"]}
    assert "two 'user' turns in a row" in where[f"{path} line 2"]
    assert "system message after the first position" in where[f"{path} line 4"]
    [kept] = [json.loads(line) for line in Path(out[0]).read_text().splitlines()]
    assert kept["id"] == "mixed:2" and [m["role"] for m in kept["messages"]] == ["user", "assistant"]


def test_all_records_skipped_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", [{"messages": []}, {"messages": []}])
    with pytest.raises(UserError, match="all 2 records were skipped"):
        split_dataset(str(path), "openai", [str(tmp_path / "o.jsonl")], 10, None, None, "e")
    assert not (tmp_path / "o.jsonl").exists()


# ---------------------------------------------------------------- split stage
def test_split_shards_deterministic_and_atomic(tmp_path):
    records = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(23)]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    n = plan_shards(count_records(str(path)), 10, 21)
    assert n == 3
    outs = [str(tmp_path / "a" / f"{i:05d}.jsonl") for i in range(n)]
    report = split_dataset(str(path), "alpaca", outs, 10, 21, None, "demo")
    assert report["shard_counts"] == [10, 10, 1] and report["records_read"] == 21
    shards = [[json.loads(x) for x in Path(p).read_text().splitlines()] for p in outs]
    assert [c["id"] for c in shards[1]] == [f"demo:{i}" for i in range(10, 20)]
    assert shards[2][0]["messages"][0]["content"] == "q20"
    again = [str(tmp_path / "b" / f"{i:05d}.jsonl") for i in range(n)]
    split_dataset(str(path), "alpaca", again, 10, 21, None, "demo")
    assert [Path(p).read_bytes() for p in outs] == [Path(p).read_bytes() for p in again]
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temp files left


def test_a_source_without_records_plans_one_shard_whose_split_fails(tmp_path):
    """The workflow plans at least one shard per dataset; a source without records fails its split job,
    naming the dataset (a dataset that yields nothing must not pass silently)."""
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert count_records(str(path)) == 0
    assert plan_shards(0, 10, None) == 1 and plan_shards(0, 10, 5) == 1
    assert [plan_shards(n, 10, None) for n in (1, 10, 11)] == [1, 1, 2] and plan_shards(30, 10, 12) == 2
    out = tmp_path / "o" / "00000.jsonl"
    with pytest.raises(UserError, match="dataset 'e' .*yields no samples: the source has no records"):
        split_dataset(str(path), "auto", [str(out)], 10, None, None, "e", total_shards=1)
    assert not out.exists()


def test_split_fails_whole_when_a_later_record_is_bad(tmp_path):
    records = [{"instruction": f"q{i}", "output": "a"} for i in range(15)] + [{"instruction": "no output"}]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    outs = [str(tmp_path / "o" / f"{i:05d}.jsonl") for i in range(2)]
    with pytest.raises(UserError, match="line 16: missing field 'output'"):
        split_dataset(str(path), "auto", outs, 10, None, None, "d")
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def test_split_detects_a_source_that_grew(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "q", "output": "a"}] * 12)
    with pytest.raises(UserError, match="more than the 10 records planned"):
        split_dataset(str(path), "auto", [str(tmp_path / "o.jsonl")], 10, None, None, "d")


def test_count_records_does_not_parse_jsonl(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"a": 1}\nnot json at all\n\n   \n{"b": 2}\n')
    assert count_records(str(path)) == 3


RSS_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    from eagle3build.data.formats import count_records
    from eagle3build.data.prepare import split_dataset
    from eagle3build.shardplan import plan_shards
    src, out, shard_size = sys.argv[1], sys.argv[2], 5000
    n = plan_shards(count_records(src), shard_size, None)
    split_dataset(src, "auto", [f"{out}/{i:05d}.jsonl" for i in range(n)], shard_size, None, None, "big")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
""")


def test_streaming_memory_does_not_grow_with_records(tmp_path):
    def peak_rss_kb(n: int) -> int:
        src = tmp_path / f"big{n}.jsonl.gz"
        line = {
            "conversations": [
                {"from": "human", "value": "What is " + "x" * 150},
                {"from": "gpt", "value": "It is " + "y" * 150},
            ]
        }
        with gzip.open(src, "wt", compresslevel=1) as f:
            f.writelines(json.dumps(line) + "\n" for _ in range(n))
        out = tmp_path / f"out{n}"
        result = subprocess.run(
            [sys.executable, "-c", RSS_SCRIPT, str(src), str(out)],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        )
        assert result.returncode == 0, result.stderr
        assert sum(1 for _ in out.iterdir()) == n // 5000
        return int(result.stdout.split()[-1])

    small, large = peak_rss_kb(20_000), peak_rss_kb(100_000)
    # 80k more records (~27 MB of JSON) must not show up in the peak; allow allocator noise
    assert large - small < 8_000, (small, large)

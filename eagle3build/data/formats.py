"""Dataset readers for the split stage: many conversation formats in, one normalized record out.

A normalized conversation (docs/DESIGN.md) is
    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str, "tool_calls"?: [...],
                   "reasoning_content"?: str (assistant), "tool_call_id"?: str (tool)}],
     "tools"?: [...]}
(the split stage adds the "id"). Readers:

    sharegpt   {"conversations": [{"from", "value"}], "tools"?}; DPO files add "chosen" (used as the final
               assistant turn) and "rejected" (ignored)
    openai     {"messages": [{"role", "content", "tool_calls"?, "reasoning_content"?, "tool_call_id"?}]}
    alpaca     {"instruction", "input"?, "output", "system"?, "history"?: [[user, assistant], ...]}
               (AlpacaEval's {"instruction", "output", "generator", "dataset"} included)
    hh         raw text "\\n\\nHuman: ... \\n\\nAssistant: ..." in "chosen" or "text" (hh-rlhf)
    questions  {"question_id", "category", "turns": [...]} or {"class", "data": str | [...]}: user turns only

Containers: a JSON list (parsed whole by `json`: fine for the file sizes such lists come in), JSONL (read
line by line, so memory does not grow with the file), either of them gzipped, and `hf:<dataset id>` or a
local Hugging Face dataset folder (Arrow files are memory-mapped, so they stream too).

Normalisation policy, applied the same way to every format:
- Problems that mean the file or the chosen format is wrong raise UserError naming the file, the line
  (or record) and the field: malformed JSON, non-UTF-8 bytes, a missing or mistyped field, an unknown role.
- Problems of single records that real dumps are full of (ShareGPT scrapes especially) are skipped and
  counted with their location, so one bad record among a million does not stop a build:
  an empty conversation ("empty"), two user or two assistant turns in a row, a system message after the
  first position or a tool turn that does not follow an assistant turn ("roles_out_of_order").
- Assistant turns before the first user turn (a bot greeting in scraped chats) are dropped, as FastChat
  does, and counted ("leading_assistant_dropped"); the record itself is kept.
- Question files are prompts, so their consecutive user turns are kept as they are (each is answered in
  turn by the regenerate and evaluate stages).
- Tool calls are stored in OpenAI form, {"type": "function", "function": {"name", "arguments"}}, with
  `arguments` as a JSON object when it parses (what Hugging Face chat templates expect) and content "".
- Tool definitions are stored in OpenAI form too, as vLLM renders them ({"type": "function", "function":
  {"name", "description", "parameters"}}: eagle3build/data/tools.py), whatever shape the file has; one
  that cannot be is an error naming the record.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3build.data.tools import ToolError, openai_tools
from eagle3build.errors import ConfigError, UserError

FORMATS = ("auto", "sharegpt", "openai", "alpaca", "hh", "questions")
ROLES = ("system", "user", "assistant", "tool")

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
    "function_call": "assistant",  # a tool call made by the assistant
    "observation": "tool",
    "tool": "tool",
    "function": "tool",
}
HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant): ?")


class SkipRecord(Exception):
    """A record that is invalid on its own (not the whole file): skipped and counted under `reason`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class Record:
    """One raw record and where it came from, for error messages."""

    data: dict
    where: str  # "path line 12" / "path record 12" / "hf:id row 12"


# ---------------------------------------------------------------- containers
def _is_hf_source(source: str) -> bool:
    return source.startswith("hf:") or Path(source).is_dir()


def _open_binary(path: Path):
    if not path.is_file():
        raise UserError(f"{path}: dataset file not found; check the dataset's `path` in the config")
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _is_json_list(path: Path) -> bool:
    """A file whose first non-space byte is '[' is a JSON list; anything else is read as JSONL."""
    with _open_binary(path) as f:
        try:
            while chunk := f.read(4096):
                stripped = chunk.lstrip()
                if stripped:
                    return stripped.startswith(b"[") or stripped.startswith(b"\xef\xbb\xbf[")
        except (OSError, EOFError) as e:
            raise UserError(f"{path}: cannot read ({e}); is it a valid gzip/text file?") from e
    return False


def _decode_line(raw: bytes, path: Path, line_no: int, line_start: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path} line {line_no}: invalid UTF-8 at byte {line_start + e.start} of the file "
            f"({raw[e.start : e.start + 4]!r}); re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from e


def iter_jsonl_from(path: str | Path, start: int = 0) -> Iterator[tuple[int, Record]]:
    """(index, JSON object) of a JSONL(.gz) file from object `start` on, streamed; errors name the file,
    line (and byte for bad UTF-8)."""
    path = Path(path)
    offset, index = 0, -1
    with _open_binary(path) as f:
        for line_no, raw in enumerate(f, start=1):
            line_start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            index += 1
            if index < start:
                continue
            text = _decode_line(raw, path, line_no, line_start)
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path} line {line_no}: malformed JSON ({e.msg} at column {e.colno}); "
                    "fix or delete that line"
                ) from e
            if not isinstance(data, dict):
                raise UserError(f"{path} line {line_no}: expected a JSON object, found {type(data).__name__}")
            yield index, Record(data, f"{path} line {line_no}")


def iter_jsonl(path: str | Path) -> Iterator[Record]:
    """The JSON objects of a JSONL(.gz) file, streamed."""
    return (record for _, record in iter_jsonl_from(path))


def _iter_json_list(path: Path) -> Iterator[Record]:
    with _open_binary(path) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line_no = raw.count(b"\n", 0, e.start) + 1
        raise UserError(
            f"{path} line {line_no}: invalid UTF-8 at byte {e.start} ({raw[e.start : e.start + 4]!r}); "
            "re-encode the file as UTF-8"
        ) from e
    del raw
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} line {e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from e
    del text
    for i, data in enumerate(items):
        if not isinstance(data, dict):
            raise UserError(f"{path} record {i}: expected a JSON object, found {type(data).__name__}")
        yield Record(data, f"{path} record {i}")


def _load_hf(source: str, split: str | None, revision: str | None = None):
    """`hf:<id>` via datasets.load_dataset (at `revision`, a hub commit, when given), or a local folder
    (save_to_disk output or data files)."""
    import datasets

    target = source[3:] if source.startswith("hf:") else source
    try:
        if Path(target).is_dir() and any(
            (Path(target) / f).is_file() for f in ("state.json", "dataset_dict.json")
        ):
            ds = datasets.load_from_disk(target)
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split or "train"]
            elif split not in (None, "train"):
                raise UserError(f"{source}: a single saved dataset has no split '{split}'; drop `split`")
            return ds
        pinned = {"revision": revision} if revision else {}
        return datasets.load_dataset(target, split=split or "train", **pinned)
    except UserError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, ConnectionError, ValueError...)
        raise UserError(
            f"{source}: cannot load the Hugging Face dataset ({type(e).__name__}: {e}); check the "
            "dataset id / path and `split`, and that it is in the local cache when offline"
        ) from e


def iter_raw_records(
    source: str, split: str | None = None, start: int = 0, revision: str | None = None
) -> Iterator[tuple[int, Record]]:
    """Yield (index, raw record) from record `start` on, streaming where the container allows.

    JSONL lines before `start` are skipped without being parsed, so a shard job reads its range cheaply.
    """
    if _is_hf_source(source):
        dataset = _load_hf(source, split, revision)
        for i in range(start, len(dataset)):
            yield i, Record(dict(dataset[i]), f"{source} row {i}")
        return
    path = Path(source)
    if _is_json_list(path):
        for i, record in enumerate(_iter_json_list(path)):
            if i >= start:
                yield i, record
        return
    yield from iter_jsonl_from(path, start)


def count_records(source: str, fmt: str = "auto", split: str | None = None, revision: str | None = None) -> int:
    """Number of records in a source, cheaply: JSONL counts non-empty lines without parsing them.

    Skipped records still count (the split stage numbers and shards by source position), so this is the
    number the caller uses to plan shards.
    """
    check_format(fmt)
    if _is_hf_source(source):
        return len(_load_hf(source, split, revision))
    path = Path(source)
    if _is_json_list(path):
        return sum(1 for _ in _iter_json_list(path))
    with _open_binary(path) as f:
        return sum(1 for raw in f if raw.strip())


# ---------------------------------------------------------------- formats
def check_format(fmt: str, key: str = "datasets[i].format") -> None:
    if fmt not in FORMATS:
        raise ConfigError(key, f"unknown format '{fmt}'; valid formats: {', '.join(FORMATS)}")


def detect_format(data: dict, where: str, key: str = "datasets[i].format") -> str:
    """Guess the format from one record's keys (the first record of a file decides for all)."""
    if "conversations" in data:
        return "sharegpt"
    if "messages" in data:
        return "openai"
    if "instruction" in data:
        return "alpaca"
    if "turns" in data or ("class" in data and "data" in data):
        return "questions"
    if isinstance(data.get("chosen"), str) or isinstance(data.get("text"), str):
        return "hh"
    raise ConfigError(
        key,
        f"cannot detect the format of {where} from its keys {sorted(data)}; set it to one of "
        f"{', '.join(f for f in FORMATS if f != 'auto')}",
    )


def _field(data: dict, name: str, where: str, types: type | tuple = str):
    if name not in data:
        raise UserError(f"{where}: missing field '{name}'; is the dataset's `format` right?")
    value = data[name]
    if not isinstance(value, types):
        expected = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise UserError(f"{where}: field '{name}' must be {expected}, found {type(value).__name__}")
    return value


def _text(value, where: str, field: str) -> str:
    """Message content as a string; OpenAI content-part lists are joined from their text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(p.get("text", "") for p in value)
    raise UserError(
        f"{where}: field '{field}' must be text (a string or a list of text parts), "
        f"found {type(value).__name__}"
    )


def _tool_call(value: str) -> dict | None:
    """ShareGPT function_call text '{"name": ..., "arguments": ...}' -> an OpenAI tool call (None if not one)."""
    try:
        call = json.loads(value)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {"type": "function", "function": {"name": call["name"], "arguments": arguments}}


def _tools(data: dict, where: str) -> list | None:
    """The record's tools in OpenAI's form, the one every later stage sends and renders (data/tools.py)."""
    try:
        return openai_tools(data.get("tools"))
    except ToolError as e:
        raise UserError(f"{where}: field 'tools': {e}") from e


def _from_sharegpt(data: dict, where: str) -> tuple[list[dict], list | None]:
    turns = list(_field(data, "conversations", where, list))
    if "chosen" in data:  # DPO: the prompt turns plus the preferred answer
        turns.append(_field(data, "chosen", where, dict))
    messages: list[dict] = []
    for j, turn in enumerate(turns):
        at = f"{where} conversations[{j}]"
        if not isinstance(turn, dict):
            raise UserError(f"{at}: expected an object with 'from' and 'value', found {type(turn).__name__}")
        speaker = _field(turn, "from", at)
        role = SHAREGPT_ROLES.get(speaker.lower())
        if role is None:
            raise UserError(f"{at}: unknown speaker '{speaker}'; expected one of {sorted(SHAREGPT_ROLES)}")
        value = _text(_field(turn, "value", at, (str, list, type(None))), at, "value")
        if speaker.lower() == "function_call" and (call := _tool_call(value)) is not None:
            previous = messages[-1] if messages else None
            if previous and previous["role"] == "assistant":  # text then call(s): one OpenAI message
                previous.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        messages.append({"role": role, "content": value})
    return messages, _tools(data, where)


def _from_openai(data: dict, where: str) -> tuple[list[dict], list | None]:
    messages = []
    for j, message in enumerate(_field(data, "messages", where, list)):
        at = f"{where} messages[{j}]"
        if not isinstance(message, dict):
            raise UserError(
                f"{at}: expected an object with 'role' and 'content', found {type(message).__name__}"
            )
        role = _field(message, "role", at)
        if role not in ROLES:
            raise UserError(f"{at}: unknown role '{role}'; expected one of {', '.join(ROLES)}")
        if "content" not in message and not message.get("tool_calls"):
            raise UserError(f"{at}: missing field 'content'")
        out = {"role": role, "content": _text(message.get("content"), at, "content")}
        if message.get("tool_calls"):
            out["tool_calls"] = message["tool_calls"]
        # A thinking model's turn as a reasoning parser returns it (vLLM's field, or SGLang's older name):
        # chat templates render `reasoning_content`, and prepare.thinking decides what is trained.
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if role == "assistant" and reasoning:
            out["reasoning_content"] = _text(reasoning, at, "reasoning_content")
        if role == "tool" and message.get("tool_call_id"):  # templates name the call a result answers
            out["tool_call_id"] = str(message["tool_call_id"])
        messages.append(out)
    return messages, _tools(data, where)


def _from_alpaca(data: dict, where: str) -> tuple[list[dict], list | None]:
    instruction = _field(data, "instruction", where)
    output = _field(data, "output", where)
    extra = data.get("input") or ""
    if not isinstance(extra, str):
        raise UserError(f"{where}: field 'input' must be str, found {type(extra).__name__}")
    messages = []
    if data.get("system"):
        messages.append({"role": "system", "content": _text(data["system"], where, "system")})
    for j, pair in enumerate(data.get("history") or []):
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise UserError(f"{where}: history[{j}] must be a [user, assistant] pair of strings")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    return messages, None


def _from_hh(data: dict, where: str) -> tuple[list[dict], list | None]:
    field = "chosen" if "chosen" in data else "text"
    text = _field(data, field, where)
    parts = HH_TURN.split(text)  # [before, speaker, content, speaker, content, ...]
    if parts[0].strip():
        raise UserError(f"{where}: field '{field}' must start with '\\n\\nHuman:' (found {parts[0][:40]!r})")
    messages = [
        {"role": "user" if speaker == "Human" else "assistant", "content": content.strip()}
        for speaker, content in zip(parts[1::2], parts[2::2], strict=True)
    ]
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()  # a trailing empty "Assistant:" is a prompt for the next answer
    return messages, None


def _from_questions(data: dict, where: str) -> tuple[list[dict], list | None]:
    if "turns" in data:
        turns = _field(data, "turns", where, list)
    else:
        turns = _field(data, "data", where, (list, str))
        turns = [turns] if isinstance(turns, str) else turns
    for j, turn in enumerate(turns):
        if not isinstance(turn, str):
            raise UserError(f"{where}: turn {j} must be a string, found {type(turn).__name__}")
    return [{"role": "user", "content": t} for t in turns], None


READERS = {
    "sharegpt": _from_sharegpt,
    "openai": _from_openai,
    "alpaca": _from_alpaca,
    "hh": _from_hh,
    "questions": _from_questions,
}


def check_roles(messages: list[dict]) -> int:
    """Enforce the normalized role order in place; return how many leading assistant turns were dropped.

    Order: an optional leading system message, then user/assistant alternating, with tool turns allowed
    after an assistant turn (or another tool turn) and followed by an assistant or user turn.
    """
    start = 1 if messages and messages[0]["role"] == "system" else 0
    dropped = 0
    while start < len(messages) and messages[start]["role"] == "assistant":
        del messages[start]
        dropped += 1
    if not any(m["role"] != "system" and (m["content"] or m.get("tool_calls")) for m in messages):
        raise SkipRecord("empty", "no user or assistant content")
    previous = "system"
    for j, message in enumerate(messages[start:], start=start):
        role = message["role"]
        if role == "system":
            raise SkipRecord(
                "roles_out_of_order", f"messages[{j}]: a system message after the first position"
            )
        if role == previous and role != "tool":
            raise SkipRecord("roles_out_of_order", f"messages[{j}]: two '{role}' turns in a row")
        if role == "tool" and previous not in ("assistant", "tool"):
            raise SkipRecord("roles_out_of_order", f"messages[{j}]: a tool turn after a '{previous}' turn")
        if role == "assistant" and previous == "system":
            raise SkipRecord("roles_out_of_order", f"messages[{j}]: the conversation has no user turn first")
        previous = role
    return dropped


def normalize(record: Record, fmt: str) -> tuple[dict, int]:
    """Raw record -> ({"messages", "tools"?}, leading assistant turns dropped). Raises SkipRecord/UserError."""
    messages, tools = READERS[fmt](record.data, record.where)
    if fmt == "questions":
        if not any(m["content"].strip() for m in messages):
            raise SkipRecord("empty", "no question text")
        dropped = 0
    else:
        dropped = check_roles(messages)
    conversation = {"messages": messages}
    if tools:
        conversation["tools"] = tools
    return conversation, dropped


def iter_conversations(
    source: str,
    fmt: str = "auto",
    split: str | None = None,
    key: str = "datasets[i].format",
    start: int = 0,
    revision: str | None = None,
) -> Iterator[tuple[int, Record, dict | SkipRecord, int]]:
    """Yield (source index, raw record, normalized conversation or the SkipRecord, leading turns dropped)."""
    check_format(fmt, key)
    for index, record in iter_raw_records(source, split, start, revision):
        if fmt == "auto":
            fmt = detect_format(record.data, record.where, key)
        try:
            conversation, dropped = normalize(record, fmt)
        except SkipRecord as skip:
            yield index, record, skip, 0
            continue
        yield index, record, conversation, dropped

"""One conversation replayed turn by turn while the target writes its answers, and the resume file that
keeps the finished turns of a regenerate job (eagle3build/data/regenerate.py) across a kill.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from eagle3build.atomic import atomic_path


class Replay:
    """Walks a conversation's user turns; the target writes each assistant turn.

    `next_prompt()` gives the messages to answer next (None when the conversation is done);
    `add_answer()` records the target's answer, which becomes context for the next user turn.

    Tool calls continue the conversation when the dataset has their results: the dataset's assistant
    turns after a user turn that call tools, each followed by its `tool` messages, are that turn's tool
    rounds. When the target's answer calls tools and the dataset's next round for the same user turn
    calls the same functions in the same order (matched by position and name), the dataset's tool
    messages are appended (their tool_call_id set to the target's call ids) and the target answers
    again; otherwise the conversation stops there (`stopped_at_tool_call`): nobody can run the tool.
    A round the target did not ask for is skipped with its results.
    """

    def __init__(self, sample: dict):
        self.sample = sample
        self.context: list[dict] = []
        self.user_turns: list[dict] = []
        self.tool_rounds: list[list[tuple[list, list[dict]]]] = []  # per user turn: (calls, results)
        for message in sample["messages"]:
            role = message.get("role")
            if role == "user":
                self.user_turns.append(message)
                self.tool_rounds.append([])
            elif role == "system" and not self.user_turns:
                self.context.append(message)
            elif role == "assistant" and message.get("tool_calls") and self.user_turns:
                self.tool_rounds[-1].append((message["tool_calls"], []))
            elif role == "tool" and self.tool_rounds and self.tool_rounds[-1]:
                self.tool_rounds[-1][-1][1].append(message)
            # dataset answers (and any later system message) are discarded
        self.turns_done = 0  # user turns answered completely
        self.tool_round = 0  # tool rounds used in the current user turn
        self.tool_results = 0  # dataset tool messages replayed
        self.truncated = False
        self.stopped_at_tool_call = False

    @property
    def tools(self) -> list | None:
        return self.sample.get("tools") or None

    def next_prompt(self) -> list[dict] | None:
        if self.stopped_at_tool_call or self.turns_done == len(self.user_turns):
            return None
        if not self.context or self.context[-1].get("role") not in ("user", "tool"):
            self.context.append(self.user_turns[self.turns_done])
        return self.context

    def _results_for(self, calls: list) -> list[dict] | None:
        """The dataset's tool messages answering `calls` (None when it has none for them)."""
        rounds = self.tool_rounds[self.turns_done]
        if self.tool_round >= len(rounds):
            return None
        known, results = rounds[self.tool_round]
        names = [str((c.get("function") or c).get("name")) for c in calls]
        if names != [str((c.get("function") or c).get("name")) for c in known] or not results:
            return None
        if len(results) != len(calls):
            return [dict(r) for r in results]
        return [
            {**r, "tool_call_id": c["id"]} if c.get("id") else dict(r)
            for r, c in zip(results, calls, strict=True)
        ]

    def add_answer(
        self, content: str, truncated: bool, tool_calls: list | None = None, reasoning: str | None = None
    ) -> None:
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        self.truncated |= truncated
        if tool_calls:
            message["tool_calls"] = tool_calls
            self.context.append(message)
            results = None if truncated else self._results_for(tool_calls)
            if results is None:
                self.stopped_at_tool_call = True
                self.turns_done += 1
                return
            self.context.extend(results)
            self.tool_round += 1
            self.tool_results += len(results)
            return
        self.context.append(message)
        self.turns_done += 1
        self.tool_round = 0

    STATE_KEYS = ("context", "turns_done", "tool_round", "tool_results", "truncated", "stopped_at_tool_call")

    def state(self) -> dict:
        """What a resume needs to continue this conversation after its last finished turn."""
        return {key: getattr(self, key) for key in self.STATE_KEYS}

    def restore(self, state: dict) -> Replay:
        self.context = list(state["context"])
        self.turns_done = int(state["turns_done"])
        self.tool_round = int(state["tool_round"])
        self.tool_results = int(state["tool_results"])
        self.truncated = bool(state["truncated"])
        self.stopped_at_tool_call = bool(state["stopped_at_tool_call"])
        return self

    def result(self) -> dict:
        out = {k: v for k, v in self.sample.items() if k != "messages"}
        out["messages"] = self.context
        return {
            "sample": out,
            "truncated": self.truncated,
            "stopped_at_tool_call": self.stopped_at_tool_call,
            "tool_results": self.tool_results,
        }


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

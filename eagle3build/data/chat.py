"""Chat templates and the assistant-only loss mask, without knowing any template's markup.

The mask is built from the template's own renderings, never by searching for role headers:

    full     = render(messages)                                   the training text
    prompt_i = render(messages[:i], add_generation_prompt=True)   what the model sees before answering turn i
    turn_i   = render(messages[:i+1])                             prompt_i + what the model generates for turn i

Turn i's span in `full` starts at len(prompt_i) (prompt_i must be a prefix of `full`: the template is
"prefix-stable") and covers what the template renders for that message after the generation prompt:
the answer, any tool calls and the closing end-of-turn marker. Some templates render the last turn
differently from the same turn in history (Qwen3 adds an empty <think></think> block only to the newest
answer); then the history form is the longest tail of `turn_i` that starts `full` at that point.

Exactly which characters are trained (the same rule for every template):
- included: everything the template emits for the assistant message after the generation prompt, up to
  and including its end-of-turn token(s) (the draft must learn to predict the end of a turn);
- excluded: the generation-prompt header (e.g. "<|im_start|>assistant\\n"), system/user/tool turns, and
  whitespace that follows a special token at the very end of the turn (ChatML's "\\n" after <|im_end|>:
  the model stops at <|im_end|> and never generates it).
A token is masked when its characters overlap an assistant span.

Tool calls are passed to the template in OpenAI form. Templates without tool support drop them silently;
when a call's function name is missing from its rendered turn, the conversation is rendered again with
each call written as JSON text in the assistant's content, so the call is still trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eagle3build.errors import ConfigError, UserError
from eagle3build.hf_target import target_path


class TemplateError(Exception):
    """The template failed on one conversation (e.g. it rejects a role): that sample is dropped."""


# ---------------------------------------------------------------- tokenizer
def _tokenizer_config(path: str, revision: str | None) -> dict:
    """tokenizer_config.json of a local dir or a cached hub repo ({} when unavailable)."""
    from transformers.utils import cached_file

    try:
        file = cached_file(
            path,
            "tokenizer_config.json",
            revision=revision,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
    except Exception:  # an unknown repo: from_pretrained below reports it
        return {}
    if not file:
        return {}
    try:
        return json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def load_tokenizer(
    path: str, revision: str | None = None, trust_remote_code: bool = False, chat_template: str | None = None
):
    """AutoTokenizer with a chat template (a configured template file overrides the tokenizer's own)."""
    from transformers import AutoTokenizer

    remote_code_fix = (
        f"the tokenizer at '{path}' ships its own Python code (auto_map); set "
        "target.trust_remote_code: true if you trust that repository"
    )
    if "AutoTokenizer" in (_tokenizer_config(path, revision).get("auto_map") or {}) and not trust_remote_code:
        raise ConfigError("target.trust_remote_code", remote_code_fix)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, revision=revision, trust_remote_code=bool(trust_remote_code)
        )
    except Exception as e:  # transformers raises OSError, ValueError, ImportError... for unloadable repos
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise ConfigError("target.trust_remote_code", remote_code_fix) from e
        raise UserError(
            f"cannot load the tokenizer from '{path}' (revision {revision}): {type(e).__name__}: {e}"
        ) from e
    if chat_template:
        template_file = Path(chat_template)
        if not template_file.is_file():
            raise ConfigError("target.chat_template", f"file '{chat_template}' not found")
        tokenizer.chat_template = template_file.read_text(encoding="utf-8")
    if not tokenizer.chat_template:
        raise ConfigError(
            "target.chat_template",
            f"the tokenizer at '{path}' has no chat template (a base model?); "
            "set it to a Jinja template file for the target's chat format",
        )
    if not tokenizer.is_fast:
        raise UserError(
            f"the tokenizer at '{path}' ({type(tokenizer).__name__}) is not a fast tokenizer; the loss "
            "mask needs character offsets (return_offsets_mapping). Add a tokenizer.json to the model"
        )
    return tokenizer


def load_target_tokenizer(target: dict):
    """The target's tokenizer with its chat template (target['chat_template'], a Jinja file, overrides)."""
    return load_tokenizer(
        target_path(target),
        revision=target.get("revision"),
        trust_remote_code=bool(target.get("trust_remote_code", False)),
        chat_template=target.get("chat_template"),
    )


# ---------------------------------------------------------------- spans
def _render(tokenizer, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja2 errors, raise_exception() in templates, TypeErrors on None content...
        raise TemplateError(f"{type(e).__name__}: {e}") from e


def _overlap(generated: str, text: str) -> int:
    """Length of the longest suffix of `generated` that is also a prefix of `text` (KMP, linear time)."""
    pattern = text[: len(generated)]
    if not pattern:
        return 0
    failure = [0] * len(pattern)
    k = 0
    for q in range(1, len(pattern)):
        while k and pattern[q] != pattern[k]:
            k = failure[k - 1]
        if pattern[q] == pattern[k]:
            k += 1
        failure[q] = k
    k = 0
    for c in generated:
        if k == len(pattern):
            k = failure[k - 1]
        while k and c != pattern[k]:
            k = failure[k - 1]
        if c == pattern[k]:
            k += 1
    return k


def special_tokens(tokenizer) -> tuple[str, ...]:
    specials = set(tokenizer.all_special_tokens)
    specials.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return tuple(s for s in specials if s)


def assistant_spans(
    tokenizer, messages: list[dict], tools: list | None = None, specials: tuple[str, ...] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation; return (text, [(start, end) character span of each assistant turn])."""
    specials = special_tokens(tokenizer) if specials is None else specials
    full = _render(tokenizer, messages, tools, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], tools, True)
        turn = _render(tokenizer, messages[: i + 1], tools, False)
        if not full.startswith(prompt) or not turn.startswith(prompt):
            raise UserError(
                "the chat template is not prefix-stable: rendering the conversation up to assistant turn "
                f"{i} with add_generation_prompt=True is not a prefix of the whole conversation's rendering, "
                "so the assistant tokens cannot be located. Set target.chat_template to a template whose "
                "earlier turns render the same whatever follows them"
            )
        start = len(prompt)
        generated = turn[start:]
        end = start + (
            len(generated) if full.startswith(generated, start) else _overlap(generated, full[start:])
        )
        if end == start:
            raise UserError(
                f"the chat template renders assistant turn {i} differently in history than when "
                "generated, beyond recognition; set target.chat_template to a simpler template"
            )
        text = full[start:end]
        stripped = text.rstrip()
        if len(stripped) < len(text) and stripped.endswith(specials):
            end = start + len(stripped)
        spans.append((start, end))
    return full, spans


def _calls_as_text(messages: list[dict]) -> list[dict]:
    """Tool calls written into the assistant's content as JSON, for templates that ignore `tool_calls`."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [
                json.dumps(
                    {
                        "name": c.get("function", c).get("name"),
                        "arguments": c.get("function", c).get("arguments"),
                    },
                    ensure_ascii=False,
                )
                for c in message["tool_calls"]
            ]
            message = {
                "role": message["role"],
                "content": "\n".join(filter(None, [message["content"], *calls])),
            }
        out.append(message)
    return out


@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int]]
    calls_as_text: bool  # the template ignored tool_calls: they were rendered as content


def render_conversation(tokenizer, conversation: dict, specials: tuple[str, ...] | None = None) -> Rendered:
    """Render a normalized conversation and locate its assistant turns (see the module docstring)."""
    messages, tools = conversation["messages"], conversation.get("tools")
    text, spans = assistant_spans(tokenizer, messages, tools, specials)
    called = [
        (message, span)
        for message, span in zip((m for m in messages if m["role"] == "assistant"), spans, strict=True)
        if message.get("tool_calls")
    ]
    dropped_calls = any(
        str(c.get("function", c).get("name")) not in text[a:b]
        for message, (a, b) in called
        for c in message["tool_calls"]
    )
    if dropped_calls:
        text, spans = assistant_spans(tokenizer, _calls_as_text(messages), tools, specials)
    return Rendered(text, spans, dropped_calls)


def char_spans_to_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [num_tokens]: 1 where a token's characters overlap one of the spans."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not spans or not offsets:
        return mask
    starts, ends = np.asarray(offsets, dtype=np.int64).T
    ends = np.maximum(ends, starts + 1)  # a zero-width token (e.g. a lone "▁") sits at its start
    for a, b in spans:
        mask |= (starts < b) & (ends > a)
    return mask

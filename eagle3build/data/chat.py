"""Chat templates and the assistant-only loss mask, without knowing any template's markup.

The mask is built from the template's own renderings, never by searching for role headers:

    full     = render(messages)                                   the training text
    prompt_i = render(messages[:i], add_generation_prompt=True)   what the model sees before answering turn i
    turn_i   = render(messages[:i+1])                             prompt_i + what the model generates for turn i

Turn i's span in `full` starts at len(prompt_i) (prompt_i must be a prefix of `full`: the template is
"prefix-stable") and covers what the template renders for that message after the generation prompt:
the answer, any tool calls and the closing end-of-turn marker. Some templates render the last turn
differently from the same turn in history (Qwen3 adds an empty <think></think> block only to the newest
answer); then the history form is the longest tail of `turn_i` that starts `full` at that point, after
the head the two forms share (Kimi keeps "<think>" and "</think>answer" around the reasoning it drops).

Exactly which characters are trained (the same rule for every template):
- included: everything the template emits for the assistant message after the generation prompt, up to
  and including its end-of-turn token(s) (the draft must learn to predict the end of a turn);
- excluded: the generation-prompt header (e.g. "<|im_start|>assistant\\n"), system/user/tool turns, and
  whitespace that follows a special token at the very end of the turn (ChatML's "\\n" after <|im_end|>:
  the model stops at <|im_end|> and never generates it).
A token is masked when its characters overlap an assistant span. Fast tokenizers give the characters
of each token (offsets); for slow and remote-code tokenizers (Kimi's tiktoken one) the same mask is
built from token ids, by tokenizing the text up to each span boundary (`token_span_mask`).

Thinking: an assistant message's `reasoning_content` goes to the template on the message, and the
template renders it as the target does; `conversation_samples` applies prepare.thinking.

Tools and tool calls reach the template as vLLM hands them to it when the target answers (OpenAI form,
call arguments parsed from JSON: eagle3build/data/tools.py), so the tool text trained on is the text the
target read while regenerating. Templates without tool support drop tool calls silently;
when a call's function name is missing from its rendered turn, the conversation is rendered again with
each call written as JSON text in the assistant's content, so the call is still trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eagle3build.data.tools import openai_tools, template_messages
from eagle3build.errors import ConfigError, UserError
from eagle3build.trust import check_trust, target_path, trusted


class TemplateError(Exception):
    """The template failed on one conversation (e.g. it rejects a role): that sample is dropped."""


# ---------------------------------------------------------------- tokenizer
def is_file(path: str) -> bool:
    """Whether `path` names a file; a string no file system accepts as a name (too long) names none."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def load_tokenizer(
    path: str, revision: str | None = None, trust_remote_code: bool = False, chat_template: str | None = None
):
    """AutoTokenizer with a chat template (a configured template file overrides the tokenizer's own)."""
    from transformers import AutoTokenizer

    check_trust({"path": path, "revision": revision, "trust_remote_code": trust_remote_code})
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, revision=revision, trust_remote_code=trust_remote_code is True
        )
    except Exception as e:  # transformers raises OSError, ValueError, ImportError... for unloadable repos
        if "trust_remote_code" in str(e) and trust_remote_code is not True:
            raise ConfigError("target.trust_remote_code", f"is false, but the tokenizer at '{path}' needs its "
                              "own Python code; set it to true if you trust that repository") from e
        raise UserError(
            f"cannot load the tokenizer from '{path}' (revision {revision}): {type(e).__name__}: {e}"
        ) from e
    if chat_template:
        if not is_file(chat_template):
            shown = chat_template if len(chat_template) < 120 else chat_template[:100] + "..."
            raise ConfigError("target.chat_template", f"file '{shown}' not found (give the path of a Jinja "
                                                      "file, not the template's text)")
        template_file = Path(chat_template)
        tokenizer.chat_template = template_file.read_text(encoding="utf-8")
    if not tokenizer.chat_template:
        raise ConfigError(
            "target.chat_template",
            f"the tokenizer at '{path}' has no chat template (a base model?); "
            "set it to a Jinja template file for the target's chat format",
        )
    return tokenizer


def load_target_tokenizer(target: dict):
    """The target's tokenizer with its chat template (target['chat_template'], a Jinja file, overrides)."""
    return load_tokenizer(
        target_path(target),
        revision=target.get("revision"),
        trust_remote_code=trusted(target),
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


def _history_length(generated: str, full: str, start: int) -> int:
    """Length of assistant turn `generated` (its newest form) as it appears in `full` at `start`.

    Either the turn is rendered the same (its whole length), or history keeps a head and a tail of it and
    drops what lies between: Qwen3 drops the leading <think>…</think> block (empty head), Kimi keeps
    "<think>" and "</think>answer<end>" around the dropped reasoning. The head is the common prefix, the
    tail the longest suffix of the rest that continues `full` (0: not recognised).
    """
    if full.startswith(generated, start):
        return len(generated)
    head = 0
    limit = min(len(generated), len(full) - start)
    while head < limit and generated[head] == full[start + head]:
        head += 1
    tail = _overlap(generated[head:], full[start + head :])
    return head + tail if tail else 0


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
        end = start + _history_length(turn[start:], full, start)
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
    reasoning_as_text: bool = False  # the template ignored reasoning_content: rendered inside content


def render_conversation(tokenizer, conversation: dict, specials: tuple[str, ...] | None = None) -> Rendered:
    """Render a normalized conversation and locate its assistant turns (see the module docstring).
    A tool definition that cannot be put in OpenAI form raises ToolError."""
    messages, tools = template_messages(conversation["messages"]), openai_tools(conversation.get("tools"))
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


THINKING = ("served", "train", "drop")


def _without_reasoning(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]


def _reasoning_as_text(messages: list[dict], open_tag: str, close_tag: str) -> list[dict]:
    """reasoning_content written back in front of the content, as the model generated it before a
    reasoning parser split it off, for templates that expect the thinking inside the content."""
    return [
        {
            **{k: v for k, v in m.items() if k != "reasoning_content"},
            "content": f"{open_tag}{m['reasoning_content']}{close_tag}{m.get('content') or ''}",
        }
        if m.get("reasoning_content")
        else m
        for m in messages
    ]


def _reasoning_shown(message: dict, text: str, span: tuple[int, int]) -> bool:
    return str(message["reasoning_content"]).strip() in text[span[0] : span[1]]


def conversation_samples(
    tokenizer, conversation: dict, thinking: str = "served", specials: tuple[str, ...] | None = None
) -> list[Rendered]:
    """The training samples of one conversation under `prepare.thinking` (the assistant messages'
    optional `reasoning_content`, as a reasoning parser returns it):

    - served: as the target is served: the template decides which reasoning it renders (thinking
      templates render only the newest turn's, after the last user message) and all of it is trained;
    - drop: reasoning_content is removed before rendering (answers only, as served with thinking off);
    - train: every turn's reasoning is trained once, in the context it was generated in: a turn whose
      reasoning the template hides in history becomes its own sample (the conversation up to that turn,
      only that turn trained) and is left out of the whole conversation's mask.

    A template that ignores reasoning_content (its newest turn renders without it) gets the reasoning
    inside the content, between the tokenizer's <think> and </think> (as the model wrote it before the
    parser split it off); without those tokens it is left out (then nothing of it is trained).
    """
    if thinking not in THINKING:
        raise ConfigError("prepare.thinking", f"'{thinking}' is not one of {', '.join(THINKING)}")
    messages = conversation["messages"]
    reasoning = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("reasoning_content")]
    if thinking == "drop" or not reasoning:
        plain = {**conversation, "messages": _without_reasoning(messages)}
        return [render_conversation(tokenizer, plain, specials)]
    last = reasoning[-1]
    whole = render_conversation(tokenizer, conversation, specials)
    newest = (
        whole
        if last + 1 == len(messages)
        else render_conversation(tokenizer, {**conversation, "messages": messages[: last + 1]}, specials)
    )
    as_text = not _reasoning_shown(messages[last], newest.text, newest.spans[-1])
    if as_text:
        tags = ("<think>", "</think>")
        ids = [tokenizer.convert_tokens_to_ids(t) for t in tags]
        has_tags = all(i is not None and i != tokenizer.unk_token_id for i in ids)
        messages = _reasoning_as_text(messages, *tags) if has_tags else _without_reasoning(messages)
        conversation = {**conversation, "messages": messages}
        whole = render_conversation(tokenizer, conversation, specials)
        whole.reasoning_as_text = has_tags
    if thinking == "served" or as_text:
        return [whole]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    samples, hidden = [], set()
    for k, i in enumerate(turns):
        if i in reasoning and not _reasoning_shown(messages[i], whole.text, whole.spans[k]):
            alone = render_conversation(tokenizer, {**conversation, "messages": messages[: i + 1]}, specials)
            samples.append(Rendered(alone.text, alone.spans[-1:], alone.calls_as_text))
            hidden.add(k)
    whole.spans = [span for k, span in enumerate(whole.spans) if k not in hidden]
    return [*samples, whole] if whole.spans else samples


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


# ---------------------------------------------------------------- the mask from token ids
class MaskError(Exception):
    """A span boundary of one conversation does not fall between two tokens: that sample is dropped."""


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def token_span_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], np.ndarray]:
    """(input_ids, mask) of `text` without character offsets (slow and remote-code tokenizers).

    A span boundary b is located by token ids: when the ids of text[:b] are a prefix of the whole
    text's ids (the tokenizer is "prefix-stable" at b), exactly the first len(ids(text[:b])) tokens cover
    text[:b], and the tokens between a span's two boundaries are its tokens. That is the offsets rule (a
    token is trained when its characters overlap a span) wherever a boundary falls between tokens, which
    is where templates put them: after a special token (<|im_end|>, <|im_middle|>, <think>) or a header's
    newline. A boundary inside a token (BPE merged across it) raises MaskError naming it.

    First try, in one pass over the text: the pieces between boundaries tokenized apart, whose ids
    concatenate to the whole text's ids exactly when every boundary falls between tokens (each piece's
    tokens spell that piece). Tokenizers that add something to every call (SentencePiece's dummy prefix
    space) fail it; then each boundary's prefix is tokenized, once per boundary.
    """
    boundaries = sorted({b for span in spans for b in span})
    cuts = [0, *boundaries, len(text)]
    ids, *pieces = _encode(tokenizer, [text, *(text[a:b] for a, b in zip(cuts, cuts[1:], strict=False))])
    if [t for piece in pieces for t in piece] == ids:
        ends = np.cumsum([len(piece) for piece in pieces]).tolist()
        position = dict(zip(boundaries, ends, strict=False))
    else:
        position = _prefix_positions(tokenizer, text, boundaries, ids)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        mask[position[a] : position[b]] = 1
    return ids, mask


def _prefix_positions(tokenizer, text: str, boundaries: list[int], ids: list[int]) -> dict[int, int]:
    """Token index of each boundary, from the ids of the text before it (MaskError where not a prefix)."""
    position = {}
    for b, prefix in zip(boundaries, _encode(tokenizer, [text[:b] for b in boundaries]), strict=True):
        if ids[: len(prefix)] != prefix:
            k = next((j for j, (x, y) in enumerate(zip(prefix, ids, strict=False)) if x != y), len(ids))
            raise MaskError(
                f"the text up to character {b} (a loss-mask boundary: {text[max(0, b - 20) : b]!r} | "
                f"{text[b : b + 20]!r}) tokenizes differently alone than inside the conversation (from token "
                f"{k} on): the boundary falls inside a token"
            )
        position[b] = len(prefix)
    return position


def encode_masked(tokenizer, rendered: list[Rendered]) -> list[tuple[list[int], np.ndarray] | MaskError]:
    """Token ids and loss mask of each rendered conversation (a MaskError where it cannot be built).

    Fast tokenizers take the character-offsets path, the others the token-id path (token_span_mask).
    Both give the same masks on SmolLM2's, Llama 3.1's and Qwen3's tokenizers (tests/test_chat_mask.py;
    also every conversation of the demo dataset: 165 conversations, 221 assistant turns). Measured there
    (best of 5, a shared 2-core VM): token ids 0.07-0.23 s, offsets 0.05-0.08 s, rendering 0.08-0.26 s.
    Fast tokenizers keep the offsets, not for the speed but because they also cover a boundary inside a
    token (a template whose generation prompt ends in a space that the answer's first token absorbs),
    where the token-id path can only drop the sample.
    """
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(
            [item.text for item in rendered], add_special_tokens=False, return_offsets_mapping=True
        )
        return [
            (ids, char_spans_to_mask(offsets, item.spans))
            for item, ids, offsets in zip(
                rendered, encoded["input_ids"], encoded["offset_mapping"], strict=True
            )
        ]
    out = []
    for item in rendered:
        try:
            out.append(token_span_mask(tokenizer, item.text, item.spans))
        except MaskError as e:
            out.append(e)
    return out

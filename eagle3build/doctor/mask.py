"""Preflight check of the assistant-only loss mask: a probe conversation rendered with the target's
tokenizer and chat template (target.chat_template when set) and masked the way the tokens stage masks.

It uses the tokenizer the tokenizer check loaded (under the trust policy) and loads nothing itself, so
a remote-code tokenizer that target.trust_remote_code does not allow is never run here either.
"""

from __future__ import annotations

import copy
from pathlib import Path

from eagle3build.doctor.context import Check, Context

PROBE = {
    "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Two plus two is four.", "reasoning_content": "Add the numbers."},
        {"role": "user", "content": "And three times three?"},
        {"role": "assistant", "content": "Three times three is nine.", "reasoning_content": "Multiply them."},
    ]
}


def _masked_runs(tokenizer, ids: list[int], mask) -> list[str]:
    runs, current = [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r, clean_up_tokenization_spaces=False) for r in runs]


def _template_tokenizer(ctx: Context):
    """The loaded tokenizer with the configured template file, without changing the one in ctx."""
    template = ctx.target.get("chat_template")
    tokenizer = ctx.tokenizer
    if template:
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = Path(template).read_text(encoding="utf-8")
    return tokenizer


def _problems(tokenizer, thinking: str) -> list[str]:
    """What is wrong with the probe's masks (empty when every sample's mask is exactly its spans)."""
    from eagle3build.data.chat import MaskError, conversation_samples, encode_masked

    samples = conversation_samples(tokenizer, PROBE, thinking)
    problems = []
    for item, encoded in zip(samples, encode_masked(tokenizer, samples), strict=True):
        if isinstance(encoded, MaskError):
            problems.append(str(encoded))
            continue
        runs = _masked_runs(tokenizer, *encoded)
        expected = [item.text[a:b] for a, b in item.spans]
        # a token that straddles the span's start may carry whitespace of the generation prompt
        differs = [r != e and r.lstrip() != e.lstrip() for r, e in zip(runs, expected, strict=False)]
        if len(runs) != len(expected) or any(differs):
            problems.append(f"masked tokens decode to {runs}, expected the assistant parts {expected}")
    trained = "".join(item.text[a:b] for item in samples for a, b in item.spans)
    for message in PROBE["messages"]:
        if message["role"] == "assistant" and message["content"] not in trained:
            problems.append(f"the answer {message['content']!r} is not trained")
        if message["role"] != "assistant" and message["content"] in trained:
            problems.append(f"the {message['role']} text {message['content']!r} is trained")
    return problems


def check_mask(ctx: Context) -> Check:
    name = "mask"
    if ctx.tokenizer is None:
        return Check(name, "skip", "no tokenizer loaded (see the tokenizer check)")
    from eagle3build.data.chat import TemplateError
    from eagle3build.errors import UserError

    thinking = ctx.section("prepare")["thinking"]
    template_key = "target.chat_template"
    try:
        tokenizer = _template_tokenizer(ctx)
        if not tokenizer.chat_template:
            return Check(
                name,
                "fail",
                "the tokenizer has no chat template",
                f"set {template_key} to a Jinja template file for the target's chat format",
            )
        problems = _problems(tokenizer, thinking)
    except OSError as e:
        return Check(name, "fail", f"cannot read {template_key} ({e})", f"fix {template_key}")
    except (TemplateError, UserError) as e:
        return Check(
            name,
            "fail",
            f"the probe conversation cannot be masked: {e}",
            f"set {template_key} to a template that renders each turn the same whatever follows it",
        )
    if problems:
        return Check(
            name,
            "fail",
            "; ".join(problems),
            f"set {template_key} to a template whose assistant turns start after a special token or "
            "newline (the tokens stage would drop such samples)",
        )
    path = "character offsets" if getattr(tokenizer, "is_fast", False) else "token ids (no offsets)"
    return Check(
        name,
        "ok",
        f"probe conversation: masked tokens decode to exactly the assistant parts "
        f"({path}; prepare.thinking: {thinking})",
    )

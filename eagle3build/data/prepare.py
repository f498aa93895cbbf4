"""The prepare stages: split (any dataset -> normalized conversation shards) and tokens (-> token shards).

split_dataset(source, fmt, out_paths, shard_size, max_samples, split, name)   -> data/{ds}/{shard}.jsonl
tokenize_shard(conv_path, out_tokens, out_report, tokenizer, max_length)      -> tokens/{ds}/{shard}.*
show_sample(tokens_path, index, tokenizer_path)                                a mask viewer:

python -m eagle3build.data.prepare show build/tokens/demo/00000.safetensors --index 3 --tokenizer models/X
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from eagle3build.atomic import atomic_path, write_json_atomic
from eagle3build.data.formats import SkipRecord, iter_conversations, iter_jsonl
from eagle3build.errors import UserError
from eagle3build.trust import check_trust

MAX_EXAMPLES = 10  # skipped/dropped records listed by location in a report
TOKENIZE_BATCH = 256  # texts per call of the (Rust, multi-threaded) batch tokenizer


def _note_skip(report: dict, reason: str, where: str, detail: str) -> None:
    report["skipped"][reason] = report["skipped"].get(reason, 0) + 1
    if len(report["skipped_examples"]) < MAX_EXAMPLES:
        report["skipped_examples"].append({"record": where, "reason": reason, "detail": detail})


# ---------------------------------------------------------------- split
def split_dataset(
    source: str,
    fmt: str,
    out_paths: list[str],
    shard_size: int,
    max_samples: int | None,
    split: str | None,
    name: str,
    first_shard: int = 0,
    total_shards: int | None = None,
    revision: str | None = None,
) -> dict:
    """Normalize a dataset into JSONL shards; source record i goes to shard i // shard_size.

    `out_paths` are shards first_shard, first_shard + 1, ... of the `total_shards` the caller planned
    (`eagle3build.shardplan.plan_shards`; default: exactly these). The workflow runs one job per shard,
    so every rule has pattern outputs and a shard job reads only up to its range (JSONL lines before it
    are skipped unparsed). Records are numbered by their position in the source
    (ids f"{name}:{i}"), so a skipped record leaves a gap instead of shifting later records to another
    shard. The shards are written to temp files and renamed together, so a failure leaves none of them.
    """
    if shard_size < 1:
        raise UserError(f"prepare.shard_size must be >= 1, got {shard_size}")
    total_shards = total_shards or first_shard + len(out_paths)
    capacity = total_shards * shard_size
    limit = capacity if max_samples is None else min(max_samples, capacity)
    start, end = first_shard * shard_size, (first_shard + len(out_paths)) * shard_size
    report = {
        "source": source,
        "format": fmt,
        "records_read": 0,
        "conversations_written": 0,
        "shard_counts": [0] * len(out_paths),
        "skipped": {},
        "skipped_examples": [],
        "leading_assistant_turns_dropped": 0,
    }
    key = f"datasets[{name}].format"
    with contextlib.ExitStack() as stack:
        temps = [stack.enter_context(atomic_path(p)) for p in out_paths]
        shard, out = -1, None
        for index, record, conversation, dropped in iter_conversations(source, fmt, split, key, start, revision):
            if index >= end and index < limit:
                break  # the next shard's job takes it from here
            if index >= limit:
                if max_samples is None or max_samples > capacity:
                    raise UserError(
                        f"{source}: has more than the {capacity} records planned for "
                        f"{total_shards} shards; it changed since the workflow was planned, rerun"
                    )
                break
            report["records_read"] += 1
            if isinstance(conversation, SkipRecord):
                _note_skip(report, conversation.reason, record.where, str(conversation))
                continue
            if index // shard_size - first_shard != shard:
                if out is not None:
                    out.close()
                shard = index // shard_size - first_shard
                out = open(temps[shard], "w", encoding="utf-8")
            report["leading_assistant_turns_dropped"] += dropped
            out.write(json.dumps({"id": f"{name}:{index}", **conversation}, ensure_ascii=False) + "\n")
            report["shard_counts"][shard] += 1
            report["conversations_written"] += 1
        if out is not None:
            out.close()
        if not report["conversations_written"]:
            raise UserError(_no_conversations(report, name, first_shard, len(out_paths), total_shards))
    return report


def _no_conversations(report: dict, name: str, first_shard: int, shards: int, total_shards: int) -> str:
    """Why a split job wrote no conversation: a dataset (or a shard of it) that trains on nothing is a
    mistake, never a silent success."""
    what = f"dataset '{name}' ({report['source']})"
    if shards < total_shards:
        what += f", shard {first_shard}" if shards == 1 else f", shards {first_shard}-{first_shard + shards - 1}"
    if not report["records_read"]:
        return (f"{what}: yields no samples: the source has no records (an empty file or folder?), or fewer "
                "than when the workflow was planned; fill it or remove the dataset from `datasets`")
    example = report["skipped_examples"][0]
    return (f"{what}: yields no samples: all {report['records_read']} records were skipped "
            f"({', '.join(f'{k}: {v}' for k, v in sorted(report['skipped'].items()))}; e.g. {example['record']}: "
            f"{example['detail']}); check the dataset's format ('{report['format']}') and its records")


# ---------------------------------------------------------------- tokens
def _no_samples(report: dict, conv_path: str) -> str:
    """Why a tokens job kept no sample: a shard that trains on nothing is a mistake, never a silent
    success. The dataset is named by the shard's folder (data/<dataset>/ or regen/<dataset>/)."""
    what = f"dataset '{Path(conv_path).parent.name}' ({conv_path})"
    if not report["samples_in"]:
        return (f"{what}: yields no samples: the shard holds no conversation (every one was dropped before "
                "tokenizing, e.g. by regenerate.drop_truncated); check the dataset and its split report")
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(report["dropped"].items()))
    example = report["dropped_examples"][0]
    return (f"{what}: yields no samples: all {report['samples_in']} conversations were dropped ({reasons}; e.g. "
            f"{example['id']}: {example['reason']} {example['detail']}); a dataset needs assistant turns to train "
            "on (prompt-only datasets need `regenerate: true`) that fit prepare.max_length")


def _read_conversations(path: str) -> list[dict]:
    return [record.data for record in iter_jsonl(path)]


def tokenize_shard(
    conv_path: str, out_tokens: str, out_report: str, tokenizer: dict, max_length: int, thinking: str | None = None
) -> dict:
    """Render, tokenize and mask one conversation shard; write the token shard and its report.

    `tokenizer` = {"path", "revision", "trust_remote_code", "chat_template" (file or None)}; `thinking`:
    prepare.thinking (None: the schema's default; eagle3build.data.chat.conversation_samples). Samples
    longer than max_length are truncated; samples without an assistant turn, without loss tokens after
    truncation, that the chat template rejects, whose tools cannot be put in OpenAI form ("bad_tools"), or
    whose mask boundary falls inside a token (token-id path of tokenizers without offsets) are dropped and
    counted by reason.
    """
    import torch

    from eagle3build.config import resolve_section
    from eagle3build.data.chat import (
        MaskError,
        TemplateError,
        conversation_samples,
        encode_masked,
        load_tokenizer,
        special_tokens,
    )
    from eagle3build.data.tools import ToolError
    from eagle3build.shards import write_tokens

    if max_length < 2:
        raise UserError(f"prepare.max_length must be >= 2, got {max_length}")
    tok = load_tokenizer(
        tokenizer["path"],
        tokenizer.get("revision"),
        tokenizer.get("trust_remote_code") is True,
        tokenizer.get("chat_template"),
    )
    specials = special_tokens(tok)
    thinking = resolve_section("prepare", {} if thinking is None else {"thinking": thinking})["thinking"]
    conversations = _read_conversations(conv_path)
    report = {
        "source": conv_path,
        "tokenizer_class": type(tok).__name__,
        "max_length": max_length,
        "samples_in": len(conversations),
        "samples_kept": 0,
        "dropped": {},
        "dropped_examples": [],
        "truncated": 0,
        "tool_calls_as_text": 0,
        "thinking": thinking,
        "reasoning_as_text": 0,
        "samples_from_thinking_turns": 0,
        "tokens": 0,
        "loss_tokens": 0,
    }

    def drop(conversation: dict, reason: str, detail: str = "") -> None:
        report["dropped"][reason] = report["dropped"].get(reason, 0) + 1
        if len(report["dropped_examples"]) < MAX_EXAMPLES:
            report["dropped_examples"].append(
                {"id": conversation.get("id"), "reason": reason, "detail": detail}
            )

    rendered = []  # (conversation, Rendered) of the samples that reach the tokenizer
    for conversation in conversations:
        if not any(m["role"] == "assistant" for m in conversation["messages"]):
            drop(conversation, "no_assistant_turn")
            continue
        try:
            items = conversation_samples(tok, conversation, thinking, specials)
        except (TemplateError, ToolError) as e:
            drop(conversation, "bad_tools" if isinstance(e, ToolError) else "template_error", str(e))
            continue
        except UserError as e:
            raise UserError(f"{conv_path} conversation {conversation.get('id')}: {e}") from e
        report["tool_calls_as_text"] += items[-1].calls_as_text
        report["reasoning_as_text"] += items[-1].reasoning_as_text
        report["samples_from_thinking_turns"] += len(items) - 1
        rendered.extend((conversation, item) for item in items)

    input_ids, loss_masks = [], []
    for batch_start in range(0, len(rendered), TOKENIZE_BATCH):
        batch = rendered[batch_start : batch_start + TOKENIZE_BATCH]
        for (conversation, _), encoded in zip(batch, encode_masked(tok, [item for _, item in batch]), strict=True):
            if isinstance(encoded, MaskError):
                drop(conversation, "mask_boundary_inside_token", str(encoded))
                continue
            ids, mask = encoded
            if len(ids) > max_length:
                report["truncated"] += 1
                ids, mask = ids[:max_length], mask[:max_length]
            if not mask.any():
                drop(conversation, "no_loss_tokens", f"{len(ids)} tokens, none of them assistant tokens")
                continue
            input_ids.append(torch.tensor(ids, dtype=torch.int32))
            loss_masks.append(torch.from_numpy(mask))
            report["tokens"] += len(ids)
            report["loss_tokens"] += int(mask.sum())
    if report["samples_in"] and not input_ids and report["dropped"].get("template_error"):
        example = report["dropped_examples"][0]
        raise UserError(
            f"{conv_path}: the chat template failed on every conversation (e.g. {example['id']}: "
            f"{example['detail']}); set target.chat_template to a template that accepts these roles"
        )
    if not input_ids:
        raise UserError(_no_samples(report, conv_path))
    report["samples_kept"] = len(input_ids)
    write_tokens(
        out_tokens,
        input_ids,
        loss_masks,
        {
            "tokenizer": tokenizer["path"],
            "revision": tokenizer.get("revision"),
            "tokenizer_class": report["tokenizer_class"],
            "max_length": max_length,
        },
    )
    write_json_atomic(out_report, report)
    return report


# ---------------------------------------------------------------- mask viewer
def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, so that "".join(pieces) reads like decode(ids).

    Decoding one token at a time breaks characters split over several byte-level tokens; instead each
    token's text is the growth of decoding a short window that ends with it (a token that only completes
    a character later gets "" and the completing token carries the character).
    """
    pieces = []
    for j in range(len(ids)):
        window = ids[max(0, j - 6) : j + 1]
        before = tokenizer.decode(window[:-1], clean_up_tokenization_spaces=False)
        after = tokenizer.decode(window, clean_up_tokenization_spaces=False)
        if after.endswith("\ufffd"):
            pieces.append("")
        elif after.startswith(before.rstrip("\ufffd")):
            pieces.append(after[len(before.rstrip("\ufffd")) :])
        else:
            pieces.append(tokenizer.decode(window[-1:], clean_up_tokenization_spaces=False))
    return pieces


def format_sample(pieces: list[str], mask: list[int], color: bool) -> str:
    """Masked tokens in green (alternating shades show token boundaries) on a TTY, else inside [[...]]."""
    out = []
    for j, (piece, trained) in enumerate(zip(pieces, mask, strict=True)):
        if color:
            style = ("42;30" if j % 2 else "102;30") if trained else ("2" if j % 2 else "0")
            out.append(f"\x1b[{style}m{piece}\x1b[0m")
        else:
            opens = trained and (j == 0 or not mask[j - 1])
            closes = trained and (j == len(mask) - 1 or not mask[j + 1])
            out.append(("[[" if opens else "") + piece + ("]]" if closes else ""))
    return "".join(out)


def show_sample(
    tokens_path: str,
    index: int = 0,
    tokenizer_path: str | None = None,
    color: bool | None = None,
    out=None,
    trust_remote_code: bool = False,
) -> None:
    """Print one sample of a token shard with its trained (loss-masked) tokens highlighted, and a legend.

    The tokenizer defaults to the one recorded in the shard (the one that made it).
    """
    from eagle3build.shards import read_tokens

    out = out or sys.stdout
    shard = read_tokens(tokens_path)
    if not 0 <= index < shard.num_samples:
        raise UserError(
            f"{tokens_path}: --index {index} is out of range; the shard has {shard.num_samples} samples"
        )
    tokenizer_path = tokenizer_path or shard.meta.get("tokenizer")
    from transformers import AutoTokenizer

    revision = shard.meta.get("revision")
    # --config grants remote code; the policy still decides (a hub tokenizer's code runs only pinned)
    check_trust({"path": tokenizer_path, "revision": revision, "trust_remote_code": trust_remote_code})
    tok = AutoTokenizer.from_pretrained(
        tokenizer_path, revision=revision, trust_remote_code=trust_remote_code is True
    )
    ids, mask = (t.tolist() for t in shard.sample(index))
    color = out.isatty() if color is None else color
    print(format_sample(token_pieces(tok, ids), mask, color), file=out)
    marker = "\x1b[42;30mgreen\x1b[0m" if color else "[[...]]"
    trained = sum(mask)
    print(
        f"--- sample {index} of {shard.num_samples} in {tokens_path}: {len(ids)} tokens, "
        f"{trained} trained ({100 * trained / max(len(ids), 1):.1f}%) shown as {marker}, "
        f"{len(ids) - trained} context",
        file=out,
    )


def _config_trusts_remote_code(config_path: str | None) -> bool:
    if not config_path:
        return False
    import yaml

    try:
        config = yaml.safe_load(Path(config_path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"{config_path}: cannot read the config ({e})") from e
    return (config.get("target") or {}).get("trust_remote_code") is True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3build.data.prepare")
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print one prepared sample with its trained tokens highlighted")
    show.add_argument("tokens", help="a token shard (build/tokens/<dataset>/<shard>.safetensors)")
    show.add_argument("--index", type=int, default=0, help="sample index in the shard (default 0)")
    show.add_argument("--tokenizer", help="tokenizer path (default: the one recorded in the shard)")
    show.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    show.add_argument("--config", help="workflow config: only its target.trust_remote_code is read")
    args = parser.parse_args(argv)
    try:
        show_sample(
            args.tokens,
            args.index,
            args.tokenizer,
            {"auto": None, "always": True, "never": False}[args.color],
            trust_remote_code=_config_trusts_remote_code(args.config),
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

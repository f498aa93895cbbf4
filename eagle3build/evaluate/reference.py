"""The target's greedy reference decodes of many questions at once (`evaluate.reference_batch_size`).

Acceptance at temperature 0 is read off the target's own greedy decode of every turn (acceptance.py), so
those decodes need not run one question at a time: turn n of every question is decoded in batches
(left-padded, longest prompts first), then turn n+1 is asked after each question's own answer. Only the
questions that also run the sequential speculative loop (`evaluate.sequential_samples`) are decoded at
batch 1, where their timing is the speed baseline and their output the lossless check.

In bf16 a batched and an unbatched decode can part at near-ties of the target's logits; each is the
target's greedy decode under its own rounding, and acceptance is exact for the decode it is read from.

At a temperature > 0 the same batches sample instead (`sampling`: the target's own sampling at that
temperature and top-p, nothing else applied), and acceptance is read off those samples
(acceptance.sampled_acceptance).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import GenerationConfig


@torch.inference_mode()
def decode_batch(target, prompts: list[list[int]], max_new_tokens: int, eos: set[int], pad_id: int,
                 batch_size: int, sampling: dict | None = None) -> list[list[int]]:
    """Greedy continuation of every prompt, or with `sampling` ({temperature, top_p, seed}) a sample of it:
    its tokens up to and including the first end-of-sequence token, at most `max_new_tokens`. Prompts go
    in batches of `batch_size`, longest first."""
    device = next(target.parameters()).device
    outputs: list[list[int] | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        longest = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)  # [B, longest], left-padded
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, longest - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, longest - len(prompts[i]) :] = 1
        if sampling is None:
            how = GenerationConfig(do_sample=False)
        else:  # the target's distribution at T and top-p, nothing more (no top-k, no penalties)
            how = GenerationConfig(do_sample=True, temperature=sampling["temperature"], top_p=sampling["top_p"],
                                   top_k=0)
            torch.manual_seed(sampling["seed"] + start)  # one seed per batch: reproducible on a device
        how.update(max_new_tokens=max_new_tokens, eos_token_id=sorted(eos), pad_token_id=pad_id)
        generated = target.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=how,
        )[:, longest:]  # [B, <= max_new_tokens]
        for r, i in enumerate(rows):
            row = generated[r].tolist()
            end = next((j + 1 for j, token in enumerate(row) if token in eos), len(row))
            outputs[i] = row[:end]
    return outputs  # type: ignore[return-value]


def reference_decodes(target, questions: list[dict], chat_prompt: Callable[[list[dict]], list[int]],
                      answer_text: Callable[[list[int]], str], fits: Callable[[list[int]], bool],
                      max_new_tokens: int, eos: set[int], pad_id: int,
                      batch_size: int, sampling: dict | None = None) -> dict[tuple[int, int], list[int]]:
    """{(question index, turn index): the target's greedy decode of that turn (or its sample, see
    decode_batch)}: every question's turns in order, turn n+1 asked after `answer_text` of the question's
    own decode of turn n. A turn whose prompt does not `fit` ends its question (as in the sequential
    evaluator)."""
    decodes: dict[tuple[int, int], list[int]] = {}
    conversations: dict[int, list[dict]] = {qi: [] for qi in range(len(questions))}
    turn = 0
    while conversations:
        asked: dict[int, list[int]] = {}
        for qi, messages in conversations.items():
            if turn < len(questions[qi]["turns"]):
                messages.append({"role": "user", "content": questions[qi]["turns"][turn]})
                prompt = chat_prompt(messages)
                if fits(prompt):
                    asked[qi] = prompt
        turn_sampling = None if sampling is None else {**sampling, "seed": sampling["seed"] + 7919 * turn}
        answers = decode_batch(target, list(asked.values()), max_new_tokens, eos, pad_id, batch_size, turn_sampling)
        for qi, extended in zip(asked, answers, strict=True):
            decodes[(qi, turn)] = extended
            conversations[qi].append({"role": "assistant", "content": answer_text(extended)})
        conversations = {qi: conversations[qi] for qi in asked}
        turn += 1
    return decodes

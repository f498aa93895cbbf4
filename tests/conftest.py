"""Shared fixtures: tiny random-weight targets, the shared assets, token shards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
STORIES = SHARED / "assets" / "models" / "stories260K"
TOKENIZERS = SHARED / "assets" / "tokenizers"
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"

# A chat template for stories260K (a base model without one), as an inline string.
STORY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}User: {{ m.content }}\n"
    "{% elif m.role == 'assistant' %}Assistant: {{ m.content }}{{ eos_token }}\n"
    "{% else %}{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

torch.set_num_threads(2)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def need_shared():
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent (a fresh clone without the shared assets)")


@pytest.fixture
def stories260k() -> Path:
    need_shared()
    return STORIES


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A random-weight Llama of 6 layers, hidden 32, vocab 128, saved as a HF dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


class TargetReplayDraft(torch.nn.Module):
    """Base of the tests' stand-ins for Eagle3Draft that draft from the target itself: the token history is
    kept in the "KV cache", so a misaligned input token, RoPE position or cache crop in a decoding loop makes
    the history wrong, and with it the proposals. Subclasses turn the target's logits into draft outputs."""

    def __init__(self, target, first_token: int):
        super().__init__()
        self.target, self.first_token = target, first_token

    def replay(self, input_ids, position_ids, kv_cache):
        """(start, the target's logits after the replayed context, the new cache): logits[i] follow x[i],
        so logits[start + 1:] predict the tokens after this step's inputs."""
        history = kv_cache[0][0, 0, :, 0].long() if kv_cache is not None else torch.zeros(0, dtype=torch.long)
        start = len(history)
        assert position_ids[0].tolist() == list(range(start, start + input_ids.shape[1]))
        history = torch.cat([history, input_ids[0]])  # history[j] = x[j + 1]
        context = torch.cat([torch.tensor([self.first_token]), history])
        cache = history.float()[None, None, :, None]
        return start, self.target(input_ids=context[None]).logits[0], (cache, cache)

    def project_aux(self, aux):
        return aux

    def feedback(self, pre_norm_out):  # what the next draft step reads (a plain head: the output itself)
        return pre_norm_out

    def logits(self, pre_norm_out):
        return pre_norm_out

    def draft_to_target(self, ids):
        return ids

"""Stand-ins for Kimi-K2.5, built locally in tests (nothing downloaded).

- `write_tokenizer(folder)`: a slow tiktoken tokenizer loaded through `auto_map` with remote code,
  with Kimi's special-token style (<|im_user|>, <|im_assistant|>, <|im_middle|>, <|im_end|>, …) and a
  thinking template (reasoning rendered as <think>…</think>; history turns keep an empty block).
- `write_target(folder)`: a tiny random DeepSeek-V3-shaped target (MLA + MoE) with that tokenizer.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections import Counter
from pathlib import Path

SPECIAL_TOKENS = [
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "[PAD]",
]

CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.get('tool_call_id', '') }}\n"
    "{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user and m.get('reasoning_content') -%}<think>{{ m['reasoning_content'] }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ m['content'] or '' }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for tc in m['tool_calls'] -%}<|tool_call_begin|>functions.{{ tc['function']['name'] }}:{{ loop.index0 }}"
    "<|tool_call_argument_begin|>{{ tc['function']['arguments'] if tc['function']['arguments'] is string "
    "else tc['function']['arguments'] | tojson }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A speculative decoder drafts tokens and the target "
    "verifies them. Let me think about this step by step: the answer is 42, because 6 times 7 is 42. "
    "Hello! How can I help you today? Sure, here is the weather in Paris: sunny, 21 degrees. "
    "def add(a, b):\n    return a + b\n\n你好，世界。 Kimi thinks before it answers. "
) * 4


def _bpe_ranks(text: str, merges: int) -> dict[bytes, int]:
    """A small byte-level BPE: the 256 bytes, then the most frequent adjacent pairs within words."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for w in text.split(" ")]
    for _ in range(merges):
        pairs = Counter(p for w in words for p in zip(w, w[1:], strict=False))
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks[a + b] = len(ranks)
        merged = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged.append(out)
        words = merged
    return ranks


def write_tokenizer(folder: str | Path, merges: int = 200) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ranks = _bpe_ranks(CORPUS, merges)
    (folder / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in sorted(ranks.items(), key=lambda x: x[1]))
    )
    shutil.copy(Path(__file__).with_name("tokenization_standin.py"), folder / "tokenization_standin.py")
    config = {
        "auto_map": {"AutoTokenizer": ["tokenization_standin.StandinTikTokenTokenizer", None]},
        "tokenizer_class": "StandinTikTokenTokenizer",
        "special_tokens": SPECIAL_TOKENS,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "model_max_length": 1048576,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def vocab_size(merges: int = 200) -> int:
    return len(_bpe_ranks(CORPUS, merges)) + len(SPECIAL_TOKENS)


def write_target(folder: str | Path, num_layers: int = 4, hidden: int = 64, seed: int = 0) -> Path:
    """A tiny random DeepSeek-V3 (MLA + MoE) with the stand-in tokenizer, saved as safetensors."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    folder = write_tokenizer(folder)
    vocab = vocab_size()
    config = DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=num_layers, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=4096, bos_token_id=vocab - len(SPECIAL_TOKENS), eos_token_id=vocab - len(SPECIAL_TOKENS) + 1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return folder

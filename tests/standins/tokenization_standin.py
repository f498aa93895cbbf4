"""A Kimi-style slow tokenizer, shipped as a model repo's remote code (`auto_map`), for tests.

Like Kimi-K2.5's `tokenization_kimi.TikTokenTokenizer`: a `PreTrainedTokenizer` (slow: no offsets)
over a tiktoken BPE read from `tiktoken.model`, special tokens after the ranks. Nothing here is
Kimi's own code; only the shape of the interface is the same. When the environment variable
STANDIN_REMOTE_CODE_MARKER names a file, importing this module creates it: tests use that to prove
that no command runs a repository's code before the trust policy allows it.
"""

import base64
import os
from pathlib import Path

import tiktoken
from transformers import PreTrainedTokenizer

if os.environ.get("STANDIN_REMOTE_CODE_MARKER"):
    Path(os.environ["STANDIN_REMOTE_CODE_MARKER"]).write_text("remote code ran\n")

PAT_STR = r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _read_ranks(path):
    ranks = {}
    for line in Path(path).read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


class StandinTikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, special_tokens=None, **kwargs):
        ranks = _read_ranks(vocab_file)
        specials = list(special_tokens or [])
        self.special_ids = {tok: len(ranks) + i for i, tok in enumerate(specials)}
        self.model = tiktoken.Encoding(
            name=Path(vocab_file).parent.name, pat_str=PAT_STR, mergeable_ranks=ranks,
            special_tokens=self.special_ids,
        )
        self.id_to_bytes = {rank: token for token, rank in ranks.items()}
        self.vocab_file = vocab_file
        self.special_list = specials
        super().__init__(special_tokens=specials, **kwargs)
        self.add_tokens(specials, special_tokens=True)

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        vocab = {self._bytes_str(i): i for i in self.id_to_bytes}
        vocab.update(self.special_ids)
        return vocab

    def _bytes_str(self, i):
        return self.id_to_bytes[i].decode("latin-1")

    def _tokenize(self, text, **kwargs):
        return [self._bytes_str(i) for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        if token in self.special_ids:
            return self.special_ids[token]
        return self.model.encode_single_token(token.encode("latin-1"))

    def _convert_id_to_token(self, index):
        for tok, i in self.special_ids.items():
            if i == index:
                return tok
        return self._bytes_str(index)

    def convert_tokens_to_string(self, tokens):
        return b"".join(t.encode("latin-1") for t in tokens).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        out = Path(save_directory) / ((filename_prefix or "") + "tiktoken.model")
        if Path(self.vocab_file).resolve() != out.resolve():
            out.write_bytes(Path(self.vocab_file).read_bytes())
        return (str(out),)

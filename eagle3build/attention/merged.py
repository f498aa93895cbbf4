"""TTT attention as one causal attention over the step-0 keys + the exact merge of the diagonals.

`MergedAttention` holds what every such implementation shares (queries at the step rows, the merge);
a subclass supplies the causal part: `MathMergedAttention` with explicit math here, `FlexAttention`
(attention.flex) with flex attention.
"""

from __future__ import annotations

import torch

from eagle3build.attention.dense import dense_scores, step_mask
from eagle3build.attention.merge import at_every_row, merge_diagonal, token_major


class MergedAttention:
    """TTT attention as one causal attention over the step-0 keys + an exact LSE merge of the diagonals.

    The step-0 keys/values are computed once (step 0) and reused by every step; only the queries
    change. Subclasses supply `causal` (output and log-sum-exp of doc-masked causal attention).
    """

    def causal(self, q, k, v, doc, scale):
        raise NotImplementedError

    compile = False

    def __call__(self, q, keys, values, doc, step, scale, rows=None):
        if rows is None:
            out, lse = self.causal(q, keys[0], values[0], doc, scale)
        else:  # queries at `rows` only: the causal kernel runs at the length it was built for (the
            # other rows' queries are 0 and their outputs dropped, so they reach no gradient). Outputs are
            # gathered as whole token-major rows too (attention.merge.at_every_row)
            out, lse = self.causal(at_every_row(q, len(doc), rows), keys[0], values[0], doc, scale)
            out, lse = token_major(token_major(out).index_select(1, rows)), lse.index_select(2, rows)
        return merge_diagonal(q, out, lse, keys[1:], values[1:], scale, self.compile)


class MathMergedAttention(MergedAttention):
    """Dense causal part with explicit softmax: the CPU check of the merge (flex has no CPU backward)."""

    def __init__(self, compile: bool = False):
        self.compile = compile

    def causal(self, q, k, v, doc, scale):
        scores, v = dense_scores(q, k, v, step_mask(doc, 0), scale)
        return torch.softmax(scores, dim=-1).to(v.dtype) @ v, torch.logsumexp(scores, dim=-1)

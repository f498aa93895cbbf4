"""TTT attention on flex attention: the causal part block-sparse over the step-0 keys, then the merge.

The training default on GPUs (`train.attention: auto`). Blocks above the diagonal and across packed
samples are skipped; the diagonal keys of steps 1..s are folded in by the exact merge (attention.merge).
The kernels' tiles follow the device (attention.flex_options): torch's own on Hopper, smaller ones where
shared memory is small (sm_120 Blackwell workstation cards).
"""

from __future__ import annotations

import torch

from eagle3build.attention.flex_options import device_kernel_options
from eagle3build.attention.merged import MergedAttention
from eagle3build.compilation import compiled


class FlexAttention(MergedAttention):
    """Causal part by block-sparse flex attention over the step-0 keys only (blocks above the diagonal
    and across packed samples are skipped); its block mask is built once per batch and reused by all
    steps, and every step calls the kernel with the same shapes (one compilation per length).

    torch has no flex backward on CPU: training on CPU uses `sdpa` (same mask, dense).
    """

    def __init__(self, compile: bool):
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

        self.create_block_mask = create_block_mask
        self.flex_attention = compiled(flex_attention, dynamic=False) if compile else flex_attention
        self.aux_request = AuxRequest(lse=True)
        self.compile = compile
        self._doc = self._block_mask = None  # the batch the cached block mask belongs to
        self._options: dict = {}  # kernel options by (device, head dims, dtype): one lookup per shape

    def kernel_options(self, q: torch.Tensor, v: torch.Tensor) -> dict | None:
        """The device's flex kernel options (None: torch's own choice, see attention.flex_options)."""
        key = (q.device, q.shape[-1], v.shape[-1], q.dtype)
        if key not in self._options:
            self._options[key] = device_kernel_options(q.device, q.shape[-1], v.shape[-1], q.dtype.itemsize)
        return self._options[key]

    @staticmethod
    def mask_mod(doc: torch.Tensor):
        """Causal within a sample over the step-0 keys, N x N."""

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (doc[kv_idx] == doc[q_idx])

        return mask_mod

    def block_mask(self, doc: torch.Tensor):
        # keyed on the tensor object, which the cache keeps alive: a new batch is a new doc tensor
        if self._doc is not doc:
            n = len(doc)
            self._block_mask = self.create_block_mask(
                self.mask_mod(doc), None, None, n, n, device=doc.device, _compile=self.compile
            )
            self._doc = doc
        return self._block_mask

    def causal(self, q, k, v, doc, scale):
        out, aux = self.flex_attention(
            q,
            k,
            v,
            block_mask=self.block_mask(doc),
            scale=scale,
            enable_gqa=True,
            return_aux=self.aux_request,
            kernel_options=self.kernel_options(q, v),
        )
        return out, aux.lse

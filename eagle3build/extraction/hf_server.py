"""Hidden-state extraction, Hugging Face backend: the model side (loaded by the extraction server).

`Extractor` loads the target once and turns token shards into hidden shards. It captures, with
forward pre-hooks, the residual stream *entering* each aux layer (= HF `hidden_states[L]`) and the
stream entering the final norm (the pre-norm final state; HF's own `hidden_states[-1]` is post-norm),
so no logits and no extra hidden states are materialised. Samples are sorted by length and batched
under a token budget (right padding never changes a causal model's states at real positions); only
real tokens are stored, packed back to back, by a writer thread that overlaps disk writes with compute.

`serve` runs it behind a socket (`eagle3build.extraction.protocol`) for the shard jobs
(`eagle3build.extraction.job`, which imports no torch).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path

import torch

from eagle3build.atomic import write_json_atomic
from eagle3build.engine.process import end_self, start_ticks, watch_owner
from eagle3build.errors import UserError
from eagle3build.extraction.disk import check_disk
from eagle3build.extraction.protocol import (
    PROTOCOL_VERSION,
    READ_TIMEOUT_S,
    TOKEN_CHARS,
    ProtocolError,
    recv_request,
    send_message,
)
from eagle3build.shards import HiddenShardWriter, read_tokens
from eagle3build.trust import check_trust


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}[name]
    except KeyError:
        raise UserError(f"config key 'target.dtype': '{name}' is not one of auto, bfloat16, float16, float32") from None


def length_batches(lengths: list[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Group sample indices, longest first, so each padded batch (B x longest) fits the token budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and ((len(cur) + 1) * longest > batch_tokens or len(cur) >= max_batch_size):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


class Extractor:
    """A target model loaded once, with hooks that capture the aux and final streams."""

    def __init__(self, model: str, aux_layer_ids: list[int], device: str = "cpu", dtype: str = "auto",
                 revision: str | None = None, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        check_trust({"path": model, "revision": revision, "trust_remote_code": trust_remote_code})
        self.device = device
        self.dtype = resolve_dtype(dtype, device)
        self.model_id, self.revision = model, revision
        lm = AutoModelForCausalLM.from_pretrained(model, revision=revision,
                                                  trust_remote_code=trust_remote_code is True, dtype=self.dtype)
        base = lm.get_decoder()
        layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
        if layers is None or norm is None:
            raise UserError(f"{model}: the HF backend needs a decoder with `.layers` and a final `.norm` "
                            f"({type(base).__name__} has not); use extract.backend: vllm")
        n = len(layers)
        bad = [i for i in aux_layer_ids if not 0 <= i < n]
        if len(aux_layer_ids) != 3 or bad:
            raise UserError(f"config key 'extract.aux_layer_ids': {aux_layer_ids} must be three ids in [0, {n - 1}] "
                            f"for this {n}-layer target (default: 2, {n // 2}, {n - 3})")
        self.aux_layer_ids = list(aux_layer_ids)
        self.layer_ids = self.aux_layer_ids + [n]
        self.hidden_size = lm.config.get_text_config().hidden_size
        # Drop the lm_head: extraction never needs logits over the vocabulary.
        self.base = base.to(device).eval()
        del lm
        self._captured: dict[int, torch.Tensor] = {}
        for slot, module in enumerate([layers[i] for i in self.aux_layer_ids] + [norm]):
            module.register_forward_pre_hook(self._hook(slot), with_kwargs=True)

    def _hook(self, slot: int):
        def capture(module, args, kwargs):
            self._captured[slot] = args[0] if args else kwargs["hidden_states"]
        return capture

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> the states at `rows` (flat indices into B*T), packed: [len(rows), 4, H]
        (three aux streams, then the pre-norm final stream)."""
        self._captured.clear()
        self.base(input_ids=ids, attention_mask=attention_mask, use_cache=False)
        return torch.stack([self._captured[s].flatten(0, 1).index_select(0, rows) for s in range(4)], dim=1)

    def extract_shard(self, tokens_path: str, out_path: str, storage_dtype: str, batch_tokens: int,
                      max_batch_size: int, meta: dict | None = None, progress: bool = True) -> dict:
        shard = read_tokens(tokens_path)
        lengths = shard.lengths
        meta = {"model": str(self.model_id), "revision": self.revision or "", "layer_ids": self.layer_ids,
                "backend": "hf", "model_dtype": str(self.dtype).removeprefix("torch."), **(meta or {})}
        t0 = time.perf_counter()
        bar = _progress(total=int(shard.input_ids.numel()), desc=Path(out_path).name, enabled=progress)
        with HiddenShardWriter(out_path, shard.input_ids, shard.loss_mask, shard.cu_seqlens, self.hidden_size,
                               storage_dtype, meta) as writer:
            # Pinned inputs copied with non_blocking: a pageable host-to-device copy synchronises the stream,
            # which would stall the queue of forwards behind every batch.
            pin = self.device.startswith("cuda")
            for batch in length_batches(lengths, batch_tokens, max_batch_size):
                longest = lengths[batch[0]]
                ids = torch.zeros(len(batch), longest, dtype=torch.long, pin_memory=pin)
                mask = torch.zeros(len(batch), longest, dtype=torch.long, pin_memory=pin)
                spans = []
                for row, i in enumerate(batch):
                    a, b = int(shard.cu_seqlens[i]), int(shard.cu_seqlens[i + 1])
                    ids[row, : b - a] = shard.input_ids[a:b]
                    mask[row, : b - a] = 1
                    spans.append((a, b - a))
                # Real positions as flat indices computed here, so packing them needs no device sync.
                real = torch.cat([torch.arange(n) + row * longest for row, (_, n) in enumerate(spans)])
                real = real.pin_memory() if pin else real
                states = self.forward(*(t.to(self.device, non_blocking=True) for t in (ids, mask, real)))
                writer.write_batch(spans, states)
                bar.update(int(real.numel()))
        bar.close()
        seconds = time.perf_counter() - t0
        tokens = int(sum(lengths))
        return {"tokens": tokens, "samples": len(lengths), "seconds": seconds,
                "tokens_per_s": tokens / max(seconds, 1e-9)}


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=not enabled, file=sys.stderr,
                mininterval=2.0)


def run_request(extractor: Extractor, req: dict) -> dict:
    """One shard job's request: refuse unless the disk holds every pending shard, then extract."""
    check_disk(req["out"], req["pending"], extractor.hidden_size, req["storage_dtype"], req["disk_reserve_gb"],
               req.get("untokenized", 0))
    return extractor.extract_shard(req["tokens"], req["out"], req["storage_dtype"], req["batch_tokens"],
                                   req["max_batch_size"], req["meta"])


def handle_connection(conn: socket.socket, extractor: Extractor, token: str) -> None:
    """One connection: a request read under READ_TIMEOUT_S (token first, size bounded), then its shard."""
    conn.settimeout(READ_TIMEOUT_S)
    try:
        req = recv_request(conn, token)
    except (ProtocolError, TimeoutError) as e:
        print(f"refused a request: {e}", flush=True)
        with contextlib.suppress(OSError):
            send_message(conn, {"ok": False, "error": f"refused: {e}"})
        return
    except OSError as e:  # the client went away
        print(f"lost a client: {e}", flush=True)
        return
    try:
        print(f"extract {req['tokens']} -> {req['out']}", flush=True)
        stats = run_request(extractor, req)
        print(f"done {stats}", flush=True)
        reply = {"ok": True, **stats}
    except UserError as e:
        reply = {"ok": False, "error": str(e), "user_error": True}
    except Exception as e:  # report to the client, keep serving
        import traceback

        traceback.print_exc()
        reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    with contextlib.suppress(OSError):
        send_message(conn, reply)


def serve(identity: dict, state_file: str, idle_s: float, owner: dict | None = None) -> None:
    """Run an extraction server until idle for `idle_s` seconds, SIGTERM, or the end of `owner` ({"pid",
    "start_ticks"}: the workflow whose jobs it serves; a shard finished for a dead workflow is redone)."""
    if owner is not None:
        # SIGTERM unwinds the main thread: the shard being written loses its temp file, not its final name
        watch_owner(owner, lambda: end_self(f"its workflow (pid {owner['pid']}) ended", grace_s=30.0))
    if identity["device"].startswith("cuda"):
        torch.cuda.set_device(identity["device"])
    extractor = Extractor(identity["model"], identity["aux_layer_ids"], identity["device"], identity["dtype"],
                          identity["revision"], identity["trust_remote_code"])
    token = secrets.token_hex(TOKEN_CHARS // 2)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(1.0)
    state = {"pid": os.getpid(), "start_ticks": start_ticks(os.getpid()), "port": listener.getsockname()[1],
             "token": token, "identity": identity, "owner": owner, "protocol": PROTOCOL_VERSION}
    write_json_atomic(state_file, state)  # private (0600): it holds the token
    print(f"extraction server ready: {identity} on port {state['port']}", flush=True)
    try:
        last = time.monotonic()
        while time.monotonic() - last < idle_s:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                handle_connection(conn, extractor, token)
            last = time.monotonic()
        print("idle timeout: exiting", flush=True)
    finally:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            if json.loads(Path(state_file).read_text()).get("pid") == os.getpid():
                os.unlink(state_file)

"""On-disk shard formats (see docs/DESIGN.md and docs/FORMAT.md).

All shards are safetensors files. Samples are packed back to back without padding; `cu_seqlens`
delimits them. Hidden shards are large (8·H bytes per token in bf16), so they are written by a
streaming writer that lays out the safetensors header first and then writes rows at their offsets,
in any order, from a background thread — the file is renamed into place only once complete.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3build import FORMAT_VERSIONS
from eagle3build.atomic import (
    atomic_path,
    is_no_space,
    metadata_strings,
    no_space_error,
    save_safetensors_atomic,
)
from eagle3build.errors import UserError

TOKENS_FORMAT = "eagle3build.tokens"
HIDDEN_FORMAT = "eagle3build.hidden"
COUNTS_FORMAT = "eagle3build.counts"

NUM_SLOTS = 4  # three aux layers + the final (pre-norm) stream
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32",
              torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8", torch.float16: "F16"}
STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def parse_metadata(meta: dict[str, str]) -> dict:
    """safetensors metadata (strings) with JSON values decoded; other strings kept as they are."""
    out = {}
    for k, v in (meta or {}).items():
        try:
            out[k] = json.loads(v)
        except (json.JSONDecodeError, TypeError):
            out[k] = v
    return out


def read_meta(path: str | os.PathLike) -> dict:
    """Read only the metadata header of a shard (cheap even for a 10 GB file)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return parse_metadata(f.metadata())
    except Exception as e:  # safetensors raises several types for corrupt headers
        raise UserError(f"{path}: not a readable safetensors shard ({e}); delete it and rerun to rebuild it") from e


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return cu


def _check_format(path, meta: dict, expected: str) -> None:
    fmt = meta.get("format")
    if fmt != expected:
        raise UserError(f"{path}: expected a '{expected}' shard, found format '{fmt}'")


# ---------------------------------------------------------------- token shards
@dataclass
class TokenShard:
    input_ids: torch.Tensor  # int32 [N]
    loss_mask: torch.Tensor  # uint8 [N]
    cu_seqlens: torch.Tensor  # int64 [S+1]
    meta: dict = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1])
        return self.input_ids[a:b], self.loss_mask[a:b]


def write_tokens(path, input_ids: list, loss_masks: list, meta: dict) -> None:
    lengths = [len(x) for x in input_ids]
    ids = torch.cat([torch.as_tensor(x, dtype=torch.int32) for x in input_ids]) if input_ids else torch.zeros(0, dtype=torch.int32)
    mask = torch.cat([torch.as_tensor(m, dtype=torch.uint8) for m in loss_masks]) if loss_masks else torch.zeros(0, dtype=torch.uint8)
    full = {"format": TOKENS_FORMAT, "format_version": FORMAT_VERSIONS["tokens"],
            "num_samples": len(lengths), "num_tokens": int(sum(lengths)), **meta}
    save_safetensors_atomic(path, {"input_ids": ids, "loss_mask": mask, "cu_seqlens": _cu_seqlens(lengths)}, full)


def read_tokens(path) -> TokenShard:
    meta = read_meta(path)
    _check_format(path, meta, TOKENS_FORMAT)
    with safe_open(str(path), framework="pt") as f:
        return TokenShard(f.get_tensor("input_ids"), f.get_tensor("loss_mask"), f.get_tensor("cu_seqlens"), meta)


# ---------------------------------------------------------------- hidden shards
@dataclass
class HiddenShard(TokenShard):
    hidden: torch.Tensor = None  # [N, 4, H] dequantized

    def sample(self, i: int):  # type: ignore[override]
        a, b = int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1])
        return self.input_ids[a:b], self.loss_mask[a:b], self.hidden[a:b]


def quantize_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., H] float -> (e4m3 [..., H], fp32 scale [...]) with one scale per row."""
    # One fp32 copy; max |x| = max(max x, -min x) (exact, and no |x| copy; amax/amin are vectorised on CPU
    # where aminmax(dim=...) is 15-20x slower); divided and clamped in place: the same values as
    # (rows.float() / scale).clamp(...)
    scaled = rows.to(torch.float32, copy=True)
    amax = torch.maximum(scaled.amax(dim=-1), scaled.amin(dim=-1).neg()).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = scaled.div_(scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


class HiddenShardReader:
    """One hidden shard, read lazily: its tensors stay memory-mapped, and the rows a caller asks for
    are read (and dequantized) then. Threads may share a reader (the trainer's prefetch thread and its
    validation both read). A file that fails to read is named as a corrupted shard."""

    def __init__(self, path, device="cpu"):
        self.path = str(path)
        self.meta = read_meta(path)
        _check_format(path, self.meta, HIDDEN_FORMAT)
        self._device = str(device)
        self._file = None
        self._lock = threading.Lock()

    @contextmanager
    def _reading(self):
        with self._lock:
            try:
                if self._file is None:
                    self._file = safe_open(self.path, framework="pt", device=self._device)
                yield self._file
            except UserError:
                raise
            except Exception as e:
                raise UserError(
                    f"{self.path}: corrupted hidden-state shard ({e}); delete it and rerun to rebuild it"
                ) from e

    def cu_seqlens(self) -> torch.Tensor:
        """int64 [S+1], checked to end at the shard's last row."""
        with self._reading() as f:
            cu, rows = f.get_tensor("cu_seqlens"), int(f.get_slice("hidden").get_shape()[0])
            if int(cu[-1]) != rows:
                raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but hidden has {rows} rows")
            return cu

    def loss_mask(self) -> torch.Tensor:
        """uint8 [N], every token of the shard."""
        with self._reading() as f:
            return f.get_tensor("loss_mask")

    def rows(self, start: int = 0, end: int | None = None, dtype: torch.dtype = torch.float32):
        """Tokens [start, end): (input_ids int32 [n], loss_mask uint8 [n], hidden [n, 4, H] in `dtype`)."""
        input_ids, loss_mask, hidden, scale = self.stored_rows(start, end)
        if scale is not None:
            hidden = dequantize_fp8(hidden, scale, dtype)
        return input_ids, loss_mask, hidden.to(dtype)

    def stored_rows(self, start: int = 0, end: int | None = None):
        """Tokens [start, end) as stored: (input_ids int32 [n], loss_mask uint8 [n], hidden [n, 4, H] in the
        storage dtype, fp32 scales [n, 4] of fp8 rows or None). The trainer dequantizes fp8 rows on its GPU
        (PackedBatch.to): on the host it is a scalar conversion that can take longer than a training step,
        and the copy to the device would carry twice the bytes."""
        with self._reading() as f:
            input_ids = f.get_slice("input_ids")[start:end]
            loss_mask = f.get_slice("loss_mask")[start:end]
            hidden = f.get_slice("hidden")[start:end]
            fp8 = hidden.dtype == torch.float8_e4m3fn
            scale = f.get_slice("hidden_scale")[start:end] if fp8 else None
            return input_ids, loss_mask, hidden, scale


def read_hidden(path, dtype: torch.dtype = torch.float32, device="cpu") -> HiddenShard:
    """A whole hidden shard in memory, its states dequantized to `dtype`."""
    shard = HiddenShardReader(path, device)
    input_ids, loss_mask, hidden = shard.rows(dtype=dtype)
    return HiddenShard(input_ids, loss_mask, shard.cu_seqlens(), shard.meta, hidden=hidden)


class HiddenShardWriter:
    """Stream a hidden shard to disk: header first, then rows at their offsets from a writer thread.

    `write(offset, rows)` enqueues rows [n, 4, H] for tokens [offset, offset+n); `write_batch(spans, rows)`
    enqueues a packed batch whose consecutive row blocks go to several offsets (one sample each).
    GPU rows are cast (or fp8-quantised) on the GPU and copied to pinned host memory on a side stream, one
    copy per batch, so the copy overlaps the next forward and the writer thread only waits for its event
    and writes; CPU rows are converted on the writer thread. `close()` waits for the queue, checks every
    token was written, fsyncs and renames the file into place. `abort()` (or an exception inside a `with`
    block) removes the temp file.
    """

    def __init__(self, path, input_ids: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor,
                 hidden_size: int, storage_dtype: str, meta: dict, queue_depth: int = 4):
        if storage_dtype not in STORAGE_DTYPES:
            raise UserError(f"storage dtype '{storage_dtype}' is not one of {sorted(STORAGE_DTYPES)}")
        self.path = Path(path)
        self.num_tokens = n = int(input_ids.numel())
        self.hidden_size = hidden_size
        self.fp8 = storage_dtype == "fp8"
        self.dtype = STORAGE_DTYPES[storage_dtype]
        full_meta = {"format": HIDDEN_FORMAT, "format_version": FORMAT_VERSIONS["hidden"],
                     "num_tokens": n, "num_samples": int(len(cu_seqlens) - 1), "hidden_size": hidden_size,
                     "storage_dtype": storage_dtype, "final_norm": "pre", **meta}
        small = {"input_ids": input_ids.to(torch.int32).contiguous(), "loss_mask": loss_mask.to(torch.uint8).contiguous(),
                 "cu_seqlens": cu_seqlens.to(torch.int64).contiguous()}
        layout = [(k, v.dtype, list(v.shape)) for k, v in small.items()]
        if self.fp8:
            layout.append(("hidden_scale", torch.float32, [n, NUM_SLOTS]))
        layout.append(("hidden", self.dtype, [n, NUM_SLOTS, hidden_size]))
        header, offsets, pos = {}, {}, 0
        for name, dt, shape in layout:
            nbytes = dt.itemsize
            for s in shape:
                nbytes *= s
            header[name] = {"dtype": _ST_DTYPES[dt], "shape": shape, "data_offsets": [pos, pos + nbytes]}
            offsets[name] = pos
            pos += nbytes
        header["__metadata__"] = metadata_strings(full_meta)
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)
        self._data_start = 8 + len(hjson)
        self._offsets = offsets
        self.total_bytes = self._data_start + pos
        self._row_bytes = NUM_SLOTS * hidden_size * self.dtype.itemsize
        # atomic_path first removes the temps of this shard that a killed writer left (a full-size file each)
        self._ctx = atomic_path(self.path, need_bytes=self.total_bytes)
        self._tmp = self._ctx.__enter__()
        self._fd = None
        try:
            self._fd = os.open(self._tmp, os.O_WRONLY)
            os.ftruncate(self._fd, self.total_bytes)
            os.pwrite(self._fd, struct.pack("<Q", len(hjson)) + hjson, 0)
            for name, t in small.items():
                os.pwrite(self._fd, t.numpy().tobytes(), self._data_start + offsets[name])
        except BaseException as e:
            self._closed = True
            self._fail(e)
        self._written = torch.zeros(n, dtype=torch.bool)
        self._marks = threading.Lock()  # _written is marked by write_now's callers too
        self._copy_stream = None  # created on the first GPU batch
        # Bounds the batches in flight (and so the pinned host memory held) to queue_depth + 2.
        self._queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()
        self._closed = False

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue
            try:
                self._write_now(*item)
            except BaseException as e:  # reported on close()
                self._error = e

    def _to_host(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, object]:
        """GPU rows -> (pinned host data, pinned host scale or None, CUDA event that marks the copy done)."""
        rows = rows.detach()
        data, scale = quantize_fp8(rows) if self.fp8 else (rows.to(self.dtype), None)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=rows.device)
        producer = torch.cuda.current_stream(rows.device)
        self._copy_stream.wait_stream(producer)
        with torch.cuda.stream(self._copy_stream):
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            host.copy_(data, non_blocking=True)
            host_scale = None
            if scale is not None:
                host_scale = torch.empty(scale.shape, dtype=scale.dtype, pin_memory=True)
                host_scale.copy_(scale, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        # The GPU tensors are freed by the caller; keep the allocator from reusing them before the copy ran.
        data.record_stream(self._copy_stream)
        if scale is not None:
            scale.record_stream(self._copy_stream)
        return host, host_scale, done

    def _write_now(self, spans: list[tuple[int, int]], rows: torch.Tensor, scale: torch.Tensor | None,
                   done) -> None:
        if done is not None:  # staged by _to_host: wait for the async copy only
            done.synchronize()
        else:
            rows = rows.detach()
            if self.fp8:
                rows, scale = quantize_fp8(rows)
            else:
                rows = rows.to(self.dtype)
            rows = rows.cpu().contiguous()
            scale = None if scale is None else scale.cpu().contiguous()
        # memoryviews of the host buffers: no extra copy between the tensor and the kernel's write
        data = rows.view(torch.uint8).numpy().reshape(rows.shape[0], -1)
        scales = None if scale is None else scale.numpy()
        start = 0
        for offset, n in spans:
            os.pwrite(self._fd, memoryview(data[start:start + n]),
                      self._data_start + self._offsets["hidden"] + offset * self._row_bytes)
            if scales is not None:
                os.pwrite(self._fd, memoryview(scales[start:start + n]),
                          self._data_start + self._offsets["hidden_scale"] + offset * NUM_SLOTS * 4)
            with self._marks:
                self._written[offset:offset + n] = True
            start += n

    def write_now(self, offset: int, rows: torch.Tensor) -> None:
        """Convert CPU rows [n, 4, H] for tokens [offset, offset+n) and write them in the calling thread.

        For callers that produce rows from several threads (the vLLM client): conversion and writes then
        run in parallel (torch and pwrite release the GIL) instead of queueing behind one writer thread.
        Rows go in blocks of ~4 MiB of fp32, so a long sample's fp8 scratch stays small. Same bytes as
        `write`."""
        if rows.dim() != 3 or rows.shape[1:] != (NUM_SLOTS, self.hidden_size) or rows.is_cuda:
            raise ValueError(f"rows must be CPU [n, {NUM_SLOTS}, {self.hidden_size}], got {tuple(rows.shape)}")
        n = rows.shape[0]
        if offset < 0 or offset + n > self.num_tokens:
            raise ValueError(f"rows [{offset}, {offset + n}) outside the shard's {self.num_tokens} tokens")
        if self._error is not None:
            raise self._error
        block = max(1, (4 << 20) // (4 * NUM_SLOTS * self.hidden_size))
        for start in range(0, n, block):
            part = rows[start:start + block].detach()
            data, scale = quantize_fp8(part) if self.fp8 else (part.to(self.dtype), None)
            try:
                self._pwrite_rows(offset + start, data.contiguous(), scale)
            except OSError as e:  # a full disk as the UserError that says so, like close() does
                if is_no_space(e):
                    raise no_space_error(self.path, self.total_bytes, e) from e
                raise
        with self._marks:
            self._written[offset:offset + n] = True

    def _pwrite_rows(self, offset: int, data: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Host rows already in the storage dtype (and their fp8 scales) to tokens [offset, ...)."""
        os.pwrite(self._fd, memoryview(data.view(torch.uint8).numpy()).cast("B"),
                  self._data_start + self._offsets["hidden"] + offset * self._row_bytes)
        if scale is not None:
            os.pwrite(self._fd, memoryview(scale.contiguous().numpy()).cast("B"),
                      self._data_start + self._offsets["hidden_scale"] + offset * NUM_SLOTS * 4)

    def write(self, offset: int, rows: torch.Tensor) -> None:
        self.write_batch([(offset, rows.shape[0] if rows.dim() else 0)], rows)

    def write_batch(self, spans: list[tuple[int, int]], rows: torch.Tensor) -> None:
        """rows [sum(n), 4, H] packed; span (offset, n) takes the next n rows for tokens [offset, offset+n)."""
        if rows.dim() != 3 or rows.shape[1:] != (NUM_SLOTS, self.hidden_size):
            raise ValueError(f"rows must be [n, {NUM_SLOTS}, {self.hidden_size}], got {tuple(rows.shape)}")
        if sum(n for _, n in spans) != rows.shape[0]:
            raise ValueError(f"spans cover {sum(n for _, n in spans)} rows, the batch has {rows.shape[0]}")
        for offset, n in spans:
            if offset < 0 or offset + n > self.num_tokens:
                raise ValueError(f"rows [{offset}, {offset + n}) outside the shard's {self.num_tokens} tokens")
        if self._error is not None:
            raise self._error
        if rows.is_cuda:
            self._queue.put((spans, *self._to_host(rows)))
        else:
            self._queue.put((spans, rows, None, None))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        try:
            if self._error is not None:
                raise self._error
            missing = int((~self._written).sum())
            if missing:
                raise RuntimeError(f"{self.path}: {missing} of {self.num_tokens} token rows were never written")
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            self._ctx.__exit__(None, None, None)
        except BaseException as e:
            self._fail(e)

    def _fail(self, exc: BaseException):
        """Remove the temp file and raise `exc` (a full disk as the UserError that says so)."""
        self._abort_files(exc)
        if is_no_space(exc):
            raise no_space_error(self.path, self.total_bytes, exc) from exc
        raise exc

    def _abort_files(self, exc: BaseException | None = None) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        exc = exc or RuntimeError("aborted")
        try:
            self._ctx.__exit__(type(exc), exc, None)
        except BaseException:
            pass

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
            self._abort_files()

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            self.close()
        else:
            self.abort()
        return False


# ---------------------------------------------------------------- count shards
def write_counts(path, counts: torch.Tensor, meta: dict) -> None:
    full = {"format": COUNTS_FORMAT, "format_version": FORMAT_VERSIONS["vocab"], "vocab_size": int(counts.numel()), **meta}
    save_safetensors_atomic(path, {"counts": counts.to(torch.int64)}, full)


def read_counts(path) -> tuple[torch.Tensor, dict]:
    meta = read_meta(path)
    _check_format(path, meta, COUNTS_FORMAT)
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("counts"), meta


def hidden_bytes_per_token(hidden_size: int, storage_dtype: str) -> int:
    """Bytes a hidden shard stores per token (states + ids + mask (+ fp8 scales))."""
    if storage_dtype == "fp8":
        return NUM_SLOTS * hidden_size + NUM_SLOTS * 4 + 5
    return NUM_SLOTS * hidden_size * 2 + 5

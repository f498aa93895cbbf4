"""Flex attention's Triton kernel options by device: one place, one pure function of the device.

Inductor compiles flex attention into Triton kernels whose tiles (BLOCK_M/N forward, BLOCK_M1/N1/M2/N2
backward) and pipeline depth (num_stages) decide how much shared memory a thread block takes. Its
own choice comes from per-architecture tables (torch/_inductor/template_heuristics/triton.py) that
change between torch versions and are keyed on the exact head dim, while the kernels' tiles are sized
by the head dim rounded up to a power of two. GPUs with ~99 KB per block (sm_120 Blackwell
workstation cards such as the RTX PRO 6000; sm_86/sm_89) need small tiles, and whether torch gives
them depends on its version: torch 2.13 has sm_120 tables (a forward table for head dims 64/128/256,
falling back to (64, 64, 3 stages) for others such as Kimi-K2.5's 112 = 7168 / 64, and an `sm12x`
backward class); earlier versions give every major >= 10 Blackwell's backward (64, 128, 128, 64,
3 stages: estimated 141,312 bytes) and a forward fallback of (128, 64, 3 stages: 108,544 bytes), both
over sm_120's 101,376. Compilation then fails ("No valid triton configs ... out of resource: shared
memory") once the data is loaded.

So `flex_kernel_options` decides:
- a device with enough shared memory (Hopper: 227 KB, A100: 163 KB) gets None: torch's own choice,
  exactly what training used before this module existed;
- a device under `SMALL_SMEM_BYTES` gets explicit forward and backward options (`fwd_`/`bwd_` keys of
  flex attention's `kernel_options`): torch's tested sm_120 choices for the rounded head dim where
  they fit, else the largest smaller tile that does, by `forward_smem_bytes`/`backward_smem_bytes`.

The estimates are upper bounds of the kernels' real use, calibrated on the three published
measurements below (tests/test_blackwell.py checks each bound); `bench/sm120_smem_check.py` compiles
the chosen kernels for sm_120 and reads Triton's own figure.
"""

from __future__ import annotations

from dataclasses import dataclass

SM120_SMEM_PER_BLOCK = 101_376  # opt-in shared memory per block of sm_120 (and sm_86/sm_89), bytes
SMALL_SMEM_BYTES = 128 * 1024  # devices below this get explicit options; Hopper and A100 keep torch's
HEADROOM_BYTES = 4 * 1024  # kept free below the limit: the estimates are bounds, not exact figures
SCRATCH_BYTES = 10 * 1024  # reductions' scratch and barriers next to the tiles (fitted, see below)

# Measured shared memory of Inductor's flex kernels (bf16) that the estimates must bound:
#   forward  (64, 64, 3 stages), qk dim 192 (-> 256), v dim 128: 139,776 bytes (torch#180278, sm_86)
#   backward (64, 64, 64, 64, 1 stage), dim 256:                 114,688 bytes (torch#198224, sm_121)
#   backward (64, 64, 64, 64, 2 stages), dim 256:                140,800 bytes (unsloth-zoo#1165)
MEASURED = (
    ("forward", (64, 64, 3), 192, 128, 139_776),
    ("backward", (64, 64, 64, 64, 1), 256, 256, 114_688),
    ("backward", (64, 64, 64, 64, 2), 256, 256, 140_800),
)


@dataclass(frozen=True)
class Forward:
    block_m: int
    block_n: int
    num_stages: int
    num_warps: int


@dataclass(frozen=True)
class Backward:
    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_stages: int
    num_warps: int


# Small-shared-memory choices by rounded head dim: torch's sm_120 forward table (bf16) and its sm12x
# backward class; for 256 the backward tile of torch#198228, measured fastest of those that fit on sm_121.
SMALL_SMEM_FORWARD = {64: Forward(128, 64, 2, 4), 128: Forward(128, 64, 2, 8), 256: Forward(32, 64, 2, 4)}
SMALL_SMEM_BACKWARD = {
    64: Backward(64, 64, 64, 64, 2, 4),
    128: Backward(64, 64, 64, 64, 2, 4),
    256: Backward(32, 32, 32, 32, 2, 4),
}
# What a device with even less memory (or a wider head) steps down to, largest first.
FORWARD_LADDER = (
    Forward(64, 64, 2, 4),
    Forward(64, 32, 2, 4),
    Forward(32, 32, 2, 4),
    Forward(32, 16, 1, 4),
    Forward(16, 16, 1, 4),
)
BACKWARD_LADDER = (
    Backward(32, 32, 32, 32, 2, 4),
    Backward(32, 32, 32, 32, 1, 4),
    Backward(16, 16, 16, 16, 1, 4),
)


def rounded(dim: int) -> int:
    """The head dim as the kernels tile it (QK_HEAD_DIM_ROUNDED / V_HEAD_DIM_ROUNDED): the next power of two."""
    return 1 << max(int(dim) - 1, 0).bit_length()


def _buffers(num_stages: int) -> int:
    # Triton's software pipeliner keeps num_stages - 1 copies of each streamed tile on mma-v2 GPUs
    # (sm_80..sm_120); unpipelined (1 stage) a tile still passes through shared memory once.
    return max(num_stages - 1, 1)


def forward_smem_bytes(f: Forward, qk_dim: int, v_dim: int, itemsize: int = 2) -> int:
    """Upper bound of the forward kernel's shared memory: the query tile, the pipelined K and V tiles."""
    qk, v = rounded(qk_dim), rounded(v_dim)
    return itemsize * (f.block_m * qk + _buffers(f.num_stages) * f.block_n * (qk + v)) + SCRATCH_BYTES


def backward_smem_bytes(b: Backward, qk_dim: int, v_dim: int, itemsize: int = 2) -> int:
    """Upper bound of the backward kernel's shared memory: the larger of its two branches (one kernel,
    program ids split between them). dQ: Q and dO tiles held, K and V streamed; dK/dV: K and V held,
    Q and dO streamed."""
    qk, v = rounded(qk_dim), rounded(v_dim)
    n = _buffers(b.num_stages)
    dq = b.block_m2 * (qk + v) + n * b.block_n2 * (qk + v)
    dkv = b.block_n1 * (qk + v) + n * b.block_m1 * (qk + v)
    return itemsize * max(dq, dkv) + SCRATCH_BYTES


def small_smem(capability: tuple[int, int], smem_per_block: int | None) -> int | None:
    """The shared-memory limit to plan for, or None where torch's own choice fits. Without the
    property (older torch) the architecture decides: sm_86, sm_89 and sm_12x have 99 KB per block."""
    if smem_per_block is None:
        major, minor = capability
        small = major == 12 or (major == 8 and minor in (6, 9))
        return SM120_SMEM_PER_BLOCK if small else None
    return int(smem_per_block) if smem_per_block < SMALL_SMEM_BYTES else None


def _fit(preferred, ladder, estimate, budget):
    for choice in (*((preferred,) if preferred else ()), *ladder):
        if estimate(choice) <= budget:
            return choice
    return ladder[-1]  # nothing smaller exists: let the compiler say so


def choose(limit: int, qk_dim: int, v_dim: int, itemsize: int = 2) -> tuple[Forward, Backward]:
    """The forward and backward tiles for a device with `limit` bytes of shared memory per block."""
    dim = max(rounded(qk_dim), rounded(v_dim), 64)
    budget = limit - HEADROOM_BYTES
    fwd = _fit(
        SMALL_SMEM_FORWARD.get(dim),
        FORWARD_LADDER,
        lambda f: forward_smem_bytes(f, qk_dim, v_dim, itemsize),
        budget,
    )
    bwd = _fit(
        SMALL_SMEM_BACKWARD.get(dim),
        BACKWARD_LADDER,
        lambda b: backward_smem_bytes(b, qk_dim, v_dim, itemsize),
        budget,
    )
    return fwd, bwd


def as_kernel_options(fwd: Forward, bwd: Backward) -> dict[str, int]:
    """flex_attention's `kernel_options`: prefixed, so each pass gets only its own."""
    return {
        "fwd_BLOCK_M": fwd.block_m,
        "fwd_BLOCK_N": fwd.block_n,
        "fwd_num_stages": fwd.num_stages,
        "fwd_num_warps": fwd.num_warps,
        "bwd_BLOCK_M1": bwd.block_m1,
        "bwd_BLOCK_N1": bwd.block_n1,
        "bwd_BLOCK_M2": bwd.block_m2,
        "bwd_BLOCK_N2": bwd.block_n2,
        "bwd_num_stages": bwd.num_stages,
        "bwd_num_warps": bwd.num_warps,
    }


def flex_kernel_options(
    capability: tuple[int, int],
    smem_per_block: int | None,
    qk_dim: int,
    v_dim: int | None = None,
    itemsize: int = 2,
) -> dict[str, int] | None:
    """Flex attention's kernel options for a device: None (torch's choice) unless its shared memory is
    small, then tiles that fit (see the module doc). Pure: tests call it with any device's figures."""
    limit = small_smem(tuple(capability), smem_per_block)
    if limit is None:
        return None
    return as_kernel_options(*choose(limit, qk_dim, qk_dim if v_dim is None else v_dim, itemsize))


def device_smem(index: int) -> tuple[tuple[int, int], int | None]:
    """(compute capability, opt-in shared memory per block or None where torch does not report it)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), getattr(props, "shared_memory_per_block_optin", None)


def device_kernel_options(device, qk_dim: int, v_dim: int, itemsize: int) -> dict[str, int] | None:
    """flex_kernel_options for a torch device (None off CUDA)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    capability, smem = device_smem(device.index if device.index is not None else torch.cuda.current_device())
    return flex_kernel_options(capability, smem, qk_dim, v_dim, itemsize)

"""torch.compile with the training step's Inductor settings, and one compiled version per function.

Shared by the TTT step (ttt/) and its attention (attention/): every compiled piece of a training step
goes through `compiled`, so the settings below hold for all of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

COMPILED: dict[Callable, Callable] = {}  # cached_compiled's versions, by the function they compile


def compiled(fn: Callable, **kwargs) -> Callable:
    """torch.compile(fn, **kwargs), with Inductor's coordinate-descent tuning of its generated kernels on.

    The tuning times a few block sizes for each fused elementwise/reduction kernel the first time it is
    compiled (extra compile time for each batch length, kept in Inductor's on-disk cache: the image points
    TORCHINDUCTOR_CACHE_DIR at /cache) and makes the training step faster (BENCHMARKS.md).
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=0 turns it off.
    """
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    # A kernel compiled for static shapes meets each of training's length buckets (the step rows are
    # rounded to them too) with gradients and again under no_grad in validation: dynamo's default
    # limit (8 compilations per function) would run the rest eagerly.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 16)
    inductor_config.coordinate_descent_tuning = os.environ.get("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "1") == "1"
    return torch.compile(fn, **kwargs)


def cached_compiled(fn: Callable, compile: bool, dynamic: bool | None = False) -> Callable:
    """`fn` itself, or its torch.compile'd version (one per function, shared by all calls: `COMPILED`).
    dynamic=None: static but in the dims marked dynamic (attention.merge.stacked_diagonals)."""
    if not compile:
        return fn
    if fn not in COMPILED:
        COMPILED[fn] = compiled(fn, dynamic=dynamic)
    return COMPILED[fn]

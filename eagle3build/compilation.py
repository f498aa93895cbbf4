"""torch.compile with the training step's Inductor settings, and one compiled version per function.

Shared by the TTT step (ttt/) and its attention (attention/): every compiled piece of a training step
goes through `compiled`, so the settings below hold for all of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

COMPILED: dict[Callable, Callable] = {}  # cached_compiled's versions, by the function they compile
# Compiled training pads packed batches to one of this many lengths (train.data), each a multiple of 1024
# tokens at least: every compiled kernel of the step compiles once per length.
COMPILE_LENGTH_BUCKETS = 8
# Per length a kernel compiles once; the diagonal merge once per number of diagonals, and once more when its
# rows turn dynamic (attention.merge); validation runs with gradients enabled, so it compiles nothing of its own.
# The limit leaves a wide margin, because past it a function runs eagerly for the rest of the run (one warning,
# a slow run).
RECOMPILE_LIMIT = 8 * COMPILE_LENGTH_BUCKETS


def compiled(fn: Callable, **kwargs) -> Callable:
    """torch.compile(fn, **kwargs); Inductor's coordinate-descent tuning of its kernels only where
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1.

    The tuning times a few block sizes for each fused elementwise/reduction kernel the first time it is
    compiled, for each batch length a run meets: minutes of compilation before the first steps, for a step
    a few percent faster (BENCHMARKS.md §2), kept in Inductor's on-disk cache (the image points
    TORCHINDUCTOR_CACHE_DIR at /cache). Off by default, so a first run trains at once; worth turning on for
    a long run on a machine whose cache will be reused.
    """
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    # A kernel compiled for static shapes meets each of training's length buckets (the step rows are
    # rounded to them too): dynamo's default limit (8 compilations per function) would run the rest eagerly.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    inductor_config.coordinate_descent_tuning = os.environ.get("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "0") == "1"
    return torch.compile(fn, **kwargs)


def cached_compiled(fn: Callable, compile: bool, dynamic: bool | None = False) -> Callable:
    """`fn` itself, or its torch.compile'd version (one per function, shared by all calls: `COMPILED`).
    dynamic=None: dims turn dynamic as their sizes change (dynamo's default), but those marked dynamic
    (ttt.scorer); a list's length stays static (attention.merge: one compilation per number of diagonals)."""
    if not compile:
        return fn
    if fn not in COMPILED:
        COMPILED[fn] = compiled(fn, dynamic=dynamic)
    return COMPILED[fn]

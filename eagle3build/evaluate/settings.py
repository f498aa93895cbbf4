"""Which temperatures an evaluation samples at, and how its draws are seeded: the evaluate section's
sampling keys as the workflow (at planning, without torch) and both backends read them."""

from __future__ import annotations

import hashlib

from eagle3build.errors import ConfigError


def decode_seed(seed: int, *parts) -> int:
    """A seed of its own for one decode (or one request), from evaluate.seed and what names the decode
    (question, turn, k): a decode's draws do not depend on which other decodes ran before it."""
    text = ":".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def sampled_temperatures(params: dict) -> list[float]:
    """The temperatures > 0 of `evaluate.temperatures` (resolved), in order; checks that 0 is among them:
    the greedy rows are the report's main rows (its plot, the benchmarks), and the others sit beside them."""
    temperatures = [float(t) for t in params["temperatures"]]
    if 0.0 not in temperatures:
        raise ConfigError("evaluate.temperatures", f"{params['temperatures']} lacks 0; the report's main rows "
                                                   "are greedy (T = 0): list 0 too, e.g. [0, 1.0]")
    return [t for t in temperatures if t > 0]


def temperature_key(temperature: float) -> str:
    """The report key of a temperature > 0 ("1.0", "0.7")."""
    return str(float(temperature))

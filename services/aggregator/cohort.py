"""Who takes part in a round, and how many reports make a quorum (pure functions)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable


def sample_cohort(
    clients: Iterable[str], fraction: float, *, seed: int, round_index: int, attempt: int = 0
) -> list[str]:
    """A seeded sample of `fraction` of `clients` (at least one), sorted.

    The draw depends only on the seed, the round, the attempt and the set of clients (not
    their order), so a rerun of a job samples the same cohorts.
    """
    pool = sorted(set(clients))
    if not pool:
        return []
    size = min(len(pool), max(1, round_half_up(fraction * len(pool))))
    rng = random.Random(f"splitmq-cohort/{seed}/{round_index}/{attempt}")
    return sorted(rng.sample(pool, size))


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def quorum_size(cohort: int, quorum: float) -> int:
    """Reports needed to close at the deadline: `ceil(quorum * cohort)`, at least one."""
    # The epsilon keeps 0.5 * 4 at 2 despite float error in the product.
    return max(1, math.ceil(quorum * cohort - 1e-9))

"""The batch path, traced (issue 35): docs/architecture.md's generated blocks agree with a fresh
trace of a real sync SFL-V2 job, the path over RabbitMQ meets the issue's target, and nothing
disabled runs on it.

One trace per broker (`scripts/batch_path.py`, about 15 s each), shared by the module's tests.
The doc's blocks are compared file for file on each side; the calls per batch wobble with
timing (poll loops, frames pika reads in one piece or two), hence a tolerance on them.
"""

from __future__ import annotations

import pytest

from scripts.batch_path import DOC, PathTrace, Servers, documented, trace

pytestmark = pytest.mark.slow

# Each side's calls per batch may differ from the doc's by this share before the doc is stale.
CALLS_TOLERANCE = 0.10
# Issue 35's target over RabbitMQ: files of both sides together, the model's own blocks
# (models/) apart, as the 19-file baseline counted them; calls of both sides summed,
# the model's included (the baseline, 222 calls a batch, was the client's 86 plus the
# worker's 136).
MAX_FILES = 14
MAX_CALLS = 120
ABOVE_TARGET = pytest.mark.xfail(
    strict=True, reason="issue 35: path above target, see docs/architecture.md"
)
REGENERATE = "regenerate it: python scripts/batch_path.py --broker {} --write-docs"

# Features the traced job leaves off, and the product files that only they need: none of
# these may run per batch (the job: privacy.* unset, metrics off, sync, no model.tail). Work on
# a clock is not per batch: the worker's membership report calls the null `Metrics` now and
# then, which the doc lists among the occasional calls.
DISABLED = {
    "defences": ("services/algorithms/defences.py",),
    "metrics": ("services/metrics/",),
    "async mode": (
        "workers/clock.py",
        "services/algorithms/async_fold.py",
        "services/algorithms/staleness.py",
    ),
    "U-shaped split": ("services/algorithms/ushape.py",),
}
STILL_ON_PATH: dict[str, str] = {}


@pytest.fixture(scope="module")
def memory_path() -> PathTrace:
    return trace("memory")


@pytest.fixture(scope="module")
def rabbitmq_path(amqp_url: str, redis_url: str) -> PathTrace:
    return trace("rabbitmq", servers=Servers(amqp_url, redis_url))


def assert_documented(path: PathTrace) -> None:
    doc = documented(DOC.read_text(), path.broker)
    hint = REGENERATE.format(path.broker)
    for side in (path.client, path.worker):
        written_files = set(doc.files[side.name])
        new, gone = sorted(side.files - written_files), sorted(written_files - side.files)
        assert not new and not gone, (
            f"{side.name}'s files differ from {DOC.name}'s {path.broker} block: now on the "
            f"path {new}, no longer on it {gone}; " + hint
        )
        written = doc.side_total(side.name)
        assert abs(side.total - written) <= CALLS_TOLERANCE * written, (
            f"{side.name}: {side.total:.1f} calls per batch traced, {written:.1f} in "
            f"{DOC.name}'s {path.broker} block (more than {CALLS_TOLERANCE:.0%} apart); " + hint
        )


def test_the_embedded_block_of_the_doc_is_the_traced_path(memory_path: PathTrace) -> None:
    assert_documented(memory_path)


@pytest.mark.rabbitmq
@pytest.mark.redis
def test_the_rabbitmq_block_of_the_doc_is_the_traced_path(rabbitmq_path: PathTrace) -> None:
    assert_documented(rabbitmq_path)


def disabled_cases() -> list[object]:
    return [
        pytest.param(
            feature,
            marks=[pytest.mark.xfail(strict=True, reason=STILL_ON_PATH[feature])]
            if feature in STILL_ON_PATH
            else [],
            id=feature,
        )
        for feature in DISABLED
    ]


def assert_not_run(path: PathTrace, feature: str) -> None:
    run = sorted(f for f in path.files if f.startswith(DISABLED[feature]))
    assert not run, f"{feature} is off, yet {run} run on every batch ({path.broker})"


@pytest.mark.parametrize("feature", disabled_cases())
def test_nothing_disabled_runs_on_the_embedded_path(memory_path: PathTrace, feature: str) -> None:
    assert_not_run(memory_path, feature)


@pytest.mark.rabbitmq
@pytest.mark.redis
@pytest.mark.parametrize("feature", disabled_cases())
def test_nothing_disabled_runs_on_the_rabbitmq_path(rabbitmq_path: PathTrace, feature: str) -> None:
    assert_not_run(rabbitmq_path, feature)


@pytest.mark.rabbitmq
@pytest.mark.redis
@ABOVE_TARGET
def test_the_rabbitmq_path_crosses_at_most_14_files(rabbitmq_path: PathTrace) -> None:
    assert len(rabbitmq_path.path_files) <= MAX_FILES, sorted(rabbitmq_path.path_files)


@pytest.mark.rabbitmq
@pytest.mark.redis
def test_the_rabbitmq_path_makes_at_most_120_calls_per_batch(rabbitmq_path: PathTrace) -> None:
    path = rabbitmq_path
    assert path.total <= MAX_CALLS, (
        f"{path.total:.1f} calls per batch (client {path.client.total:.1f}, "
        f"worker {path.worker.total:.1f})"
    )

"""An embedded job whose clients' models diverge ends failed, and its clients stop as when a job
finishes (`rounds.max_empty_attempts`, services/aggregator/round_gate.py). The clients say they
dropped their rounds (`RoundDropped`), so no attempt waits for the round deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from services.client.stats import ClientStats
from services.common.backends import Backends
from services.common.supervise import RoleSpec
from services.config.root import Settings
from services.data.loaders import Dataset
from services.report.records import ListSink, MetricsSink
from services.runtime.embedded import run_embedded
from services.runtime.roles import embedded_roles

pytestmark = pytest.mark.slow

DEADLINE_S = 600.0


class Kept:
    """A role whose `run` result is kept (the supervisor only reports the aggregator's)."""

    def __init__(self, role: object, results: dict[str, object], name: str) -> None:
        self._role = role
        self._results = results
        self._name = name

    def run(self, stop: threading.Event) -> object:
        result = self._role.run(stop)  # type: ignore[attr-defined]
        self._results[self._name] = result
        return result


def test_a_job_whose_clients_diverge_fails_and_the_clients_stop(job: str) -> None:
    settings = Settings.model_validate(
        {
            "job": {"name": job, "rounds": 3},
            "data": {"dataset": "fashion_mnist_sample", "eval_samples": 200},
            # An absurd learning rate: NaN weights within the first round's few steps, which
            # every client then refuses to send, saying so.
            "algorithm": {"name": "fedavg", "batch_size": 32, "lr": 1e30, "max_steps_per_round": 3},
            "clients": {"count": 2, "min_to_start": 2},
            # A silent empty attempt would last twice the deadline (20 min here, far beyond the
            # test's timeout): only the clients' notices can end the attempts in time.
            "rounds": {"deadline_s": DEADLINE_S, "max_empty_attempts": 3},
        }
    )
    results: dict[str, object] = {}

    def build(
        s: Settings, backends: Backends, sink: MetricsSink, data: Dataset
    ) -> Sequence[RoleSpec]:
        specs = embedded_roles(s, backends, sink, data)
        return [RoleSpec(r.name, r.kind, Kept(r.role, results, r.name)) for r in specs]

    sink = ListSink()
    started = time.monotonic()
    outcome = run_embedded(settings, sink=sink, stop=threading.Event(), build_roles=build)
    assert time.monotonic() - started < DEADLINE_S

    reason = (
        "3 consecutive attempts at round 1 without one valid update; last reasons: non_finite ×2"
    )
    assert outcome.status == f"failed: {reason}" and outcome.exit_code == 1
    assert (outcome.failed_role, outcome.stuck) == ("", ())
    assert sink.status == outcome.status and sink.records == []
    for name in ("client-0", "client-1"):
        stats = results[name]
        assert isinstance(stats, ClientStats)
        # Dismissed (not stopped by the runner): each took the job's end and left.
        # Each dropped round 0 once per attempt: the reopened attempts reassigned it.
        assert stats.finished and stats.rounds == 0 and stats.rounds_aborted == 3

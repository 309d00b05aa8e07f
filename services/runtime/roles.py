"""Build the role objects of a job, for the embedded runner and the role processes (a client
host, which only `splitmq clients` runs, is built there).

Imports happen inside the builders so a process imports only the role it runs (a `splitmq
client` has no use for the worker or the aggregator code); the worker, whose package imports
services/, is loaded through its entry point (services/runtime/plugins.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from services.algorithms.registry import build_strategy
from services.client.data import JobData
from services.client.lending import ComputeGate
from services.common.backends import Backends
from services.common.jobdata import load_job_dataset
from services.common.schedule import Entry
from services.common.supervise import Role, RoleSpec
from services.config.root import Settings
from services.data.loaders import Dataset
from services.metrics.recorder import RecordMetrics
from services.report.records import MetricsSink
from services.report.sinks import TeeSink
from services.runtime.plugins import worker_factory


def preload_optimizer_code() -> None:
    """Import what torch's first optimizer imports (torch._dynamo, behind its
    `_disable_dynamo` wrapper): seconds of CPU on a small machine, otherwise paid inside round
    1 by the first worker or client to build an optimizer, while the others wait on the
    import lock. Called by the builders of the roles that train, before the role joins."""
    import torch._dynamo  # noqa: F401


def build_coordinator(settings: Settings, backends: Backends) -> Role:
    from services.coordinator.coordinator import Coordinator

    return Coordinator(settings, backends.for_role("coordinator"))


def build_aggregator(
    settings: Settings,
    backends: Backends,
    *,
    sink: MetricsSink,
    dataset: Dataset | None = None,
    cohorts: Mapping[int, Sequence[str]] | None = None,
) -> Role:
    """The aggregator with an evaluator on the job's test split (loaded unless given); none,
    and no data loaded, with `evaluation.enabled = false`. `cohorts`: a replay's (services/
    runtime/replay.py)."""
    from services.aggregator.aggregator import Aggregator
    from services.aggregator.evaluation import build_evaluator

    evaluator = None
    if settings.evaluation.enabled:
        data = dataset if dataset is not None else load_job_dataset(settings)
        evaluator = build_evaluator(settings, data.test)
    backends = backends.for_role("aggregator")
    if backends.metrics.enabled:
        sink = TeeSink([sink, RecordMetrics(backends.metrics)])
    return Aggregator(settings, backends, sink=sink, evaluator=evaluator, cohorts=cohorts)


def build_worker(
    settings: Settings,
    backends: Backends,
    *,
    worker_id: str,
    script: Mapping[int, Sequence[Entry]] | None = None,
) -> Role:
    """The worker comes from its entry point: workers/ imports services/, not the reverse.
    `script`: a replay's record, each shard's stream by shard (served in that order)."""
    factory = worker_factory()
    preload_optimizer_code()
    return factory.build_worker(
        settings, backends.for_role("worker", worker_id), worker_id=worker_id, script=script
    )


def build_client(
    settings: Settings,
    backends: Backends,
    *,
    client_id: str,
    partition: int | None = None,
    dataset: Dataset | JobData | None = None,
    compute: ComputeGate | None = None,
) -> Role:
    from services.client.client import Client

    preload_optimizer_code()
    return Client(
        settings,
        backends,
        client_id=client_id,
        partition=partition,
        dataset=dataset,
        compute=compute,
    )


def worker_count(settings: Settings) -> int:
    """Workers to start: none when the algorithm has no server-side layers (FedAvg)."""
    strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
    return settings.workers.count if strategy.server is not None else 0


def embedded_roles(
    settings: Settings,
    backends: Backends,
    sink: MetricsSink,
    dataset: Dataset,
    *,
    compute_slots: int | None = 0,
    cohorts: Mapping[int, Sequence[str]] | None = None,
    scripts: Mapping[int, Sequence[Entry]] | None = None,
) -> Sequence[RoleSpec]:
    """Every role of the job, in start order: the aggregator seeds version 1 first.

    `compute_slots`: clients in whole-model work at once (`ComputeGate`); 0: one per core,
    None: no limit (what benchmarks/embedded_cohort.py compares against). `cohorts`: a
    replay's recorded cohort per round (`build_aggregator`); `scripts`: its record's shard
    streams by shard, which the workers serve in the recorded order (`build_worker`)."""
    aggregator = build_aggregator(settings, backends, sink=sink, dataset=dataset, cohorts=cohorts)
    roles = [
        RoleSpec("aggregator", "aggregator", aggregator),
        RoleSpec("coordinator", "coordinator", build_coordinator(settings, backends)),
    ]
    roles += [
        RoleSpec(
            f"worker-{i}",
            "worker",
            build_worker(settings, backends, worker_id=f"worker-{i}", script=scripts),
        )
        for i in range(worker_count(settings))
    ]
    # One JobData: the clients share the loaded tensors and a single partitioning pass.
    shared = JobData(settings, dataset)
    # Whole-model rounds of a cohort on the same cores: one at a time per core. More at once
    # only add GIL hand-offs and cache misses (docs/benchmarks.md, "Embedded cohorts").
    compute = None if compute_slots is None else ComputeGate(compute_slots or os.cpu_count() or 1)
    roles += [
        RoleSpec(
            f"client-{i}",
            "client",
            build_client(
                settings,
                backends,
                client_id=f"client-{i}",
                partition=i,
                dataset=shared,
                compute=compute,
            ),
        )
        for i in range(settings.clients.count)
    ]
    return roles

"""`splitmq run`: every role of a job on threads of one process, over the in-memory broker/store.

One `Embedded` hub and store is shared by all roles; each role opens its own broker handle on
its own thread, exactly as it would against RabbitMQ, so the embedded run exercises the same
code paths as a deployment. The dataset is loaded once and shared by the clients and the
aggregator (read-only tensors).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from broker.errors import SplitMQError
from broker.store import ScheduleStore, VersionStore
from services.common.backends import Backends, Embedded
from services.common.jobdata import load_job_dataset
from services.common.jobmodel import job_model
from services.common.schedule import Header
from services.common.schedule_file import keep_schedule
from services.common.supervise import Outcome, RoleSpec, Supervisor
from services.config.root import Settings
from services.data.loaders import Dataset
from services.report.final_model import save_final_model
from services.report.records import MetricsSink
from services.report.sinks import RecordsOnly, TeeSink
from services.report.version_file import SavedVersion, VersionKeeper
from services.runtime.roles import embedded_roles

RoleBuilder = Callable[[Settings, Backends, MetricsSink, Dataset], Sequence[RoleSpec]]


def embedded_settings(settings: Settings) -> tuple[Settings, list[str]]:
    """`settings` with broker and store forced to the in-memory kinds, and what was changed."""
    update: dict[str, object] = {
        name: section.model_copy(update={"kind": "memory"})
        for name, section in (("broker", settings.broker), ("store", settings.store))
        if section.kind != "memory"
    }
    changed = [f"{name}.kind {getattr(settings, name).kind!r} -> 'memory'" for name in update]
    clients = settings.clients
    if settings.job.deterministic and clients.min_to_start < clients.count:
        # Who trains round 1 must not depend on which client threads started first.
        update["clients"] = clients.model_copy(update={"min_to_start": clients.count})
    return (settings.model_copy(update=update) if update else settings), changed


def force_embedded(settings: Settings, log: logging.Logger) -> Settings:
    """`embedded_settings`, saying so in the log when the file asked for real servers."""
    settings, changed = embedded_settings(settings)
    if changed:
        log.warning(
            "splitmq run is single-process: using the in-memory broker and store (%s); "
            "use `splitmq up` for RabbitMQ and Redis",
            ", ".join(changed),
        )
    return settings


def run_embedded(
    settings: Settings,
    *,
    sink: MetricsSink,
    stop: threading.Event,
    dataset: Dataset | None = None,
    build_roles: RoleBuilder = embedded_roles,
    logger: logging.Logger | None = None,
    backends: Backends | None = None,
    run_dir: Path | None = None,
    resume: SavedVersion | None = None,
) -> Outcome:
    """Run the job to its end (or until `stop`/Ctrl-C/a role failure) and say how it ended.

    `sink` gets every VersionRecord, and `finish` once, with the outcome's status. `backends`
    (with their `Embedded` hub and store) let the caller watch the run, e.g. for metrics.
    With `run_dir`, each recorded version is kept there for `--resume` (`VersionKeeper`), and
    the last version's weights (`save_final_model`), also when the run was stopped or failed:
    what it trained until then. `resume`: the job goes on from that version (a stopped run's,
    `load_version`) instead of seeding version 1.
    """
    log = logger or logging.getLogger("splitmq.runtime")
    settings = force_embedded(settings, log)
    if backends is None:
        backends = Backends(settings.broker, settings.store, Embedded())
    embedded = backends.embedded
    if embedded is None:
        raise ValueError("an embedded run needs backends with an Embedded hub and store")
    data = dataset if dataset is not None else load_job_dataset(settings)
    if resume is not None:
        embedded.store.restore_version(
            settings.job.name,
            resume.version,
            resume.blobs,
            samples=resume.samples,
            meta=resume.meta,
        )
    if run_dir is not None:
        keeper = VersionKeeper(embedded.store, settings.job.name, run_dir, log)
        sink = TeeSink([sink, keeper])
    try:
        roles = build_roles(settings, backends, RecordsOnly(sink), data)
    except Exception as exc:
        sink.finish(f"failed: could not build the roles: {exc!r}")
        raise
    outcome = Supervisor(roles, stop, logger=log).run()
    if run_dir is not None:  # the model and the schedule record (`keep_model`)
        keep_model(settings, embedded.store, run_dir, log)
    sink.finish(outcome.status)
    return outcome


def keep_model(
    settings: Settings, store: VersionStore, run_dir: Path, log: logging.Logger
) -> list[Path]:
    """The job's last version as safetensors in `run_dir` (`splitmq run` and `splitmq up`),
    and, when the store holds the run's schedule record (`ScheduleStore`: both of ours do),
    that record as `schedule.jsonl.gz` (`keep_schedule`); a failure of either is logged, not
    raised: the metrics already on disk are the run's record."""
    if isinstance(store, ScheduleStore):
        keep_schedule(run_dir, store, settings.job.name, schedule_header(settings), log)
    try:
        # Seeded as the aggregator's version 1, so entries no version carries get its values.
        template = job_model(settings, seed=settings.job.seed)
        return save_final_model(run_dir, store, settings.job.name, template)
    except (SplitMQError, OSError, ValueError) as exc:
        log.warning("could not keep the trained model in %s: %s", run_dir, exc)
        return []


def schedule_header(settings: Settings) -> Header:
    """The schedule record's header: the job, its seed and mode, and torch's intra-op threads
    in this process (an embedded run's roles run with them; `splitmq up` children are given
    the same budget's share, which this process does not know)."""
    import torch

    return Header(
        job=settings.job.name,
        seed=settings.job.seed,
        deterministic=settings.job.deterministic,
        mode="async" if settings.asynchronous_mode else "sync",
        torch_threads=torch.get_num_threads(),
    )

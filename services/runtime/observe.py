"""Metrics and the dashboard for one process: the endpoint, the watcher, the recorders.

`observed` wraps a role process (or the embedded runner, or `splitmq dashboard`): it makes the
process's `PrometheusMeters`, serves `/metrics` (and the dashboard where asked) on the port
`[metrics]` gives this kind of process, starts a `JobWatcher` where the job-wide gauges or the
dashboard need one, and yields the backends that hand every role its recorder. With
`metrics.enabled = false` it yields the backends untouched and serves nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from services.common.backends import Backends
from services.config.root import Settings
from services.dashboard.state import DashboardState, dashboard_routes
from services.dashboard.watch import JobWatcher
from services.metrics.endpoint import metrics_route, serve
from services.metrics.prometheus import PrometheusMeters

Echo = Callable[[str], None]


@dataclass(frozen=True)
class Observation:
    """What `observed` started; `url` is "" when no port could be had."""

    backends: Backends
    url: str = ""


def job_info(settings: Settings) -> dict[str, str | int]:
    return {
        "algorithm": settings.algorithm.name,
        "model": settings.model.name,
        "dataset": settings.data.dataset,
        "rounds": settings.job.rounds,
        "clients": settings.clients.count,
        "shards": settings.shards,
    }


@contextmanager
def observed(
    settings: Settings,
    kind: str,
    backends: Backends,
    *,
    echo: Echo,
    dashboard: bool = False,
    watch: bool = False,
    live: bool = True,
    run_dir: Path | None = None,
) -> Iterator[Observation]:
    """Serve this process's metrics while the block runs.

    `dashboard`: also serve the dashboard (it needs a watcher); `watch`: sample the job-wide
    gauges (version, members, queue depths); `live=False`: no broker or store, only the run
    directory (a finished embedded run).
    """
    config = settings.metrics
    if not config.enabled:
        yield Observation(backends)
        return
    meters = PrometheusMeters(settings.job.name)
    state = DashboardState(settings.job.name, job_info(settings)) if dashboard else None
    routes = {"/metrics": metrics_route(meters.registry)}
    if state is not None:
        routes.update(dashboard_routes(state))
    endpoint = serve(
        routes,
        host=config.host,
        first_port=config.first_port(kind),
        span=config.port_span,
        name=f"splitmq-{kind}-http",
    )
    if endpoint is not None:
        meters.url = endpoint.url
        echo(f"metrics: {endpoint.url}/metrics")
        if state is not None:
            echo(f"dashboard: {endpoint.url}/")
    backends = replace(backends, meters=meters)
    stop = threading.Event()
    thread: threading.Thread | None = None
    if watch or state is not None:
        watcher = JobWatcher(
            settings,
            backends,
            state=state,
            metrics=meters.job_gauges(),
            live=live,
            run_dir=run_dir,
            logger=logging.getLogger("splitmq.metrics"),
        )
        thread = threading.Thread(
            target=watcher.run, args=(stop,), name=f"splitmq-{kind}-watch", daemon=True
        )
        thread.start()
    try:
        yield Observation(backends, endpoint.url if endpoint else "")
    finally:
        stop.set()
        if thread is not None:
            thread.join(10.0)
        if endpoint is not None:
            endpoint.close()


def observe_role(
    settings: Settings, kind: str, backends: Backends, *, echo: Echo
) -> AbstractContextManager[Observation]:
    """`observed` as each role process wants it: the coordinator serves the dashboard, the
    coordinator and the aggregator watch the job-wide gauges, a worker serves its own
    metrics; clients (edge devices) serve nothing."""
    if kind == "client":
        return nullcontext(Observation(backends))
    return observed(
        settings,
        kind,
        backends,
        echo=echo,
        dashboard=kind == "coordinator" and settings.metrics.dashboard,
        watch=kind in ("coordinator", "aggregator"),
    )

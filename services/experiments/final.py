"""A service run followed by the experiment's `final_eval` of its last published version.

The embedded runner is given its hub and store, so once the job has ended the store still
holds the versions; the last one is read back and evaluated in this process, and the numbers
go to the run directory's `final.json` (read back as `RunResult.final`).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from broker.store import NO_VERSION
from services.aggregator.closing import read_version
from services.common.backends import Backends, Embedded
from services.config.root import Settings
from services.data.loaders import Dataset
from services.experiments.results import FINAL_JSON
from services.experiments.spec import FinalEval
from services.report.records import MetricsSink
from services.report.rundir import write_atomic
from services.runtime.embedded import embedded_settings, run_embedded


def run_service(
    settings: Settings,
    dataset: Dataset,
    sink: MetricsSink,
    stop: threading.Event,
    run_dir: Path,
    final_eval: FinalEval | None = None,
) -> None:
    """Run the job embedded; then `final_eval` its last version (`stop` is the run's own
    event, which the embedded runner sets when the job ends)."""
    if final_eval is None:
        run_embedded(settings, sink=sink, stop=stop, dataset=dataset)
        return
    embedded, _ = embedded_settings(settings)
    hub = Embedded()
    backends = Backends(embedded.broker, embedded.store, hub)
    run_embedded(settings, sink=sink, stop=stop, dataset=dataset, backends=backends)
    job = settings.job.name
    version = hub.store.current_version(job)
    if version == NO_VERSION:
        return
    metrics = dict(final_eval(settings, dataset, read_version(hub.store, job, version)))
    metrics["version"] = float(version)
    write_atomic(run_dir / FINAL_JSON, json.dumps(metrics, indent=1, sort_keys=True) + "\n")

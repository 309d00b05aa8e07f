"""The batch path, traced: which product files and functions one sync SFL-V2 batch runs.

    python scripts/batch_path.py [--broker memory|rabbitmq] [--write-docs]

Runs a small real job (cnn5 cut at block1, the shipped Fashion-MNIST sample, one client, one
worker, one round) with every role on threads of this process (`embedded_roles` under a
`Supervisor`, as `splitmq run` does), over the in-memory broker and store or over the real
RabbitMQ and Redis (SPLITMQ_AMQP_URL / SPLITMQ_REDIS_URL). A profiler (`sys.setprofile`, and
`threading.setprofile` for the roles' threads) counts the "call" events of product code:
functions whose file lies under broker/, models/, services/ or workers/ of this checkout,
including those a library calls back (pika's callbacks, logging's filters). Comprehensions and
generator expressions are not functions and are not counted (Python 3.12 inlines most of
them); a generator counts at each resumption, as the profiler reports it: its body is product
code run again (a client's batch iterator runs once a batch).

The window: the client's optimizer clears its gradients once a batch (`zero_grad`); the trace
opens at the clear of batch `warmup + 1` and closes `batches` clears later, so it holds whole
steady batches of one round and no round start or end (assignment, weights, evaluation,
aggregation, checkpoints). A call is the client's when it runs on the client's thread, the
worker's when it runs on the worker's thread or its decode thread; the heartbeat thread and the
service roles (aggregator, coordinator) run on time, not per batch, and are left out.

`--write-docs` replaces the broker's generated block in docs/architecture.md (between
`<!-- batch-path BROKER -->` and `<!-- /batch-path BROKER -->`);
tests/integration/test_batch_path.py checks that block against a fresh trace.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import threading
import types
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.config.root import Settings

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the product packages sit beside scripts/
    sys.path.insert(0, str(ROOT))

PRODUCT_PACKAGES = ("broker", "models", "services", "workers")
MODEL_DIR = "models/"
DOC = ROOT / "docs" / "architecture.md"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
REDIS_URL = "redis://127.0.0.1:6379/0"
WARMUP = 8
BROKERS = {"rabbitmq": "RabbitMQ and Redis", "memory": "the embedded broker and store"}
BATCHES = 40
# The client's clear of its gradients, once a batch: torch's, so that the window does not move
# when the product's own functions are renamed.
MARKER = ("torch/optim/optimizer.py", "zero_grad")
_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})

Function = tuple[str, str]  # (file relative to the repository, qualified name)
_MARK: Function = ("", "the window's marker")


@dataclass(frozen=True)
class Side:
    """One side's product calls per batch, by function: `calls` holds the functions run in at
    least half the traced batches (the path), `occasional` the others (time-driven work such
    as lease renewals, or work done every few batches), averaged over all batches."""

    name: str
    calls: Mapping[Function, float]
    occasional: Mapping[Function, float]

    @property
    def files(self) -> frozenset[str]:
        return frozenset(path for path, _ in self.calls)

    @property
    def total(self) -> float:
        return sum(self.calls.values())

    def by_file(self) -> dict[str, float]:
        per: dict[str, float] = {}
        for (path, _), n in self.calls.items():
            per[path] = per.get(path, 0.0) + n
        return per

    def functions_of(self, module: str) -> dict[str, float]:
        """The path's functions of one file, with their calls per batch."""
        return {name: n for (path, name), n in self.calls.items() if path == module}


@dataclass(frozen=True)
class PathTrace:
    """A traced window of `batches` steady batches."""

    broker: str
    batches: int
    client: Side
    worker: Side
    # Product calls per batch on the threads left out (heartbeats, the service roles), by thread.
    others: Mapping[str, float]

    @property
    def files(self) -> frozenset[str]:
        return self.client.files | self.worker.files

    @property
    def path_files(self) -> frozenset[str]:
        """The files of the path itself: the model's own blocks (models/) are the workload, the
        same in a plain training loop, and are counted apart (as issue 35's 19-file baseline,
        the doc's 12 files and the 7 it named, counted them)."""
        return frozenset(f for f in self.files if not f.startswith(MODEL_DIR))

    @property
    def model_files(self) -> frozenset[str]:
        return self.files - self.path_files

    @property
    def total(self) -> float:
        return self.client.total + self.worker.total


def side_of(thread_name: str) -> str | None:
    """The side a role's thread works for (thread names: the Supervisor's role names, the
    worker's decode pool's prefix); None for the others."""
    if thread_name.startswith("client-"):
        return "client"
    if thread_name.startswith(("worker-", "splitmq-decode")):
        return "worker"
    return None


Counts = Counter[tuple[Function, int]]  # (function, batch of the window) -> calls


class BatchTracer:
    """A profile function counting product calls by thread and batch, inside the window.

    Each thread writes only its own counter, so no lock is needed; the window's state is
    written by the client's thread only."""

    def __init__(self, root: Path, *, warmup: int, batches: int) -> None:
        self._prefixes = tuple(f"{root}{os.sep}{p}{os.sep}" for p in PRODUCT_PACKAGES)
        self._root_len = len(str(root)) + 1
        self._warmup = warmup
        self._batches = batches
        self._codes: dict[types.CodeType, Function | None] = {}
        self._local = threading.local()
        self._counts: list[tuple[str, Counts]] = []  # (thread name, its calls)
        self._marks = 0
        self._batch = -1  # the window's batch under way; -1: outside the window
        self.closed = threading.Event()

    def profile(self, frame: types.FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        try:
            what = self._codes[code]
        except KeyError:
            what = self._codes[code] = self._classify(code)
        if what is None:
            return
        if what is _MARK:
            self._mark()
        elif self._batch >= 0:
            self._counter()[what, self._batch] += 1

    def _classify(self, code: types.CodeType) -> Function | None:
        """The function's key if it is product code (`_MARK` for the marker), else None."""
        path = code.co_filename
        if path.endswith(MARKER[0]) and code.co_name == MARKER[1]:
            return _MARK
        if not path.startswith(self._prefixes) or code.co_name in _COMPREHENSIONS:
            return None
        return (path[self._root_len :].replace(os.sep, "/"), code.co_qualname)

    def _counter(self) -> Counts:
        # Thread-local, not keyed by thread id: a finished thread's id is given to the next.
        counter: Counts | None = getattr(self._local, "counter", None)
        if counter is None:
            counter = self._local.counter = Counter()
            self._counts.append((threading.current_thread().name, counter))
        return counter

    def _mark(self) -> None:
        if self.closed.is_set() or side_of(threading.current_thread().name) != "client":
            return
        self._marks += 1
        batch = self._marks - self._warmup - 1
        if batch == self._batches:
            self._batch = -1
            self.closed.set()
        elif batch >= 0:
            self._batch = batch

    def result(self, broker: str) -> PathTrace:
        if not self.closed.is_set():
            raise RuntimeError(
                f"the trace window never closed: {self._marks} of "
                f"{self._warmup + self._batches + 1} client steps seen (marker {MARKER})"
            )
        sides: dict[str | None, list[Counts]] = {}
        for thread, counter in self._counts:
            sides.setdefault(side_of(thread), []).append(counter)
        client, worker = (
            _side(name, sides.get(name, []), self._batches) for name in ("client", "worker")
        )
        others: dict[str, float] = {}
        for thread, counter in self._counts:
            if side_of(thread) is None:
                others[thread] = others.get(thread, 0.0) + sum(counter.values()) / self._batches
        return PathTrace(broker, self._batches, client, worker, others)


def _side(name: str, counters: list[Counts], batches: int) -> Side:
    calls: Counter[Function] = Counter()
    seen: dict[Function, set[int]] = {}
    for counter in counters:
        for (function, batch), n in counter.items():
            calls[function] += n
            seen.setdefault(function, set()).add(batch)
    path = {f: n / batches for f, n in calls.items() if 2 * len(seen[f]) >= batches}
    rest = {f: n / batches for f, n in calls.items() if f not in path}
    return Side(name, path, rest)


@contextmanager
def profiling(function: Callable[[types.FrameType, str, object], None]) -> Iterator[None]:
    """`function` as the profiler of this thread and of every thread started meanwhile."""
    threading.setprofile(function)
    sys.setprofile(function)
    try:
        yield
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


@dataclass(frozen=True)
class Servers:
    """Where the RabbitMQ variant's servers are (default: SPLITMQ_AMQP_URL, SPLITMQ_REDIS_URL,
    else the local ones)."""

    amqp_url: str = field(default_factory=lambda: os.environ.get("SPLITMQ_AMQP_URL", AMQP_URL))
    redis_url: str = field(default_factory=lambda: os.environ.get("SPLITMQ_REDIS_URL", REDIS_URL))


def job_settings(broker: str, job: str, steps: int, servers: Servers) -> Settings:
    """The traced job: sync SFL-V2 on the sample, one client and one worker, one round; the
    product's defaults otherwise, metrics off (the roles get no recorder here)."""
    from services.config.root import Settings

    real = broker == "rabbitmq"
    return Settings.model_validate(
        {
            "broker": {"kind": broker, "amqp_url": servers.amqp_url},
            "store": {"kind": "redis" if real else "memory", "redis_url": servers.redis_url},
            "job": {"name": job, "rounds": 1, "seed": 0},
            "model": {"name": "cnn5", "cut": "block1"},
            "data": {"dataset": "fashion_mnist_sample", "eval_samples": 100},
            "algorithm": {
                "name": "sfl_v2",
                "batch_size": 32,
                "lr": 0.05,
                "momentum": 0.9,
                "max_steps_per_round": steps,
            },
            "clients": {"count": 1, "min_to_start": 1},
            "workers": {"count": 1, "device": "cpu"},
            "metrics": {"enabled": False},
            "report": {"plots": False},
        }
    )


def trace(
    broker: str = "memory",
    *,
    warmup: int = WARMUP,
    batches: int = BATCHES,
    servers: Servers | None = None,
) -> PathTrace:
    """Run the job once and trace `batches` of its steady batches."""
    import torch

    from services.common.backends import Backends, Embedded
    from services.common.supervise import Supervisor
    from services.data.loaders import load_dataset
    from services.report.records import ListSink
    from services.runtime.processes import clear_job
    from services.runtime.roles import embedded_roles

    if broker not in BROKERS:
        raise ValueError(f"broker must be one of {sorted(BROKERS)}, not {broker!r}")
    steps = warmup + batches + 2
    settings = job_settings(broker, f"path{uuid.uuid4().hex[:10]}", steps, servers or Servers())
    real = broker == "rabbitmq"
    backends = Backends(settings.broker, settings.store, None if real else Embedded())
    roles = embedded_roles(settings, backends, ListSink(), load_dataset("fashion_mnist_sample"))
    tracer = BatchTracer(ROOT, warmup=warmup, batches=batches)
    stop = threading.Event()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the roles are threads already; a deployment gives each a core
    try:
        with profiling(tracer.profile):
            outcome = Supervisor(roles, stop, client_grace_s=10.0, join_timeout_s=20.0).run()
    finally:
        torch.set_num_threads(threads)
        if real:
            clear_job(settings, ["client-0"], backends)
    if not outcome.ok:
        raise RuntimeError(f"the traced job did not finish: {outcome.status}\n{outcome.traceback}")
    return tracer.result(broker)


# --- the generated block of docs/architecture.md ---


def _begin(broker: str) -> str:
    return f"<!-- batch-path {broker} -->"


def _end(broker: str) -> str:
    return f"<!-- /batch-path {broker} -->"


def _figure(n: float) -> str:
    return f"{n:.0f}" if abs(n - round(n)) < 0.05 else f"{n:.1f}"


def render(path: PathTrace, date: datetime.date) -> str:
    """The generated block for `path.broker`, markers included."""
    lines = [
        _begin(path.broker),
        f"Generated by `python scripts/batch_path.py --broker {path.broker} --write-docs` on "
        f"{date.isoformat()}: one sync SFL-V2 job over {BROKERS[path.broker]}, "
        f"{path.batches} steady batches of one round traced. "
        f"**{len(path.path_files)} files (and {len(path.model_files)} of the model's own "
        f"blocks in `models/`), {_figure(path.total)} calls per batch** "
        f"(client {len(path.client.files)} files, {_figure(path.client.total)} calls; "
        f"worker {len(path.worker.files)} files, {_figure(path.worker.total)} calls).",
        "",
        "| side | file | calls per batch | functions (calls per batch) |",
        "|---|---|---|---|",
    ]
    for side in (path.client, path.worker):
        per_file = side.by_file()
        for file in sorted(per_file, key=lambda f: (-per_file[f], f)):
            named = ", ".join(
                f"`{name}` {_figure(n)}" for name, n in _ranked(side.functions_of(file))
            )
            lines.append(f"| {side.name} | `{file}` | {_figure(per_file[file])} | {named} |")
    for side in (path.client, path.worker):
        if side.occasional:
            files = sorted({f for f, _ in side.occasional})
            lines += [
                "",
                f"Occasional on the {side.name}'s side (in fewer than half the batches, not "
                f"counted above; {_figure(sum(side.occasional.values()))} calls per batch on "
                f"average): {', '.join(f'`{f}`' for f in files)}.",
            ]
    lines.append(_end(path.broker))
    return "\n".join(lines)


def _ranked(calls: Mapping[str, float]) -> list[tuple[str, float]]:
    return sorted(calls.items(), key=lambda item: (-item[1], item[0]))


@dataclass(frozen=True)
class Documented:
    """What a generated block says: each side's files with their calls per batch."""

    files: Mapping[str, Mapping[str, float]]  # side -> file -> calls per batch

    def side_total(self, side: str) -> float:
        return sum(self.files.get(side, {}).values())

    @property
    def all_files(self) -> frozenset[str]:
        return frozenset(f for per in self.files.values() for f in per)


_ROW = re.compile(r"^\| (client|worker) \| `([^`]+)` \| ([0-9.]+) \|")


def documented(text: str, broker: str) -> Documented:
    """Read the generated block of `broker` back from the doc's text."""
    start, end = text.find(_begin(broker)), text.find(_end(broker))
    if start < 0 or end < start:
        raise ValueError(f"no generated batch-path block for {broker} in the doc")
    files: dict[str, dict[str, float]] = {"client": {}, "worker": {}}
    for line in text[start:end].splitlines():
        row = _ROW.match(line)
        if row:
            files[row[1]][row[2]] = float(row[3])
    return Documented(files)


def write_docs(path: PathTrace, doc: Path = DOC, date: datetime.date | None = None) -> None:
    """Replace `path.broker`'s generated block in `doc` (it must have the markers)."""
    text = doc.read_text()
    start, end = text.find(_begin(path.broker)), text.find(_end(path.broker))
    if start < 0 or end < start:
        raise ValueError(f"{doc} has no {_begin(path.broker)} ... {_end(path.broker)} markers")
    block = render(path, date or datetime.date.today())
    doc.write_text(text[:start] + block + text[end + len(_end(path.broker)) :])


def report(path: PathTrace) -> str:
    """The trace for a terminal: per side, each function's calls per batch, then the totals."""
    out = [f"batch path over {path.broker}, {path.batches} batches traced"]
    for side in (path.client, path.worker):
        out.append(f"\n{side.name}: {len(side.files)} files, {_figure(side.total)} calls/batch")
        for (file, name), n in sorted(side.calls.items(), key=lambda kv: (-kv[1], kv[0])):
            out.append(f"  {n:7.2f}  {file}  {name}")
        out.append(f"  occasional, {_figure(sum(side.occasional.values()))} calls/batch:")
        for (file, name), n in sorted(side.occasional.items(), key=lambda kv: (-kv[1], kv[0])):
            out.append(f"  {n:7.2f}  {file}  {name}")
    out.append(
        f"\ntotal: {len(path.path_files)} files (and {len(path.model_files)} in models/), "
        f"{_figure(path.total)} calls per batch"
    )
    left_out = ", ".join(f"{t} {_figure(n)}" for t, n in sorted(path.others.items()))
    out.append(f"left out (other threads, calls per batch): {left_out or 'none'}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=sorted(BROKERS), default="memory")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="batches before the window")
    parser.add_argument("--batches", type=int, default=BATCHES, help="batches traced")
    parser.add_argument("--write-docs", action="store_true", help="rewrite the broker's block")
    parser.add_argument("--doc", type=Path, default=DOC, help="the doc --write-docs rewrites")
    args = parser.parse_args(argv)
    path = trace(args.broker, warmup=args.warmup, batches=args.batches)
    print(report(path))
    if args.write_docs:
        write_docs(path, args.doc)
        print(f"\nwrote the {args.broker} block of {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

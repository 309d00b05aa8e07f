"""The run directory: `<report.dir>/<job>-<YYYYmmdd-HHMMSS>/` and what describes the run."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass, field, replace
from datetime import datetime
from importlib import metadata
from pathlib import Path

import torch

from services.algorithms.registry import build_strategy
from services.config.root import Settings
from services.config.runtime import usable_cores
from services.report.tomlwrite import dumps, redact

CONFIG_FILE = "config.toml"
METRICS_JSON = "metrics.json"
METRICS_CSV = "metrics.csv"
SUMMARY_FILE = "summary.txt"
# The folder holding the packages (services/, broker/...): a git checkout in development.
SOURCE_TREE = Path(__file__).resolve().parents[2]


def cut_label(settings: Settings) -> str:
    """Where the model is split, as the banner shows it; empty when the algorithm doesn't split."""
    algorithm = settings.algorithm
    server = build_strategy(algorithm.name, algorithm.params()).server
    return "" if server is None else server.cut_label(settings.model.cut)


@dataclass(frozen=True)
class RunInfo:
    """Who ran what, where and how it ended; stored beside the records in metrics.json."""

    job: str
    command: str
    started_at: str  # ISO 8601, local time with offset
    host: str
    python: str
    torch: str
    algorithm: str = ""
    model: str = ""
    cut: str = ""
    dataset: str = ""
    clients: int = 0
    shards: int = 0
    rounds: int = 0
    ended_at: str = ""
    status: str = "running"
    splitmq: str = ""  # the installed package's version
    git_commit: str = ""  # of the source tree the code ran from ("" outside a git checkout)
    # The thread budget of the run's processes ([runtime]; 0 and "" in older runs): torch's
    # intra-op and inter-op threads of each compute thread, and how they were chosen.
    torch_threads: int = 0
    torch_interop_threads: int = 0
    thread_budget: str = ""
    # How the roles ordered their work (`schedule_mode`; "" in runs from before issue 36).
    schedule: str = ""
    seed: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_settings(cls, settings: Settings, command: str, started: datetime) -> RunInfo:
        # What torch runs with in this process (the command applied the budget before
        # reporting), and the [runtime] rule when that is where it came from: a caller that
        # sets torch's threads itself (`splitmq experiment --torch-threads`) is said as such.
        budget = settings.runtime.budget(usable_cores())
        intra, inter = torch.get_num_threads(), torch.get_num_interop_threads()
        rule = budget.rule()
        if intra != budget.intra_op:
            rule = f"set by the command ([runtime] would give {budget.intra_op})"
        return cls(
            job=settings.job.name,
            command=command,
            started_at=started.astimezone().isoformat(timespec="seconds"),
            host=socket.gethostname(),
            python=platform.python_version(),
            torch=str(torch.__version__),
            algorithm=settings.algorithm.name,
            model=settings.model.name,
            cut=cut_label(settings),
            dataset=settings.data.dataset,
            clients=settings.clients.count,
            shards=settings.shards,
            rounds=settings.job.rounds,
            splitmq=package_version(),
            git_commit=source_commit(),
            torch_threads=intra,
            torch_interop_threads=inter,
            thread_budget=rule,
            schedule=schedule_mode(settings),
            seed=settings.job.seed,
        )

    def ended(self, status: str, at: datetime) -> RunInfo:
        return replace(self, status=status, ended_at=at.astimezone().isoformat(timespec="seconds"))


def schedule_mode(settings: Settings) -> str:
    """`deterministic` or `free-running` (`job.deterministic`), and the rounds' mode: what a
    reader needs to know before comparing two runs' numbers (docs/reproducibility.md)."""
    if settings.rounds.mode == "async":
        # The async buffer's folds and the replicas' checkpoints follow the wall clock: no
        # canonical order for them yet, whatever `job.deterministic` says.
        return "free-running, async (deterministic async runs are not built yet)"
    return f"{'deterministic' if settings.job.deterministic else 'free-running'}, sync"


def package_version() -> str:
    try:
        return metadata.version("splitmq")
    except metadata.PackageNotFoundError:  # run from a tree that was never installed
        return ""


@functools.cache
def source_commit(tree: Path = SOURCE_TREE) -> str:
    """The commit checked out where this code lives, `+dirty` when it has uncommitted changes
    to tracked files; "" when it is not a git checkout (an installed wheel) or git is absent.
    Asked once per process: a long grid's later runs still run the code it loaded, whatever
    was committed in the tree since."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=5, check=True
        )
        return done.stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{head}+dirty" if changed else head


def command_line() -> str:
    """The command as typed (program name shortened to `splitmq`)."""
    args = list(sys.argv)
    if args:
        args[0] = "splitmq"
    return " ".join(args)


def create_run_dir(base: Path, job: str, started: datetime) -> Path:
    """A new, empty directory for this run; a numeric suffix keeps same-second runs apart."""
    stamp = started.strftime("%Y%m%d-%H%M%S")
    base.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        name = f"{job}-{stamp}" if n == 1 else f"{job}-{stamp}-{n}"
        path = base / name
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"too many runs of {job!r} at {stamp} in {base}")


def write_config(run_dir: Path, settings: Settings) -> Path:
    """The effective settings (file + environment + defaults), passwords masked."""
    header = (
        "# Effective settings of this run (file, environment and defaults merged);\n"
        "# secrets are masked, so restore them before reusing this file.\n"
    )
    text = header + dumps(redact(settings.model_dump(mode="json")))
    return write_atomic(run_dir / CONFIG_FILE, text)


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Replace `path` in one step, so a crash never leaves a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    os.replace(tmp, path)
    return path

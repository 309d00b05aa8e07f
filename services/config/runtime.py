"""`[runtime]`: how many threads torch may use in a process, from the cores the host has and
how many compute threads share them (docs/deployment.md, "Threads").

torch's default is one intra-op thread per core in every process. `splitmq up` starts several
processes, and `splitmq run` several role threads, that all compute at once: each taking every
core oversubscribes them, and threads waiting at OpenMP barriers spin on cores another role
needs. The budget divides the cores instead.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from services.config.settings import _Section

TorchThreads = Literal["auto"] | int

# cgroup v2: "<quota> <period>" or "max <period>" (a container's --cpus).
_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


class RuntimeSection(_Section):
    # torch's intra-op (and inter-op) threads in each process: "auto" divides the host's cores
    # among the compute threads that share them (at least 1); a number sets exactly that many
    # in every process and role, whatever shares the host (SPLITMQ_RUNTIME__TORCH_THREADS).
    torch_threads: TorchThreads = "auto"
    # Compute threads sharing this host's cores: the clients and workers of `splitmq run` (one
    # process), the processes `splitmq up` starts, the clients of `splitmq clients`; each of
    # these commands multiplies it by what it starts. Set it when you start several roles on
    # one host yourself (compose without cpu limits), so that each takes its share.
    shared_by: int = Field(default=1, ge=1)

    def budget(self, cores: int) -> ThreadBudget:
        """The budget of one process of this host, which has `cores` cores."""
        return thread_budget(cores, self.shared_by, self.torch_threads)

    @field_validator("torch_threads", mode="before")
    @classmethod
    def _auto_or_count(cls, value: object) -> object:
        # One clear line instead of pydantic's two (not the literal, not an int); environment
        # values arrive as strings.
        text = value.strip().lower() if isinstance(value, str) else value
        if text == "auto":
            return "auto"
        if isinstance(text, str) and text.isdigit():
            text = int(text)
        if isinstance(text, int) and not isinstance(text, bool) and text >= 1:
            return text
        raise ValueError(f'must be "auto" or a whole number >= 1, got {value!r}')


@dataclass(frozen=True)
class ThreadBudget:
    """torch's pools in one process, and what they were derived from."""

    intra_op: int  # torch.set_num_threads: each compute thread's OpenMP team
    inter_op: int  # torch.set_num_interop_threads
    cores: int  # usable by this process (affinity, cgroup quota)
    shared_by: int  # compute threads on those cores, in this process and others
    setting: TorchThreads

    @property
    def shared(self) -> bool:
        """Whether other compute threads use the same cores (then waiting must not spin)."""
        return self.shared_by > 1

    def rule(self) -> str:
        """How the numbers were chosen."""
        if self.setting != "auto":
            return f"runtime.torch_threads = {self.setting}"
        return f"auto: {self.cores} cores shared by {self.shared_by} compute threads"

    def words(self) -> str:
        """One line for the logs."""
        return f"{self.intra_op} intra-op / {self.inter_op} inter-op ({self.rule()})"


def thread_budget(cores: int, shared_by: int, setting: TorchThreads = "auto") -> ThreadBudget:
    """The budget of each of `shared_by` compute threads on `cores` cores, be they processes or
    role threads of one process: every thread that calls torch gets its own OpenMP team of
    `intra_op` threads (torch.set_num_threads is the default each thread's team takes), so a
    process of several role threads shares the cores exactly as as many processes would. The
    inter-op pool (torch.jit.fork and friends; the roles use none) is sized alike: its threads
    block rather than spin, so it costs nothing while idle."""
    cores, shared_by = max(1, cores), max(1, shared_by)
    intra = setting if setting != "auto" else max(1, cores // shared_by)
    return ThreadBudget(intra, intra, cores, shared_by, setting)


def usable_cores(cpu_max: Path = _CPU_MAX) -> int:
    """The cores this process may run on: its CPU affinity (taskset, cpusets), lowered to a
    container's CPU quota (cgroup v2 cpu.max), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    try:
        quota, period = cpu_max.read_text(encoding="ascii").split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return cores
    return max(1, min(cores, math.ceil(int(quota) / int(period))))

"""Applying the thread budget (`services.config.runtime`) to this process and to the processes
`splitmq up` starts.

A child's budget travels in its environment: OpenMP and MKL read `OMP_NUM_THREADS`,
`MKL_NUM_THREADS` and `OMP_WAIT_POLICY` once, when torch loads them, which is before any code
of ours could call torch; the child then calls `apply_budget` with the same numbers (its
`[runtime] shared_by` is set too, so its own budget, its log line and its run header agree).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from services.config.root import Settings
from services.config.runtime import RuntimeSection, ThreadBudget, usable_cores

_log = logging.getLogger("splitmq.runtime")


def shared_by(settings: Settings, threads: int) -> Settings:
    """`settings` for a process or processes that add `threads` compute threads to this host
    (the roles of `splitmq run`, the clients of a host, the children of `splitmq up`)."""
    runtime = settings.runtime
    update = {"shared_by": runtime.shared_by * max(1, threads)}
    return settings.model_copy(update={"runtime": runtime.model_copy(update=update)})


def process_budget(settings: Settings) -> ThreadBudget:
    """This process's budget on this host's cores."""
    return settings.runtime.budget(usable_cores())


def apply_budget(budget: ThreadBudget) -> tuple[int, int]:
    """Size torch's pools in this process; the (intra-op, inter-op) threads now in effect.

    Call it before the roles start: torch.set_num_threads sets the default that each thread
    takes when it first runs a parallel op (its OpenMP team), so role threads started after
    it get the budget, and threads that already computed keep what they had. The inter-op
    pool can be sized only once per process and only before it was used: a second job in
    the same process (tests, experiments) keeps the first size, which is logged, not raised.
    """
    import torch  # here: the budget is set before any role imports torch's kernels

    torch.set_num_threads(budget.intra_op)
    try:
        torch.set_num_interop_threads(budget.inter_op)
    except RuntimeError:
        _log.debug("torch's inter-op pool is already sized; keeping it")
    return torch.get_num_threads(), torch.get_num_interop_threads()


@contextmanager
def budgeted(settings: Settings) -> Iterator[tuple[int, int]]:
    """`process_budget` applied for the block; the (intra-op, inter-op) threads in effect.
    torch's intra-op default is put back after it: a command invoked in a process that goes on
    (tests use click's runner) leaves it as it found it."""
    import torch

    before = torch.get_num_threads()
    applied = apply_budget(process_budget(settings))
    try:
        yield applied
    finally:
        torch.set_num_threads(before)


def say_budget(log: logging.Logger, settings: Settings, applied: tuple[int, int]) -> None:
    """The budget's log line (and what is in effect, where torch kept another size)."""
    budget = process_budget(settings)
    wanted = (budget.intra_op, budget.inter_op)
    in_effect = "" if applied == wanted else f"; in effect {applied}"
    log.info("torch threads: %s%s", budget.words(), in_effect)


def budget_env(budget: ThreadBudget, base: Mapping[str, str]) -> dict[str, str]:
    """`base` with the variables that give a child process `budget` from its first import of
    torch on. Passive waiting where processes share cores: an OpenMP thread that spins at a
    barrier burns a core that another process's role needs; a user's own OMP_WAIT_POLICY is
    kept."""
    env = dict(base)
    env["OMP_NUM_THREADS"] = str(budget.intra_op)
    env["MKL_NUM_THREADS"] = str(budget.intra_op)
    if budget.shared:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def sharing_env(base: Mapping[str, str], runtime: RuntimeSection, sharers: int) -> dict[str, str]:
    """`base` for a child that is one of `sharers` compute processes started on this host (the
    workers and clients of `splitmq up`, the local workers of `splitmq autoscale`): their share
    of the cores, and `[runtime] shared_by` so the child's own budget and report agree."""
    shared = runtime.model_copy(update={"shared_by": runtime.shared_by * max(1, sharers)})
    env = budget_env(shared.budget(usable_cores()), base)
    env["SPLITMQ_RUNTIME__SHARED_BY"] = str(shared.shared_by)
    return env

"""The thread budget: torch's pools per process from the host's cores and what shares them
(services/config/runtime.py), the `[runtime]` setting, what `splitmq up` hands its children,
and the run header."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from services.autoscaler.local import LocalProcessPool
from services.cli.role_cmds import make_pool
from services.config.loading import ConfigError, load_settings
from services.config.root import Settings
from services.config.runtime import RuntimeSection, thread_budget, usable_cores
from services.report.rundir import RunInfo
from services.report.summary import banner
from services.runtime.processes import child_env
from services.runtime.threads import apply_budget, budgeted, process_budget, shared_by


@pytest.mark.parametrize(
    ("cores", "shared", "setting", "threads"),
    [
        (2, 1, "auto", 2),  # a standalone role on its own machine takes every core
        (2, 5, "auto", 1),  # `up` of 4 clients + 1 worker on 2 cores: never below one
        (16, 5, "auto", 3),  # the cores divided, the remainder left idle
        (64, 1, "auto", 64),
        (16, 4, 6, 6),  # the setting wins whatever shares the host
        (2, 1, 8, 8),
    ],
)
def test_the_budget_divides_the_cores_among_what_shares_them(
    cores: int, shared: int, setting: int | str, threads: int
) -> None:
    budget = thread_budget(cores, shared, setting)  # type: ignore[arg-type]
    assert (budget.intra_op, budget.inter_op) == (threads, threads)
    assert budget.shared == (shared > 1)


def test_the_rule_is_said() -> None:
    assert thread_budget(2, 5).words() == (
        "1 intra-op / 1 inter-op (auto: 2 cores shared by 5 compute threads)"
    )
    assert thread_budget(2, 5, 3).rule() == "runtime.torch_threads = 3"


def test_processes_and_role_threads_multiply() -> None:
    settings = Settings()
    assert settings.runtime == RuntimeSection(torch_threads="auto", shared_by=1)
    host = shared_by(shared_by(settings, 3), 4)  # e.g. 3 processes on a host, 4 threads each
    assert host.runtime.shared_by == 12
    assert host.runtime.budget(24).intra_op == 2


@pytest.mark.parametrize("value", ["auto", "AUTO", "4", " 2 "])
def test_the_setting_takes_auto_or_a_count(value: str) -> None:
    settings = load_settings(None, {"SPLITMQ_RUNTIME__TORCH_THREADS": value})
    expected = value.strip().lower()
    assert settings.runtime.torch_threads == (expected if expected == "auto" else int(expected))


@pytest.mark.parametrize("value", ["0", "-1", "many", "1.5", "true"])
def test_a_bad_setting_is_one_clear_line(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(None, {"SPLITMQ_RUNTIME__TORCH_THREADS": value})
    lines = str(caught.value).splitlines()
    assert lines[1:] == [
        f"  runtime.torch_threads: must be \"auto\" or a whole number >= 1, got '{value}'"
    ]


def test_a_bad_setting_in_the_file_too(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text("[runtime]\ntorch_threads = 0\nshared_by = 0\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert "runtime.torch_threads: must be" in str(caught.value)
    assert "runtime.shared_by" in str(caught.value)


def test_up_gives_each_child_its_share_with_passive_waiting() -> None:
    env = child_env({"PATH": "/bin"}, workers=1, clients=4)
    threads = str(max(1, usable_cores() // 5))
    assert env["SPLITMQ_RUNTIME__SHARED_BY"] == "5"
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == threads
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    # The child reads the same settings from its environment: its budget is the one given.
    child = load_settings(None, env)
    assert str(child.runtime.budget(usable_cores()).intra_op) == threads


def test_up_keeps_the_users_setting_and_wait_policy() -> None:
    base = {"OMP_WAIT_POLICY": "ACTIVE"}
    env = child_env(base, workers=1, clients=1, runtime=RuntimeSection(torch_threads=3))
    assert env["OMP_NUM_THREADS"] == "3" and env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_autoscaled_local_workers_share_the_cores_among_the_most_it_starts(
    tmp_path: Path,
) -> None:
    settings = load_settings(None, {"SPLITMQ_AUTOSCALER__MAX_WORKERS": "3"})
    pool = make_pool(settings, tmp_path / "job.toml", None)
    assert isinstance(pool, LocalProcessPool)
    env = pool._env  # what every worker it starts is given
    assert env["SPLITMQ_RUNTIME__SHARED_BY"] == "3"
    assert env["OMP_NUM_THREADS"] == str(max(1, usable_cores() // 3))


def test_applying_twice_in_one_process_does_not_raise() -> None:
    import torch

    before = torch.get_num_threads()
    try:
        # The inter-op pool can be sized once per process: later jobs keep its size.
        intra, _ = apply_budget(thread_budget(4, 1, 1))
        assert intra == 1
        intra, inter = apply_budget(thread_budget(4, 1, 2))
        assert intra == 2 and inter >= 1
    finally:
        torch.set_num_threads(before)


def test_the_run_header_and_metrics_show_the_threads_torch_runs_with() -> None:
    import torch

    settings = shared_by(load_settings(None, {"SPLITMQ_RUNTIME__TORCH_THREADS": "2"}), 5)
    before = torch.get_num_threads()
    try:
        apply_budget(process_budget(settings))
        info = RunInfo.for_settings(settings, "splitmq run", datetime.now())
        torch.set_num_threads(1)  # a command that sets them itself (splitmq experiment)
        other = RunInfo.for_settings(settings, "splitmq experiment", datetime.now())
    finally:
        torch.set_num_threads(before)
    inter = torch.get_num_interop_threads()  # sized once per process: maybe by an earlier test
    assert (info.torch_threads, info.torch_interop_threads) == (2, inter)
    assert info.thread_budget == "runtime.torch_threads = 2"
    assert banner(info).splitlines()[1] == (
        f"torch threads: 2 intra-op / {inter} inter-op per compute thread "
        "(runtime.torch_threads = 2)"
    )
    assert other.torch_threads == 1
    assert other.thread_budget == "set by the command ([runtime] would give 2)"


def test_a_command_run_in_process_leaves_torch_as_it_found_it() -> None:
    import torch

    before = torch.get_num_threads()
    settings = load_settings(None, {"SPLITMQ_RUNTIME__TORCH_THREADS": str(before + 1)})
    with budgeted(settings) as (intra, _):
        assert intra == torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before

"""Roles on separate hosts (issue 12 item 4): the broker and store, the workers (with the
coordinator and the aggregator) and the clients in three network namespaces joined by veth
links, a sharded SFL job as separate processes, and mid-way through round 0 one link cut for
5 s. The job must ride it out: it finishes, every batch sent is applied exactly once, nothing
is left queued or dead-lettered. benchmarks/netns_soak.py has the layout and the measuring.

Needs root, `ip netns`, rabbitmq-server and redis-server (it starts its own inside the servers'
namespace; the machine's RabbitMQ and Redis are not touched). Locally a skip without them,
under CI=true a failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from benchmarks.netns import unavailable_reason
from benchmarks.netns_soak import NetnsConfig, NetnsReport, ThreeHosts, cut_table, run_job
from benchmarks.soak import table

pytestmark = [pytest.mark.slow, pytest.mark.netns]


def _require_hosts() -> None:
    missing = [b for b in ("rabbitmq-server", "redis-server") if shutil.which(b) is None]
    reason = unavailable_reason() or (f"not installed: {', '.join(missing)}" if missing else None)
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"{reason} (CI=true: a missing prerequisite is a failure, not a skip)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreeHosts]:
    """One set of hosts and servers for both jobs (each job has a name of its own)."""
    _require_hosts()
    with ThreeHosts(tmp_path_factory.mktemp("netns")) as where:
        yield where


def _run(link: str, where: ThreeHosts) -> NetnsReport:
    cfg = NetnsConfig(cuts=(link,), down_s=5.0)
    report = run_job(where, cfg)
    print(table(report.soak, None))
    print(cut_table(report))
    soak = report.soak
    assert report.problems == [] and soak.problems == []
    assert [c.link for c in report.cuts] == [link] and report.cuts[0].down_s >= cfg.down_s
    # The batches did cross that link: none arrived while it was down.
    assert report.cuts[0].stall_s >= cfg.down_s - 0.5
    assert soak.status == "finished" and soak.versions == cfg.soak.rounds
    assert soak.sent > 0 and soak.sent >= soak.sent_by_clients
    assert soak.duplicates == 0 and soak.dead_lettered == 0 and soak.left_in_queues == 0
    return report


@pytest.mark.timeout(240)
def test_the_clients_link_cut_for_5_s_loses_nothing(hosts: ThreeHosts) -> None:
    report = _run("clients", hosts)
    soak = report.soak
    assert soak.lost == 0 and soak.checksum_mismatches == 0
    assert soak.applied == soak.sent


@pytest.mark.timeout(240)
def test_the_workers_link_cut_for_5_s_loses_nothing(hosts: ThreeHosts) -> None:
    # The coordinator, the aggregator and the workers lose the broker and the store at once;
    # the shard leases (lease_ttl_s 5) may lapse meanwhile and change hands.
    # The next holder must get the batches the old one held before any newer ones, or it
    # takes them for copies (seqs rise per client): broker.rabbitmq_channels, _taken_over.
    report = _run("workers", hosts)
    soak = report.soak
    assert soak.lost == 0 and soak.checksum_mismatches == 0
    assert soak.applied == soak.sent

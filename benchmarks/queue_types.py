"""What quorum queues and a cluster cost: SFL-V2 samples/s over classic and quorum queues, on
one RabbitMQ node and on the three of `scripts/cluster.sh`, measured side by side; run by hand.

    python -m benchmarks.queue_types [--model cnn5] [--reps 3] [--rounds 3]

Each variant is one `benchmarks.sfl_deploy` deployment (aggregator, coordinator, one worker, 4
clients as processes; the one Redis at 127.0.0.1:6379), configured by environment only:

- classic, 1 node: the default RabbitMQ (`SPLITMQ_AMQP_URL`, 127.0.0.1:5672);
- quorum, 1 node: the same node, `broker.queue_type = "quorum"` (a quorum queue of one member:
  the cost of its log, without replication);
- classic, 3 nodes / quorum, 3 nodes: `broker.amqp_urls` = the local cluster's nodes, each
  role's connections on a random node (so most messages also cross between nodes).

The variants are interleaved rep by rep, so the machine's drift falls on all of them alike;
per variant the median of its rounds' windows (samples/s counted as in `sfl_throughput`), and
the ratio to classic on one node. Needs the cluster up (`scripts/cluster.sh up`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from benchmarks.cluster import LocalCluster
from benchmarks.common import command_line, machine_line
from benchmarks.sfl_deploy import ROOT, Case, Deployment
from benchmarks.sfl_throughput import PLANS, load_average


def variants(cluster: LocalCluster) -> dict[str, dict[str, str]]:
    nodes = ",".join(cluster.amqp_urls)
    return {
        "classic, 1 node": {"SPLITMQ_BROKER__QUEUE_TYPE": "classic"},
        "quorum, 1 node": {"SPLITMQ_BROKER__QUEUE_TYPE": "quorum"},
        "classic, 3 nodes": {"SPLITMQ_AMQP_URLS": nodes, "SPLITMQ_BROKER__QUEUE_TYPE": "classic"},
        "quorum, 3 nodes": {"SPLITMQ_AMQP_URLS": nodes, "SPLITMQ_BROKER__QUEUE_TYPE": "quorum"},
    }


@contextmanager
def environment(changes: Mapping[str, str]) -> Iterator[None]:
    """`os.environ` with `changes` (deployments read their settings from it)."""
    saved = dict(os.environ)
    if "SPLITMQ_AMQP_URLS" in changes:
        os.environ.pop("SPLITMQ_AMQP_URL", None)  # the cluster's first node is its amqp_url
    os.environ.update(changes)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", choices=list(PLANS), default="cnn5")
    parser.add_argument("--reps", type=int, default=3, help="deployments per variant")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (= windows) per deployment")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("SPLITMQ_DATA_DIR", ROOT.parent / "shared" / "data")),
    )
    args = parser.parse_args()
    cluster = LocalCluster()
    if not cluster.is_up():
        print("the local cluster is not up: run scripts/cluster.sh up", file=sys.stderr)
        return 2
    plan = PLANS[args.model]
    case = Case(
        model=plan.model,
        cut=plan.cut,
        dataset=plan.dataset,
        steps=plan.steps,
        rounds=args.rounds,
        warm=plan.warm,
        worker_threads=plan.worker_threads,
        eval_samples=plan.eval_samples,
    )
    load_before = load_average()
    rates: dict[str, list[float]] = {name: [] for name in variants(cluster)}
    for rep in range(args.reps):
        for name, changes in variants(cluster).items():
            workdir = Path(tempfile.mkdtemp(prefix="sflq-"))
            with environment(changes):
                result = Deployment(case, args.data_dir.resolve(), workdir).run(args.timeout)
            got = [w.rate for w in result.windows]
            print(f"rep {rep} {name}: {got} {result.problem}", file=sys.stderr, flush=True)
            if result.problem:
                print(f"  logs: {workdir}", file=sys.stderr)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
            rates[name].extend(got)
    base = statistics.median(rates["classic, 1 node"]) if rates["classic, 1 node"] else 0.0
    print(f"{machine_line()}; load before {load_before}, after {load_average()}")
    print(f"Command: `{command_line('benchmarks.queue_types')}`\n")
    print(
        f"| {args.model}, float32, 4 clients | samples/s (median) | windows | vs classic, 1 node |"
    )
    print("|---|---|---|---|")
    for name, got in rates.items():
        median = statistics.median(got) if got else 0.0
        ratio = f"{median / base:.2f}x" if base else "-"
        print(f"| {name} | {median:.0f} | {len(got)} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

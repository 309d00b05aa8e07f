"""What `appendfsync always` costs the weight store against `everysec`, or what
`store.min_replicas = 1` (WAIT) costs against 0; run by hand.

    python -m benchmarks.redis_fsync [--mode fsync|wait] [--dir DIR]
                                     [--models cnn5:block1,resnet18:layer1]
                                     [--versions 10] [--checkpoints 30] [--small 300]
                                     [--write-docs]

For each policy it starts a private `redis-server --appendonly yes --appendfsync POLICY` with
its AOF in a fresh directory under `--dir` (default: a temporary directory; give one on the
disk production would use, never tmpfs, where fsync costs nothing), and times, one call after
another from one client, the store operations the roles make:

- `publish_version`: a version of each model as SFL publishes it (client, aux and server
  parts: cnn5 at block1 about 95 KiB, resnet18 at layer1 about 45 MB), what the aggregator
  does once per round;
- `save_checkpoint`: the server part with a worker's bookkeeping, what a worker does every
  `workers.checkpoint_every_steps` steps before acking the batches it covers;
- `heartbeat` and `acquire_lease` (renewal): the small writes every role makes every second
  or so.

`--mode wait` starts one primary (`appendfsync always`) with one replica on loopback instead,
and times two stores on that primary side by side, `min_replicas` 0 and 1: the second WAITs
for the replica after each version commit and checkpoint save (the small writes never WAIT).

`--write-docs` rewrites the "redis-fsync" (or "redis-wait") section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
import torch

from benchmarks.common import Summary, command_line, machine_line, summarise, write_section
from broker.redis_store import RedisStoreOptions, RedisWeightStore
from broker.store import SERVER_PART, Checkpoint
from models.registry import build_model
from services.algorithms.registry import build_strategy

POLICIES = ("everysec", "always")
WAITS = ("min_replicas=0", "min_replicas=1")
Results = dict[str, dict[str, Summary]]  # setting -> operation -> timings
JOB = "bench-fsync"
Servers = list[subprocess.Popen[bytes]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(
    policy: str, directory: Path, replica_of: int | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "yes", "--appendfsync", policy, "--dir", str(directory)]
    if replica_of is not None:
        argv += ["--replicaof", "127.0.0.1", str(replica_of)]
    argv += ["--repl-diskless-sync-delay", "0"]
    with (directory / "redis.log").open("ab") as log:  # the server keeps its own descriptor
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    for _ in range(200):
        try:
            info: dict[str, object] = client.info("replication")
            if replica_of is None or info.get("master_link_status") == "up":
                return process, port
        except redis.ConnectionError:
            pass
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"redis-server ({policy}) did not start; see {directory}/redis.log")


def fsync_stores(name: str, base: Path, servers: Servers) -> dict[str, RedisWeightStore]:
    """A private server per appendfsync policy."""
    stores = {}
    for policy in POLICIES:
        directory = base / f"{name}-{policy}"
        directory.mkdir()
        process, port = start_redis(policy, directory)
        servers.append(process)
        stores[policy] = RedisWeightStore(f"redis://127.0.0.1:{port}/0")
    return stores


def wait_stores(name: str, base: Path, servers: Servers) -> dict[str, RedisWeightStore]:
    """One primary with one replica, and a store on it for each min_replicas."""
    (base / f"{name}-primary").mkdir()
    (base / f"{name}-replica").mkdir()
    process, port = start_redis("always", base / f"{name}-primary")
    servers.append(process)
    replica, _ = start_redis("always", base / f"{name}-replica", replica_of=port)
    servers.append(replica)
    url = f"redis://127.0.0.1:{port}/0"
    return {
        label: RedisWeightStore(url, RedisStoreOptions(min_replicas=n))
        for n, label in enumerate(WAITS)
    }


def measure(
    model_name: str, cut: str, stores: dict[str, RedisWeightStore], args: argparse.Namespace
) -> Results:
    """Both settings side by side, their calls interleaved (one on each store in turn), so
    that the load of a shared machine weighs on both alike."""
    torch.manual_seed(0)
    model = build_model(model_name, num_classes=10)
    blobs = build_strategy("sfl").initial_weights(model, cut)
    server = next(w for ref, w in blobs.items() if ref.part == SERVER_PART)
    generator = torch.Generator().manual_seed(1)
    # Fresh weights for each version (blobs are content-addressed: identical ones are shared),
    # made before the clock starts.
    versions = [
        {
            ref: {n: t + torch.randn(t.shape, generator=generator) for n, t in w.items()}
            for ref, w in blobs.items()
        }
        for _ in range(args.versions)
    ]
    checkpoints = [
        Checkpoint(0, i, {n: t + i for n, t in server.items()}, {"seqs": {"c": i}, "steps": i})
        for i in range(args.checkpoints)
    ]
    # A job per store: in --mode wait both stores share one server.
    jobs = {label: f"{JOB}-{i}" for i, label in enumerate(stores)}
    current = dict.fromkeys(stores, 0)

    def publish(p: str, i: int) -> None:
        current[p] = stores[p].publish_version(jobs[p], current[p], versions[i])

    ops: dict[str, tuple[int, Callable[[str, int], object]]] = {
        "publish_version": (args.versions, publish),
        "save_checkpoint": (
            args.checkpoints,
            lambda p, i: stores[p].save_checkpoint(jobs[p], checkpoints[i]),
        ),
        "heartbeat": (args.small, lambda p, i: stores[p].heartbeat(jobs[p], "w1", 5.0)),
        "acquire_lease": (
            args.small,
            lambda p, i: stores[p].acquire_lease(jobs[p], "shard-0", "w1", 5.0),
        ),
    }
    samples: dict[str, dict[str, list[float]]] = {p: {} for p in stores}
    for name, (count, op) in ops.items():
        for i in range(count):
            for p in stores:
                start = time.perf_counter()
                op(p, i)
                samples[p].setdefault(name, []).append(time.perf_counter() - start)
    return {p: {op: summarise(xs) for op, xs in by_op.items()} for p, by_op in samples.items()}


def report(results: dict[str, Results], args: argparse.Namespace, load: str) -> str:
    if args.mode == "wait":
        labels = WAITS
        what = (
            "What `store.min_replicas = 1` costs the weight store against 0: one client, one "
            "call after another, one private primary (`--appendonly yes --appendfsync always`, "
            f"AOF on {args.disk}) with one replica on loopback, a store of each setting on "
            "it, their calls interleaved; with 1 a version commit and a checkpoint save WAIT "
            "for the replica (the small writes never do)."
        )
    else:
        labels = POLICIES
        what = (
            "What `appendfsync always` costs the weight store against `everysec`: one client, "
            "one call after another, a private `redis-server --appendonly yes` per policy with "
            f"its AOF on {args.disk}, both running, their calls interleaved."
        )
    lines = [
        what + " Milliseconds per call as the role sees it (serialising and hashing the "
        "weights included), median / p90.",
        "",
        f"Command: `{command_line('benchmarks.redis_fsync')}`",
        "",
        f"Machine: {machine_line(load)}",
        "",
        "| model | operation | calls | " + " | ".join(labels) + " |",
        "|---|---|---|" + "---|" * len(labels),
    ]
    for model, by_label in results.items():
        for op, first in by_label[labels[0]].items():
            cells = [model, op, str(first.count)]
            for label in labels:
                s = by_label[label][op]
                cells.append(f"{s.median * 1e3:.2f} / {s.p90 * 1e3:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("fsync", "wait"), default="fsync")
    parser.add_argument("--dir", type=Path, default=None, help="Where the AOF directories go.")
    parser.add_argument("--models", default="cnn5:block1,resnet18:layer1", help="MODEL:CUT,...")
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument("--checkpoints", type=int, default=30)
    parser.add_argument("--small", type=int, default=300)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed")
    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="splitmq-fsync-", dir=args.dir))
    args.disk = describe_disk(base)
    load = f"load average {open('/proc/loadavg').read().split()[0]} at start"
    results: dict[str, Results] = {}
    open_stores = wait_stores if args.mode == "wait" else fsync_stores
    try:
        for spec in args.models.split(","):
            model, cut = spec.split(":")
            servers: Servers = []
            stores: dict[str, RedisWeightStore] = {}
            try:
                stores = open_stores(model, base, servers)
                results[f"{model} ({cut})"] = measure(model, cut, stores, args)
            finally:
                for store in stores.values():
                    store.close()
                for process in servers:
                    process.kill()
                    process.wait(10)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.mode == "wait":
        title, section = "## Redis replicas: min_replicas 1 (WAIT) vs 0", "redis-wait"
    else:
        title, section = "## Redis AOF: appendfsync always vs everysec", "redis-fsync"
    text = f"{title}\n\n" + report(results, args, load)
    print(text)
    if args.write_docs:
        write_section(section, text)


def describe_disk(path: Path) -> str:
    """The file system type under `path` (fsync on tmpfs is free: the numbers would lie)."""
    done = subprocess.run(
        ["df", "--output=fstype", str(path)], capture_output=True, text=True, check=False
    )
    kind = done.stdout.split()[-1] if done.returncode == 0 and done.stdout.split() else "?"
    return f"{kind} ({path.parent})"


if __name__ == "__main__":
    main()

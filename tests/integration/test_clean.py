"""`splitmq clean CONFIG`: a job's queues and Redis keys go, on the real servers."""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from broker.errors import BrokerError
from broker.store import NO_VERSION, BlobRef, JobStatus
from broker.topology import client_queue_names, reply_queue
from services.cli.main import cli
from services.common.backends import Backends
from services.common.membership import member_id
from services.config.loading import load_settings

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis]


def test_clean_removes_the_jobs_queues_and_keys_but_not_a_running_jobs(
    tmp_path: Path, amqp_url: str, redis_url: str, job: str
) -> None:
    config = tmp_path / "job.toml"
    # The file names the in-memory kinds: clean, like `up`, works on RabbitMQ and Redis.
    config.write_text(
        f'[job]\nname = "{job}"\n[clients]\ncount = 2\n'
        f'[broker]\namqp_url = "{amqp_url}"\n[store]\nredis_url = "{redis_url}"\n'
    )
    env = {"SPLITMQ_BROKER": "rabbitmq", "SPLITMQ_STORE": "redis"}
    settings = load_settings(config, env)
    backends = Backends(settings.broker, settings.store)
    queues = [q.name for q in settings.job_queues()]
    with closing(backends.open_broker("test-clean")) as broker:
        broker.declare(settings.job_queues())
        broker.declare([reply_queue(job, c) for c in ("client-1", "client-mine", "client-live")])
    with closing(backends.open_store()) as store:
        store.publish_version(job, NO_VERSION, {BlobRef("client"): {"w": torch.ones(2)}})
        store.heartbeat(job, member_id("client-live"), 60.0)

    try:
        refused = CliRunner().invoke(cli, ["clean", str(config)], env={"SPLITMQ_CONFIG": None})
        assert refused.exit_code == 1
        assert "has not ended and has 1 live member(s) (client-live)" in refused.output
        with closing(backends.open_store()) as store:
            assert store.current_version(job) == 1  # nothing was deleted
            store.set_job_status(job, JobStatus("finished"))

        result = CliRunner().invoke(
            cli, ["clean", str(config), "--client", "client-mine"], env={"SPLITMQ_CONFIG": None}
        )
        assert result.exit_code == 0, result.output
        out = result.output
        assert f"cleaned job {job}" in out and "4 client(s)" in out
        with closing(backends.open_store()) as store:
            assert store.current_version(job) == NO_VERSION and store.job_status(job) is None
            assert store.live_members(job) == {}
        with closing(backends.open_broker("test-clean")) as broker:
            for name in [
                *queues,
                *client_queue_names(job, "client-mine")[:1],
                reply_queue(job, "client-live").name,
            ]:
                with pytest.raises(BrokerError):
                    broker.queue_depth(name)
    finally:
        with closing(backends.open_store()) as store:
            store.delete_job(job)

"""compose/k8s/: the Kubernetes manifests, checked offline (no cluster runs here).

Core kinds are validated against Kubernetes' own OpenAPI schemas (the kubernetes-validate
package, strict: an unknown or misspelt field fails); the custom resources of the RabbitMQ
Cluster Operator and KEDA are checked for the fields they need; and the names, labels,
selectors, Secret keys and settings that tie the files together are checked against each
other, against the real CLI and config loader, and against broker/topology.py's queue names.
`kubectl kustomize` renders the whole base where kubectl is installed (skipped otherwise,
a failure under CI=true).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from broker.topology import (
    control_queue_name,
    dead_queue_name,
    reply_queue_name,
    shard_queue_name,
    updates_queue_name,
)
from services.config.loading import load_settings
from services.config.root import AutoscalerSection, Settings
from tests.unit.test_compose import parse_cli

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "compose" / "k8s"
KUSTOMIZATION = K8S / "kustomization.yaml"
JOB_TOML = K8S / "job.toml"
# The oldest Kubernetes these manifests are meant for (every kind is in a stable API there).
K8S_VERSION = "1.30.0"
ROLES = ("coordinator", "aggregator", "worker", "client")
# The coordinator and the workers serve until stopped; the aggregator and the clients exit 0
# at the end of the job, so they are Jobs (a Deployment would restart them forever).
ROLE_KINDS = {
    "coordinator": "Deployment",
    "worker": "Deployment",
    "aggregator": "Job",
    "client": "Job",
}
WORKLOADS = ("Deployment", "Job", "StatefulSet")
CONFIG_DIR = "/etc/splitmq"
NAMESPACE = "splitmq"
# Secrets the manifests may read, with their keys: the operator's generated default user of
# the RabbitmqCluster, and the Redis password made by hand (kustomization.yaml).
REDIS_SECRET = "splitmq-redis"
CUSTOM_KINDS = {"RabbitmqCluster", "ScaledObject", "TriggerAuthentication"}

Doc = dict[str, Any]


def kustomization() -> Doc:
    data = yaml.safe_load(KUSTOMIZATION.read_text())
    assert isinstance(data, dict)
    return data


def source_docs() -> list[Doc]:
    """The objects of the base as written: every resource file, plus the generated ConfigMap
    (under its name before kustomize appends the content hash)."""
    docs: list[Doc] = []
    for name in kustomization()["resources"]:
        docs += [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    for gen in kustomization()["configMapGenerator"]:
        data = {Path(f).name: (K8S / f).read_text() for f in gen["files"]}
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": gen["name"]},
                "data": data,
            }
        )
    return docs


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return source_docs()


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def containers(doc: Doc) -> list[Doc]:
    spec = doc["spec"]["template"]["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def secret_refs(doc: Doc) -> Iterator[tuple[str, str]]:
    for container in containers(doc):
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                yield ref["name"], ref["key"]


def role_workload(docs: list[Doc], role: str) -> Doc:
    return one(docs, ROLE_KINDS[role], f"splitmq-{role}")


def rabbitmq_cluster(docs: list[Doc]) -> Doc:
    (cluster,) = of_kind(docs, "RabbitmqCluster")
    return cluster


def default_user_secret(docs: list[Doc]) -> str:
    # The operator names it after the cluster (and gives it keys username and password).
    return f"{rabbitmq_cluster(docs)['metadata']['name']}-default-user"


def job_toml() -> dict[str, Any]:
    return tomllib.loads(JOB_TOML.read_text())


_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def container_env(container: Doc, secrets: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """The environment Kubernetes gives `container`: secret keys from `secrets`, and $(VAR)
    expanded from the variables before it (a reference to a later or unknown one stays as
    written, as Kubernetes leaves it: the test below fails on that)."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _REF.sub(lambda m: env.get(m[1], m[0]), str(var["value"]))
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[(ref["name"], ref["key"])]
    return env


def fake_secrets(docs: list[Doc]) -> dict[tuple[str, str], str]:
    """URL-safe stand-ins, like the operator's generated credentials."""
    user = default_user_secret(docs)
    return {
        (user, "username"): "default_user_Ab3-x_9",
        (user, "password"): "Pw-4_zZ9qQ",
        (REDIS_SECRET, "password"): "0123abcd",
    }


def role_settings(docs: list[Doc], role: str) -> Settings:
    """The settings a role's container loads: job.toml plus its environment."""
    (container,) = containers(role_workload(docs, role))
    return load_settings(JOB_TOML, container_env(container, fake_secrets(docs)))


# --- the files ----------------------------------------------------------------------------


def test_every_manifest_is_in_the_kustomization() -> None:
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {KUSTOMIZATION.name}
    assert listed == on_disk
    generated = {f for gen in kustomization()["configMapGenerator"] for f in gen["files"]}
    assert generated == {JOB_TOML.name}


def test_no_secret_is_written_in_the_manifests(docs: list[Doc]) -> None:
    assert not of_kind(docs, "Secret"), "credentials come from Secrets made outside the repo"
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            for container in containers(doc):
                for var in container.get("env", []):
                    if re.search("PASSWORD|USERNAME|TOKEN|SECRET", var["name"]):
                        assert "valueFrom" in var, f"{var['name']} must come from a Secret"
    text = JOB_TOML.read_text()
    for url in job_toml()["broker"]["amqp_urls"]:
        assert urlparse(url).password is None, url
    assert urlparse(job_toml()["store"]["redis_url"]).password is None
    assert "password" not in text.lower().replace("no password", "")


def core_ids() -> list[str]:
    return [
        f"{d['kind']}/{d['metadata']['name']}"
        for d in source_docs()
        if d["kind"] not in CUSTOM_KINDS
    ]


@pytest.mark.parametrize("ident", core_ids())
def test_core_objects_match_the_kubernetes_schema(docs: list[Doc], ident: str) -> None:
    kind, name = ident.split("/")
    doc = one(docs, kind, name)
    # strict: no field the schema does not know (a typo, a field at the wrong level).
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_namespaced_objects_leave_the_namespace_to_kustomize(docs: list[Doc]) -> None:
    assert kustomization()["namespace"] == NAMESPACE
    assert one(docs, "Namespace", NAMESPACE)
    for doc in docs:
        assert "namespace" not in doc["metadata"], f"{doc['kind']}/{doc['metadata']['name']}"


# --- workloads ----------------------------------------------------------------------------


def test_selectors_match_their_pod_templates(docs: list[Doc]) -> None:
    workloads = of_kind(docs, "Deployment") + of_kind(docs, "StatefulSet")
    assert len(workloads) == len([k for k in ROLE_KINDS.values() if k == "Deployment"]) + 1
    for doc in workloads:
        selector = doc["spec"]["selector"]["matchLabels"]
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), doc["metadata"]["name"]
    # No two workloads select each other's pods (a shared selector would mix them).
    selectors = [frozenset(d["spec"]["selector"]["matchLabels"].items()) for d in workloads]
    assert len(set(selectors)) == len(selectors)


@pytest.mark.parametrize("role", ROLES)
def test_role_workload_runs_its_role_with_the_job(
    docs: list[Doc], role: str, tmp_path: Path
) -> None:
    deployment = role_workload(docs, role)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == role
    (container,) = containers(deployment)
    assert container["image"] == "splitmq"
    assert any(i["name"] == "splitmq" for i in kustomization()["images"])
    args = container["args"]
    assert args[0] == role
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}

    def here(argv: list[str]) -> list[str]:
        """Container paths as this machine has them: the job dir is compose/k8s, any other
        mount an empty directory (the CLI checks that paths exist)."""
        local = {CONFIG_DIR: K8S} | {
            path: tmp_path / name for name, path in mounts.items() if path != CONFIG_DIR
        }
        for path in local.values():
            path.mkdir(exist_ok=True)
        out = []
        for arg in argv:
            for path, there in local.items():
                if arg == path or arg.startswith(path + "/"):
                    arg = str(there) + arg[len(path) :]
            out.append(arg)
        return out

    name, _ = parse_cli(here(args))  # the image's entrypoint is `splitmq`
    assert name == role
    # The job it names is the ConfigMap's file where the ConfigMap is mounted.
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    job_volume = next(n for n, v in volumes.items() if "configMap" in v)
    assert volumes[job_volume]["configMap"]["name"] == "splitmq-job"
    assert mounts[job_volume] == CONFIG_DIR
    config_map = one(docs, "ConfigMap", "splitmq-job")
    assert args[1] == f"{CONFIG_DIR}/{JOB_TOML.name}" and JOB_TOML.name in config_map["data"]
    env = container_env(container, fake_secrets(docs))
    assert env["SPLITMQ_CONFIG"] == args[1]
    for probe in ("startupProbe", "livenessProbe"):
        if probe in container:
            argv = container[probe]["exec"]["command"]
            assert argv[0] == "splitmq"
            check, _ = parse_cli(here(argv[1:]))
            assert check == "check" and argv[-1] == role and argv[2] == args[1]


def test_roles_that_finish_are_jobs_restarted_only_on_failure(docs: list[Doc]) -> None:
    for role, kind in ROLE_KINDS.items():
        workload = role_workload(docs, role)
        restart = workload["spec"]["template"]["spec"].get("restartPolicy", "Always")
        if kind == "Job":
            # compose's `restart: on-failure`: a finished job's pod stays finished.
            assert restart == "OnFailure", role
            assert "selector" not in workload["spec"], "Kubernetes generates a Job's selector"
            assert workload["spec"]["backoffLimit"] >= 1
        else:
            assert restart == "Always", role
    # No other role workloads than these four.
    names = {d["metadata"]["name"] for k in ("Deployment", "Job") for d in of_kind(docs, k)}
    assert names == {f"splitmq-{role}" for role in ROLES}


def test_aggregator_reports_go_to_a_volume(docs: list[Doc]) -> None:
    deployment = role_workload(docs, "aggregator")
    (container,) = containers(deployment)
    report_dir = container["args"][container["args"].index("--report-dir") + 1]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    claim = volumes[mounts[report_dir]]["persistentVolumeClaim"]["claimName"]
    assert one(docs, "PersistentVolumeClaim", claim)
    assert job_toml()["report"]["dir"] == report_dir


def test_roles_share_one_environment_whose_references_resolve(docs: list[Doc]) -> None:
    envs = []
    for role in ROLES:
        (container,) = containers(role_workload(docs, role))
        envs.append(container["env"])
        env = container_env(container, fake_secrets(docs))
        unresolved = {k: v for k, v in env.items() if _REF.search(v)}
        assert not unresolved, f"{role}: $(VAR) before VAR is defined: {unresolved}"
    assert all(env == envs[0] for env in envs)


def test_secrets_read_are_the_operators_and_the_redis_one(docs: list[Doc]) -> None:
    allowed = set(fake_secrets(docs))
    used = set()
    for kind in WORKLOADS:
        for doc in of_kind(docs, kind):
            used |= set(secret_refs(doc))
    for auth in of_kind(docs, "TriggerAuthentication"):
        used |= {(ref["name"], ref["key"]) for ref in auth["spec"]["secretTargetRef"]}
    assert used == allowed


# --- the job's settings -------------------------------------------------------------------


def test_job_config_loads_for_every_role_with_the_cluster_settings(docs: list[Doc]) -> None:
    cluster = rabbitmq_cluster(docs)
    name, replicas = cluster["metadata"]["name"], cluster["spec"]["replicas"]
    nodes = [f"{name}-server-{i}.{name}-nodes" for i in range(replicas)]
    toml = job_toml()
    assert [urlparse(u).hostname for u in toml["broker"]["amqp_urls"]] == nodes
    statefulset = one(docs, "StatefulSet", "splitmq-redis")
    service = statefulset["spec"]["serviceName"]
    sentinels = [
        f"splitmq-redis-{i}.{service}:26379" for i in range(statefulset["spec"]["replicas"])
    ]
    for role in ROLES:
        settings = role_settings(docs, role)
        broker, store = settings.broker, settings.store
        assert broker.kind == "rabbitmq" and store.kind == "redis"
        # The environment's URLs: the same nodes as job.toml, with the Secret's credentials.
        assert [urlparse(u).hostname for u in broker.urls] == nodes
        assert {(urlparse(u).username, urlparse(u).password) for u in broker.urls} == {
            ("default_user_Ab3-x_9", "Pw-4_zZ9qQ")
        }
        assert all(urlparse(u).port == 5672 for u in broker.urls)
        assert broker.quorum and broker.queue_type == "quorum"
        assert list(store.sentinels) == sentinels == list(toml["store"]["sentinels"])
        assert store.master_name == "splitmq"
        assert urlparse(store.redis_url).password == "0123abcd"
        assert settings.job.name == toml["job"]["name"]


def test_redis_statefulset_serves_what_the_roles_are_told(docs: list[Doc]) -> None:
    statefulset = one(docs, "StatefulSet", "splitmq-redis")
    service = one(docs, "Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", "pod DNS names need a headless Service"
    assert service["spec"]["selector"].items() <= (
        statefulset["spec"]["template"]["metadata"]["labels"].items()
    )
    ports = {
        p["name"]: p["containerPort"] for c in containers(statefulset) for p in c.get("ports", [])
    }
    assert ports == {"redis": 6379, "sentinel": 26379}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    scripts = one(docs, "ConfigMap", "splitmq-redis-scripts")["data"]
    master_name = role_settings(docs, "worker").store.master_name
    assert f"sentinel monitor {master_name} " in scripts["sentinel.sh"]
    assert f"get-master-addr-by-name {master_name}" in scripts["primary.sh"]
    # Each pod's own name, as the others reach it, is what it announces.
    svc = service["metadata"]["name"]
    assert f'self="$(hostname).{svc}"' in scripts["redis.sh"]
    assert f"{statefulset['metadata']['name']}-0.{svc}" in scripts["primary.sh"]
    budget = one(docs, "PodDisruptionBudget", statefulset["metadata"]["name"])
    assert budget["spec"]["selector"] == statefulset["spec"]["selector"]


def test_client_replicas_are_the_jobs_client_count(docs: list[Doc]) -> None:
    settings = role_settings(docs, "client")
    spec = role_workload(docs, "client")["spec"]
    assert spec["completions"] == spec["parallelism"] == settings.clients.count
    assert settings.clients.min_to_start <= settings.clients.count


# --- custom resources ---------------------------------------------------------------------


def test_rabbitmq_cluster(docs: list[Doc]) -> None:
    cluster = rabbitmq_cluster(docs)
    assert cluster["apiVersion"] == "rabbitmq.com/v1beta1"
    spec = cluster["spec"]
    assert spec["replicas"] == 3
    assert set(spec) <= {
        "replicas",
        "image",
        "resources",
        "persistence",
        "rabbitmq",
        "affinity",
        "service",
        "tls",
        "override",
        "tolerations",
        "terminationGracePeriodSeconds",
    }
    config = dict(
        line.split(" = ", 1)
        for line in spec["rabbitmq"]["additionalConfig"].splitlines()
        if " = " in line
    )
    settings = role_settings(docs, "worker")
    assert int(config["max_message_size"]) == settings.broker.max_message_bytes
    labels = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert labels[0]["podAffinityTerm"]["labelSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": cluster["metadata"]["name"]
    }


def scaled_object(docs: list[Doc]) -> Doc:
    (obj,) = of_kind(docs, "ScaledObject")
    assert obj["apiVersion"] == "keda.sh/v1alpha1"
    return obj


def test_scaled_object_targets_the_worker_deployment(docs: list[Doc]) -> None:
    target = scaled_object(docs)["spec"]["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target.get("apiVersion", "apps/v1") == "apps/v1"
    worker = one(docs, "Deployment", target["name"])
    assert worker is role_workload(docs, "worker")
    # KEDA owns the count: a `replicas` in the Deployment would reset it on every apply.
    assert "replicas" not in worker["spec"]


def test_scaled_object_bounds_are_one_to_the_shard_count(docs: list[Doc]) -> None:
    spec = scaled_object(docs)["spec"]
    shards = role_settings(docs, "worker").algorithm.shards
    assert spec["minReplicaCount"] == 1
    assert spec["maxReplicaCount"] == shards


def test_scaled_object_trigger_reads_the_shard_queues(docs: list[Doc]) -> None:
    (trigger,) = scaled_object(docs)["spec"]["triggers"]
    assert trigger["type"] == "rabbitmq"
    meta = trigger["metadata"]
    assert meta["mode"] == "QueueLength"
    assert float(meta["value"]) == AutoscalerSection().target_depth_per_worker
    # A regex over several queues is the management API's (http), summed over the shards.
    assert meta["useRegex"] == "true" and meta["protocol"] == "http" and meta["operation"] == "sum"
    assert meta["excludeUnacknowledged"] == "true"
    host = urlparse(meta["host"])
    assert host.password is None, "credentials come from the TriggerAuthentication"
    cluster = rabbitmq_cluster(docs)["metadata"]["name"]
    assert host.hostname == f"{cluster}.{NAMESPACE}.svc" and host.port == 15672
    auth = one(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    params = {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]}
    assert params == {"username", "password"}

    settings = role_settings(docs, "worker")
    job, shards = settings.job.name, settings.algorithm.shards
    pattern = re.compile(meta["queueName"])
    for shard in range(shards):
        assert pattern.fullmatch(shard_queue_name(job, shard)), shard
    for other in (
        control_queue_name(job),
        updates_queue_name(job),
        dead_queue_name(job),
        reply_queue_name(job, "client-1"),
        shard_queue_name(job + "x", 0),
        shard_queue_name("other", 0),
    ):
        assert not pattern.search(other), other


# --- the real renderer --------------------------------------------------------------------


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        message = "kubectl is not installed (it renders compose/k8s with `kubectl kustomize`)"
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(f"{message} (CI=true: a missing tool is a failure, not a skip)")
        pytest.skip(message)
    return path


def test_kustomize_renders_the_base() -> None:
    out = subprocess.run(
        [_kubectl(), "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    rendered = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    sources = source_docs()

    def key(doc: Doc) -> tuple[str, str]:
        return doc["kind"], doc["metadata"]["name"]

    # The generated ConfigMap's name gains a hash of job.toml; every reference follows it.
    (config_map,) = [d for d in rendered if d["metadata"]["name"].startswith("splitmq-job-")]
    hashed = config_map["metadata"]["name"]
    assert config_map["data"] == one(sources, "ConfigMap", "splitmq-job")["data"]
    assert sorted(
        (k, "splitmq-job" if n == hashed else n) for k, n in map(key, rendered)
    ) == sorted(map(key, sources))
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, key(doc)
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "splitmq", key(doc)
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        if doc["kind"] in ("Deployment", "Job"):
            spec = doc["spec"]["template"]["spec"]
            assert {v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v} == {hashed}
            assert spec["containers"][0]["image"] == "splitmq:latest"
            # Selectors as written (immutable once applied): the added label stays out.
            selector = doc["spec"].get("selector", {"matchLabels": {}})  # a Job's: generated
            assert "app.kubernetes.io/part-of" not in selector["matchLabels"]

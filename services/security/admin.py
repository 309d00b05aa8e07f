"""Managing RabbitMQ users: through the management HTTP API, or `rabbitmqctl` on the broker's host.

Both do the same five things (`RabbitAdmin`); what each needs: docs/deployment.md,
"Provisioning client users". Passwords never appear on a command line: `rabbitmqctl` reads them
from standard input.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, astuple, dataclass
from typing import Protocol
from urllib.parse import quote, urlparse

from services.security.identity import amqp_user

MANAGEMENT_PORT = 15672
_TIMEOUT_S = 30.0


class AdminError(RuntimeError):
    """RabbitMQ refused or could not be asked; the message says which tool and why."""


@dataclass(frozen=True)
class TopicPermission:
    """Which routing keys (regular expressions) a user may publish with (`write`) and bind
    with (`read`) on one topic exchange; RabbitMQ checks them on topic exchanges only."""

    exchange: str
    write: str
    read: str


@dataclass(frozen=True)
class Permissions:
    """configure / write / read regular expressions of one user in one vhost, and its topic
    permissions (an exchange without one is not restricted by key)."""

    configure: str
    write: str
    read: str
    topics: tuple[TopicPermission, ...] = ()


class RabbitAdmin(Protocol):
    name: str

    def users(self) -> frozenset[str]:
        """The names of every user the broker has."""

    def put_user(self, user: str, password: str) -> None:
        """Create `user`, or set its password if it exists (no tags: not an administrator)."""

    def set_permissions(self, vhost: str, user: str, permissions: Permissions) -> None:
        """Set `user`'s permissions in `vhost`, and its topic permissions on each exchange
        `permissions.topics` names."""

    def delete_user(self, user: str) -> None:
        """Delete `user` (its connections are closed); a missing user is not an error."""

    def queues(self, vhost: str) -> frozenset[str]:
        """The names of every queue in `vhost`: a secured client's queue names hold a part
        derived from its password (`hidden.py`), so revoking finds them by their prefix."""


Runner = Callable[[Sequence[str], str], subprocess.CompletedProcess[str]]


def _run(argv: Sequence[str], stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), input=stdin, capture_output=True, text=True, timeout=120, check=False
    )


class RabbitmqctlAdmin:
    """`rabbitmqctl` against the local node."""

    name = "rabbitmqctl"

    def __init__(self, *, run: Runner = _run) -> None:
        self._run = run

    @staticmethod
    def available() -> bool:
        return shutil.which("rabbitmqctl") is not None

    def users(self) -> frozenset[str]:
        done = self._run(["rabbitmqctl", "list_users", "--quiet", "--formatter", "json"], "")
        self._check(done, "list the users")
        try:
            rows = json.loads(done.stdout)
            return frozenset(str(row["user"]) for row in rows)
        except (ValueError, TypeError, KeyError) as exc:
            raise AdminError(f"rabbitmqctl list_users: unexpected output ({exc})") from None

    def put_user(self, user: str, password: str) -> None:
        done = self._run(["rabbitmqctl", "add_user", user], password)
        # "user_already_exists" (older releases) or 'User "x" already exists' (3.10)
        said = (done.stdout + done.stderr).replace("_", " ")
        if done.returncode != 0 and "already exists" in said:
            done = self._run(["rabbitmqctl", "change_password", user], password)
        self._check(done, f"create user {user!r}")

    def set_permissions(self, vhost: str, user: str, permissions: Permissions) -> None:
        p = permissions
        argv = [
            "rabbitmqctl",
            "set_permissions",
            "--vhost",
            vhost,
            user,
            p.configure,
            p.write,
            p.read,
        ]
        self._check(self._run(argv, ""), f"set the permissions of {user!r}")
        for topic in p.topics:
            argv = ["rabbitmqctl", "set_topic_permissions", "--vhost", vhost, user, *astuple(topic)]
            self._check(self._run(argv, ""), f"set the topic permissions of {user!r}")

    def delete_user(self, user: str) -> None:
        done = self._run(["rabbitmqctl", "delete_user", user], "")
        if done.returncode != 0 and "no_such_user" in done.stdout + done.stderr:
            return
        self._check(done, f"delete user {user!r}")

    def queues(self, vhost: str) -> frozenset[str]:
        argv = ["rabbitmqctl", "list_queues", "--vhost", vhost, "--quiet", "--formatter", "json"]
        done = self._run([*argv, "name"], "")
        self._check(done, f"list the queues of vhost {vhost!r}")
        try:
            return frozenset(str(row["name"]) for row in json.loads(done.stdout))
        except (ValueError, TypeError, KeyError) as exc:
            raise AdminError(f"rabbitmqctl list_queues: unexpected output ({exc})") from None

    @staticmethod
    def _check(done: subprocess.CompletedProcess[str], what: str) -> None:
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()
            raise AdminError(f"rabbitmqctl could not {what}: {' / '.join(detail[-3:])}")


Opener = Callable[[urllib.request.Request, float], bytes]


def _open(request: urllib.request.Request, timeout: float) -> bytes:
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body: bytes = response.read()
        return body


class ManagementAdmin:
    """The management plugin's HTTP API at `base_url` (e.g. ``http://host:15672``)."""

    name = "management API"

    def __init__(self, base_url: str, user: str, password: str, *, opener: Opener = _open) -> None:
        scheme = urlparse(base_url).scheme
        if scheme not in ("http", "https"):
            raise ValueError(f"management URL must be http:// or https://, got {base_url!r}")
        self._base = base_url.rstrip("/")
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        self._auth = f"Basic {token}"
        self._open = opener

    def available(self) -> bool:
        """Whether the API answers these credentials (GET /api/whoami)."""
        try:
            self._call("GET", "/api/whoami")
        except AdminError:
            return False
        return True

    def users(self) -> frozenset[str]:
        body = self._call("GET", "/api/users")
        try:
            return frozenset(str(row["name"]) for row in json.loads(body))
        except (ValueError, TypeError, KeyError) as exc:
            raise AdminError(f"GET /api/users: unexpected answer ({exc})") from None

    def put_user(self, user: str, password: str) -> None:
        body = {"password": password, "tags": ""}
        self._call("PUT", f"/api/users/{quote(user, safe='')}", body)

    def set_permissions(self, vhost: str, user: str, permissions: Permissions) -> None:
        where = f"{quote(vhost, safe='')}/{quote(user, safe='')}"
        p = permissions
        body = {"configure": p.configure, "write": p.write, "read": p.read}
        self._call("PUT", f"/api/permissions/{where}", body)
        for topic in p.topics:
            self._call("PUT", f"/api/topic-permissions/{where}", asdict(topic))

    def delete_user(self, user: str) -> None:
        try:
            self._call("DELETE", f"/api/users/{quote(user, safe='')}")
        except AdminError as exc:
            if "HTTP 404" not in str(exc):
                raise

    def queues(self, vhost: str) -> frozenset[str]:
        path = f"/api/queues/{quote(vhost, safe='')}?columns=name"
        body = self._call("GET", path)
        try:
            return frozenset(str(row["name"]) for row in json.loads(body))
        except (ValueError, TypeError, KeyError) as exc:
            raise AdminError(f"GET {path}: unexpected answer ({exc})") from None

    def _call(self, method: str, path: str, body: object = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self._base + path, data=data, method=method)
        request.add_header("Authorization", self._auth)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            return self._open(request, _TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            raise AdminError(f"{method} {path}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise AdminError(f"{method} {path}: {exc}") from None


def pick_admin(kind: str, amqp_url: str, management_url: str | None = None) -> RabbitAdmin:
    """The admin tool asked for: "http", "rabbitmqctl", or "auto" (the API if it answers the
    services' credentials, else rabbitmqctl if installed here). The API defaults to the
    broker's host, over https when AMQP is amqps."""
    parsed = urlparse(amqp_url)
    scheme = "https" if parsed.scheme == "amqps" else "http"
    url = management_url or f"{scheme}://{parsed.hostname or '127.0.0.1'}:{MANAGEMENT_PORT}"
    http = ManagementAdmin(url, amqp_user(amqp_url), parsed.password or "guest")
    if kind == "http":
        return http
    if kind == "rabbitmqctl" or (kind == "auto" and not http.available()):
        if not RabbitmqctlAdmin.available():
            raise AdminError(
                f"no way to manage RabbitMQ users: the management API does not answer at {url} "
                "and rabbitmqctl is not installed here (run this on the broker's host, or enable "
                "rabbitmq_management)"
            )
        return RabbitmqctlAdmin()
    return http

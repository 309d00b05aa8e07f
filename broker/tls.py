"""Client-side TLS for the AMQP and Redis connections (amqps://, rediss://; docs/deployment.md,
"TLS"): `client_context` builds the `ssl.SSLContext` pika wants, `redis_ssl_kwargs` redis-py's
keyword arguments.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from urllib.parse import urlparse

from broker.errors import ConnectionSettingsError


@dataclass(frozen=True)
class TLSOptions:
    ca_file: str | None = None  # None: the system's trusted CAs
    cert_file: str | None = None  # a client certificate (mutual TLS), PEM
    key_file: str | None = None  # its private key (None: in cert_file)
    verify_hostname: bool = True

    def __post_init__(self) -> None:
        if self.key_file and not self.cert_file:
            raise ValueError("TLS key_file given without cert_file")


def wants_tls(url: str, scheme: str, server: str, setting: str, tls: TLSOptions | None) -> bool:
    """Whether `url` is `<scheme>s://` rather than `<scheme>://`; any other scheme, or `tls`
    options with a plain URL, is a `ConnectionSettingsError` naming `server` and `setting`."""
    found = urlparse(url).scheme
    if found not in (scheme, scheme + "s"):
        got = f"{found}://" if found else "no scheme"
        raise ConnectionSettingsError(
            f"the {server} URL must start with {scheme}:// or {scheme}s://, got {got} ({setting})"
        )
    if found == scheme and tls is not None:
        raise ConnectionSettingsError(
            f"TLS options are set but the {server} URL is {scheme}://: use {scheme}s://"
        )
    return found != scheme


def client_context(options: TLSOptions) -> ssl.SSLContext:
    """A context that verifies the server (and presents a client certificate if given)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=options.ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if options.cert_file:
        context.load_cert_chain(options.cert_file, options.key_file)
    # check_hostname first: verify_mode cannot drop below CERT_REQUIRED while it is on.
    context.check_hostname = options.verify_hostname
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def redis_ssl_kwargs(options: TLSOptions) -> dict[str, object]:
    """redis-py's `ssl_*` connection arguments for a rediss:// URL."""
    kwargs: dict[str, object] = {
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": options.verify_hostname,
        "ssl_min_version": ssl.TLSVersion.TLSv1_2,
    }
    if options.ca_file:
        kwargs["ssl_ca_certs"] = options.ca_file
    if options.cert_file:
        kwargs["ssl_certfile"] = options.cert_file
        kwargs["ssl_keyfile"] = options.key_file
    return kwargs

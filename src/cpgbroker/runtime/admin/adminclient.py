"""The client side of a member's admin endpoint (runtime/admin/endpoint.py), for the CLI and the dev
tools: where the endpoint is, the secret that opens it, and one request.

Blocking (urllib): the CLI makes a handful of requests and exits.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import attrs

from cpgbroker.errors import ConfigError
from cpgbroker.runtime.admin import secret as admin_secret
from cpgbroker.runtime.config import settings

DEFAULT_URL = "http://127.0.0.1:15672"


@attrs.frozen
class AdminTarget:
    base: str  # scheme://host:port, no trailing slash
    secret: str = attrs.field(repr=False)
    ssl_context: ssl.SSLContext | None = None


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/status")] if url.endswith("/status") else url


def _listen_url(listen: str, tls: bool) -> str:
    host, port = settings.parse_listen(listen)
    # A wildcard listener is reached through loopback from the member's own machine.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def target(
    *,
    url: str | None = None,
    config_path: str | None = None,
    default_config: str = "",
    secret_file: str | None = None,
    token: str | None = None,
    cacert: str | None = None,
) -> AdminTarget:
    """Resolve, in this order: explicit arguments, the environment
    (``CPGBROKER_ADMIN_TOKEN``, ``CPGBROKER_ADMIN_SECRET_FILE``), the member's configuration
    (``config_path``, else ``default_config`` if it exists), then the defaults."""
    config = None
    path = config_path or (
        default_config if default_config and os.path.exists(default_config) else ""
    )
    if path:
        config = settings.load(path)
    if url is None:
        url = (
            _listen_url(config.admin_listen, config.admin_tls)
            if config is not None and config.admin_listen
            else DEFAULT_URL
        )
    token = token if token is not None else os.environ.get("CPGBROKER_ADMIN_TOKEN", "")
    secret_file = secret_file or os.environ.get("CPGBROKER_ADMIN_SECRET_FILE", "")
    if token:
        secret = token
    elif secret_file:
        secret = admin_secret.read_secret(Path(secret_file))
    elif config is not None and config.admin_token:
        secret = config.admin_token
    else:
        configured = config.admin_secret_file if config is not None else ""
        secret = admin_secret.read_secret(admin_secret.secret_path(configured))
    context = None
    base = base_url(url)
    if base.startswith("https:"):
        tls = getattr(config, "tls", None) if config is not None else None
        cafile = cacert or (getattr(tls, "cacertfile", "") or None)
        context = ssl.create_default_context(cafile=cafile)
    return AdminTarget(base, secret, context)


def request(
    t: AdminTarget,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    timeout: float = 15.0,
) -> tuple[int, dict[str, Any]]:
    """One request; (HTTP status, JSON answer). Network errors raise OSError (URLError)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {t.secret}"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(t.base + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=t.ssl_context) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            answer = json.loads(e.read() or b"{}")
        except ValueError:
            answer = {"error": str(e.reason)}
        return int(e.code), answer if isinstance(answer, dict) else {"error": str(answer)}


__all__ = ["AdminTarget", "ConfigError", "base_url", "request", "target"]

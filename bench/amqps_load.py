"""The shared load generator (``../shared/bench/amqp_load.py``) over amqps:// URLs.

The shared tool speaks plain AMQP only and is not ours to change, so this wrapper loads it
as a module and teaches it TLS before its ``main`` runs: ``amqps://`` URLs parse (port 5671
by default), and the raw client's ``loop.create_connection`` to such an endpoint gets an
``ssl.SSLContext`` that trusts ``--cafile``. Its workers are forked from this process, so
they inherit both patches. Everything else (options, JSON report) is the shared tool's.

    python bench/amqps_load.py --cafile ca.pem --url amqps://guest:guest@127.0.0.1:5671/ ...
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.base_events
import importlib.util
import ssl
import sys
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

SHARED = Path(__file__).resolve().parents[2] / "shared"


def load_tool(shared: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("amqp_load", shared / "bench" / "amqp_load.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["amqp_load"] = mod
    spec.loader.exec_module(mod)
    return mod


def teach_tls(mod: ModuleType, ctx: ssl.SSLContext) -> None:
    endpoints: set[tuple[str, int]] = set()
    plain_parse = mod.parse_url

    def parse_url(url: str) -> dict[str, Any]:
        u = urlparse(url)
        if u.scheme != "amqps":
            return dict(plain_parse(url))
        p = dict(plain_parse("amqp" + url[len("amqps") :]))
        p["port"] = u.port or 5671
        endpoints.add((p["host"], p["port"]))
        return p

    plain_connect = asyncio.base_events.BaseEventLoop.create_connection

    async def create_connection(  # type: ignore[no-untyped-def]
        self, factory, host=None, port=None, **kw
    ):
        if (host, port) in endpoints and kw.get("ssl") is None:
            kw["ssl"] = ctx
            kw.setdefault("server_hostname", host)
        return await plain_connect(self, factory, host, port, **kw)

    mod.parse_url = parse_url
    asyncio.base_events.BaseEventLoop.create_connection = create_connection  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--cafile", required=True, help="PEM: the CAs that sign the broker's cert")
    ap.add_argument("--shared", type=Path, default=SHARED)
    ours, rest = ap.parse_known_args(argv)
    mod = load_tool(ours.shared)
    teach_tls(mod, ssl.create_default_context(cafile=ours.cafile))
    return int(mod.main(rest))


if __name__ == "__main__":
    sys.exit(main())

"""The ``cpgbroker`` command line: ``start``, ``status``, ``devcluster`` ..."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "devcluster":
        from cpgbroker import devcluster

        return devcluster.main(args[1:])
    if args and args[0] == "audit":
        # Its own parser; pyspark is imported only when an audit runs (the audit extra).
        from cpgbroker.audit.cli import main as audit_main

        return audit_main(args[1:])
    parser = argparse.ArgumentParser(prog="cpgbroker")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="run a broker (standalone, or a cluster member)")
    start.add_argument("--config", help="TOML configuration file")
    start.add_argument("--listen", help="HOST:PORT to serve AMQP on (overrides the config)")
    sub.add_parser("devcluster", help="local corosync cluster in network namespaces")
    sub.add_parser("audit", help="audit a cluster run's logs and client histories (PySpark)")
    status = sub.add_parser("status", help="show a running broker's status")
    status.add_argument(
        "--url",
        default="http://127.0.0.1:15672/status",
        help="its status endpoint ([server] admin)",
    )
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    ns = parser.parse_args(args)
    if ns.command == "start":
        from cpgbroker.runtime import server

        return server.main(config_path=ns.config, listen=ns.listen)
    if ns.command == "status":
        return _status(ns.url, ns.json)
    parser.error(f"unknown command {ns.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())


def _status(url: str, as_json: bool) -> int:
    import json
    import urllib.error
    import urllib.request

    if not url.rstrip("/").endswith("/status"):
        url = url.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            data = json.loads(resp.read())
    except (urllib.error.URLError, OSError) as e:
        print(f"cpgbroker: cannot reach {url}: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"state: {data.get('state')}  event_seq: {data.get('event_seq')}")
    q = data.get("quorum")
    if q:
        votes = f"votes {q.get('votes', '?')}/{q.get('expected_votes', '?')}"
        print(
            f"quorum: {'quorate' if q.get('quorate') else 'NOT QUORATE'}  {votes}"
            f"  (needs {q.get('quorum', '?')})"
        )
    if data.get("last_suspension"):
        print(f"last suspension: {data['last_suspension']}")
    if data.get("member") is not None:
        print(
            f"member: {data['member']}  url: {data.get('url')}  clock: {data.get('clock_master')}"
        )
        for m in data.get("members", []):
            print(f"  member {m['member']}  {m['status']:8}  {m['url']}")
        cp = data.get("checkpoint")
        if cp:
            agreed = "agreed" if cp["agreed"] else "DIVERGED"
            print(f"checkpoint: seq {cp['seq']} {agreed} digest {cp['digest'][:16]}")
    conns = data.get("connections", {})
    print(f"connections: {conns.get('local', 0)} local, {conns.get('shadow', 0)} shadow")
    for name, q in sorted(data.get("queues", {}).items()):
        counts = f"{q['ready']} ready, {q['unacked']} unacked, {q['consumers']} consumers"
        print(f"  queue {name}: {counts}")
    return 0

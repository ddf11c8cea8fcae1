"""The ``cpgbroker`` command line: ``start``, ``status``, ``devcluster`` ..."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "devcluster":
        from cpgbroker.dev import cli as devcluster_cli

        return devcluster_cli.main(args[1:])
    if args and args[0] == "audit":
        # Its own parser; pyspark is imported only when an audit runs (the audit extra).
        from cpgbroker.audit.cli import main as audit_main

        return audit_main(args[1:])
    parser = argparse.ArgumentParser(prog="cpgbroker")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="run a broker (standalone, or a cluster member)")
    start.add_argument("--config", help="TOML configuration file")
    start.add_argument("--listen", help="HOST:PORT to serve AMQP on (overrides the config)")
    start.add_argument(
        "--force-boot",
        action="store_true",
        help="cluster member with a store: serve from this member's store without waiting for "
        "the other members after a whole-cluster stop (their stores are then replaced, even if "
        "newer); see docs/operations.md",
    )
    sub.add_parser("devcluster", help="local corosync cluster in network namespaces")
    sub.add_parser(
        "hash-password",
        help="read a password on stdin (or prompt for it) and print its password_hash for "
        "[[users]] (RabbitMQ's salted SHA-256 format)",
    )
    sub.add_parser("audit", help="audit a cluster run's logs and client histories (PySpark)")
    status = sub.add_parser("status", help="show a running broker's status")
    status.add_argument(
        "--url",
        default="http://127.0.0.1:15672/status",
        help="its status endpoint ([server] admin)",
    )
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    admin_url = argparse.ArgumentParser(add_help=False)
    admin_url.add_argument(
        "--url",
        default="http://127.0.0.1:15672",
        help="the status endpoint ([server] admin) of any serving member",
    )
    admin_url.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the member(s) to stop"
    )
    admin_url.add_argument(
        "--token",
        default=None,
        help="[server] admin_token of the member (default: $CPGBROKER_ADMIN_TOKEN)",
    )
    cluster = sub.add_parser("cluster", help="act on the whole cluster")
    cluster_sub = cluster.add_subparsers(dest="action", required=True)
    cluster_sub.add_parser(
        "stop",
        parents=[admin_url],
        help="stop every member cleanly at the same point of the event order",
    )
    member = sub.add_parser("member", help="act on one member")
    member_sub = member.add_subparsers(dest="action", required=True)
    member_stop = member_sub.add_parser(
        "stop", parents=[admin_url], help="stop one member (the others serve on)"
    )
    member_stop.add_argument("id", type=int, help="member id (see cpgbroker status)")
    ns = parser.parse_args(args)
    if ns.command == "start":
        from cpgbroker.runtime import main as runtime_main

        return runtime_main.main(config_path=ns.config, listen=ns.listen, force_boot=ns.force_boot)
    if ns.command == "hash-password":
        return _hash_password()
    if ns.command == "status":
        return _status(ns.url, ns.json)
    if ns.command in ("cluster", "member"):
        import os

        token = ns.token if ns.token is not None else os.environ.get("CPGBROKER_ADMIN_TOKEN", "")
        return _stop(ns.url, getattr(ns, "id", 0), ns.timeout, token)
    parser.error(f"unknown command {ns.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())


def _admin_base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/status")] if url.endswith("/status") else url


def _stop(url: str, member: int, timeout: float, token: str = "") -> int:
    """POST /stop to one member; it multicasts the request and answers where in the event
    order it took effect. For a cluster stop, then wait until that member has stopped."""
    import json
    import time
    import urllib.error
    import urllib.request

    base = _admin_base(url)
    body = json.dumps({"member": member} if member else {}).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(base + "/stop", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            why = json.loads(e.read()).get("error", e.reason)
        except ValueError:
            why = e.reason
        print(f"cpgbroker: {base} refused: {why}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"cpgbroker: cannot reach {base}: {e}", file=sys.stderr)
        return 1
    what = "the cluster" if not member else f"member {member}"
    print(f"stopping {what} at event {answer.get('at_seq')}")
    if member:
        return 0
    # Every member stops at that event; this one's endpoint goes away once it has exited.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/status", timeout=2):
                pass
        except (urllib.error.URLError, OSError):
            print("stopped")
            return 0
        time.sleep(0.2)
    print(f"cpgbroker: {base} still answers after {timeout:.0f} s", file=sys.stderr)
    return 1


def _hash_password() -> int:
    import getpass
    import os

    from cpgbroker.model import auth

    if sys.stdin.isatty():
        password = getpass.getpass("password: ")
    else:
        password = sys.stdin.readline().rstrip("\n")
    if not password:
        print("cpgbroker: empty password", file=sys.stderr)
        return 2
    print(auth.hash_password(password, os.urandom(auth.SALT_BYTES)))
    return 0


def _status(url: str, as_json: bool) -> int:
    import json
    import urllib.error
    import urllib.request

    url = _admin_base(url) + "/status"
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
        _print_error_checks(data.get("error_checks") or {})
        if data.get("stopping"):
            st = data["stopping"]
            print(f"stopping: {st['scope']} stop at event {st['seq']}")
    _print_store(data.get("store"))
    if data.get("publishers_blocked"):
        alarms = data.get("disk_alarms") or []
        why = f"disk alarm of member(s) {alarms}" if alarms else "memory mark"
        print(f"PUBLISHERS BLOCKED: {why}")
    conns = data.get("connections", {})
    print(f"connections: {conns.get('local', 0)} local, {conns.get('shadow', 0)} shadow")
    for name, q in sorted(data.get("queues", {}).items()):
        counts = f"{q['ready']} ready, {q['unacked']} unacked, {q['consumers']} consumers"
        print(f"  queue {name}: {counts}")
    return 0


def _print_store(st: dict[str, object] | None) -> None:
    if not st:
        return
    rec = st.get("recovery")
    assert rec is None or isinstance(rec, dict)
    if rec and rec.get("phase") in ("loading-snapshot", "replaying"):
        left = rec.get("seconds_left")
        print(
            f"store: RECOVERING ({rec['phase']}) {rec['records_replayed']} records, "
            f"{int(rec['bytes_replayed']) / 2**20:.1f} of {int(rec['journal_bytes']) / 2**20:.1f} "
            f"MiB replayed{'' if left is None else f', about {left} s left'}"
        )
        return
    failed = f"  FAILED: {st['failed']}" if st.get("failed") else ""
    print(
        f"store: {st.get('dir')}  fsync {st.get('fsync')}  epoch {st.get('epoch')}  "
        f"durable event {st.get('durable_seq')}  journal "
        f"{int(str(st.get('journal_bytes') or 0)) / 2**20:.1f} MiB  "
        f"snapshots {st.get('snapshots')}{failed}"
    )


def _print_error_checks(ec: dict[str, object]) -> None:
    held = ec.get("held_at")
    if held is not None:
        print(f"error-check: HELD at event {held}, waiting for the round's decision")
    pending = ec.get("pending") or {}
    assert isinstance(pending, dict)
    for seq, p in pending.items():
        print(f"error-check round at event {seq}: waiting for {p['waiting_for']}")
    decided = ec.get("decided") or []
    assert isinstance(decided, list)
    for r in decided[-5:]:
        leaving = ", ".join(str(m) for m in r["leaving"]) or "nobody"
        print(f"error-check round at event {r['seq']}: {r['decision']!r} won; leaving: {leaving}")
        for m, o in r["outcomes"].items():
            print(f"    member {m}: {o}")

"""The ``cpgbroker`` command line: ``start``, ``status``, ``devcluster`` ..."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cpgbroker.runtime.admin.adminclient import AdminTarget


# Where a deployment keeps the member's configuration (``cluster init``, the systemd unit).
DEFAULT_CONFIG = "/etc/cpgbroker/cpgbroker.toml"


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            # Inside the try: the flush at exit would fail outside it, with a traceback.
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`cpgbroker status | head -1`): nothing more to say. The rest
        # of the output goes to devnull, so the interpreter's own flush at exit cannot fail.
        # Exit 128 + SIGPIPE (141), the status a shell shows for git and coreutils, which die
        # of SIGPIPE there: `set -o pipefail` scripts see what they see for any other tool.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "devcluster":
        from cpgbroker.dev import cli as devcluster_cli

        return devcluster_cli.main(args[1:])
    if args and args[0] == "audit":
        # Its own parser; pyspark is imported only when an audit runs (the audit extra).
        from cpgbroker.audit.cli import main as audit_main

        return audit_main(args[1:])
    parser = argparse.ArgumentParser(prog="cpgbroker")
    parser.add_argument(
        "--version",
        action="version",
        version=_version_text(),
        help="print the release and the model versions it applies",
    )
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
    # How the CLI reaches a member's admin endpoint and proves it may (the admin secret).
    admin_url = argparse.ArgumentParser(add_help=False)
    admin_url.add_argument(
        "--url",
        default=None,
        help="the admin endpoint ([server] admin) of a member (default: the one in --config, "
        "else http://127.0.0.1:15672)",
    )
    admin_url.add_argument(
        "--config",
        default=None,
        help="the member's cpgbroker.toml: its admin address and secret file (default: "
        f"{DEFAULT_CONFIG} if it exists)",
    )
    admin_url.add_argument(
        "--secret-file",
        default=None,
        help="the member's admin secret file (default: the config's admin_secret_file, else "
        "~/.cpgbroker/admin.secret); $CPGBROKER_ADMIN_SECRET_FILE also works",
    )
    admin_url.add_argument(
        "--token",
        default=None,
        help="the member's [server] admin_token, if it has one (default: $CPGBROKER_ADMIN_TOKEN)",
    )
    admin_url.add_argument(
        "--cacert",
        default=None,
        help="CA certificate to verify an https admin endpoint with (default: the config's "
        "[tls] cacertfile)",
    )
    status = sub.add_parser("status", parents=[admin_url], help="show a running broker's status")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    stop_opts = argparse.ArgumentParser(add_help=False)
    stop_opts.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the member(s) to stop"
    )
    cluster = sub.add_parser("cluster", help="act on the whole cluster")
    cluster_sub = cluster.add_subparsers(dest="action", required=True)
    init = cluster_sub.add_parser(
        "init",
        help="write a production deployment's files: corosync.conf (encrypted), authkey, and "
        "each node's cpgbroker.toml (docs/operations.md, 'Deploying three machines')",
    )
    init.add_argument(
        "--node",
        action="append",
        required=True,
        metavar="NAME=ADDRESS",
        help="a node: its name and the address corosync and clients use (repeat per node)",
    )
    init.add_argument("--out", required=True, help="directory to write into (must not hold them)")
    init.add_argument(
        "--name",
        default="cpgbroker",
        help="the cluster's name: corosync's cluster_name and [cluster] name (what clients, "
        "the management API and /metrics see)",
    )
    init.add_argument("--group", default="cpgbroker", help="CPG group of the members")
    init.add_argument("--user", default="admin", help="the AMQP user to create")
    init.add_argument("--amqp-port", type=int, default=5672)
    init.add_argument("--admin-port", type=int, default=15672)
    init.add_argument("--token-ms", type=int, default=3000, help="corosync token timeout")
    init.add_argument(
        "--update-port",
        type=int,
        default=25672,
        help="port where a member receives the state when it joins (open it between members)",
    )
    init.add_argument(
        "--tls",
        action="store_true",
        help="clients use amqps: a certificate per member (signed by a private CA made here, "
        "or by --ca-cert/--ca-key), amqps URLs for failover, the admin endpoint over https",
    )
    init.add_argument("--amqps-port", type=int, default=5671)
    init.add_argument("--ca-cert", default=None, help="with --tls: your CA's certificate (PEM)")
    init.add_argument(
        "--ca-key", default=None, help="with --tls: your CA's private key (PEM, unencrypted)"
    )
    init.add_argument(
        "--service-user",
        default="cpgbroker",
        help="the user the broker runs as (the systemd unit's): corosync grants it IPC",
    )
    init.add_argument(
        "--prefix",
        default="",
        help="prepend this to every path written into the files (a test deploying 'machines' "
        "as directories of one host)",
    )
    init.add_argument(
        "--seed-file",
        default=None,
        help="derive the authkey and password from this file's bytes instead of random ones, "
        "so that machines provisioned separately from one seed write identical shared files",
    )
    certs = cluster_sub.add_parser(
        "certs",
        help="new member certificates from the cluster's CA, for a rolling change of "
        "certificates (docs/operations.md, 'amqps')",
    )
    certs.add_argument("--node", action="append", required=True, metavar="NAME=ADDRESS")
    certs.add_argument("--out", required=True, help="directory to write into (must not hold them)")
    certs.add_argument("--ca-cert", required=True, help="the CA's certificate (PEM)")
    certs.add_argument("--ca-key", required=True, help="the CA's private key (PEM, unencrypted)")
    certs.add_argument(
        "--seed-file", default=None, help="as for init: the members keep the keys it derives"
    )
    cluster_sub.add_parser(
        "stop",
        parents=[admin_url, stop_opts],
        help="stop every member cleanly at the same point of the event order",
    )
    finish = cluster_sub.add_parser(
        "upgrade-finish",
        parents=[admin_url],
        help="move the whole cluster to the newest model version every member applies, at one "
        "event (after every member runs the new release; no rollback to the old release after)",
    )
    finish.add_argument(
        "--model-version",
        type=int,
        default=None,
        help="the model version to move to (default: the newest this member applies)",
    )
    member = sub.add_parser("member", help="act on one member")
    member_sub = member.add_subparsers(dest="action", required=True)
    member_stop = member_sub.add_parser(
        "stop", parents=[admin_url, stop_opts], help="stop one member (the others serve on)"
    )
    member_stop.add_argument("id", type=int, help="member id (see cpgbroker status)")
    ctl = sub.add_parser(
        "ctl",
        parents=[admin_url],
        help="rabbitmqctl's everyday commands (add_user, set_permissions, set_policy, "
        "list_queues, ...) against a member: 'cpgbroker ctl help' lists them",
    )
    ctl.add_argument("ctl_args", nargs=argparse.REMAINDER, help="a rabbitmqctl command")
    if args and args[0] == "ctl":
        # The admin endpoint's options are ours, anywhere on the line; the rest, in order, are
        # the rabbitmqctl command's (its -p, -q ... may come before the command's name).
        mine, rest = _admin_options(args[1:])
        ns = parser.parse_args(["ctl", *mine])
        ns.ctl_args = rest
    else:
        ns = parser.parse_args(args)
    if ns.command == "start":
        from cpgbroker.runtime.process import main as runtime_main

        return runtime_main.main(config_path=ns.config, listen=ns.listen, force_boot=ns.force_boot)
    if ns.command == "hash-password":
        return _hash_password()
    if ns.command == "cluster" and ns.action == "init":
        return _cluster_init(ns)
    if ns.command == "cluster" and ns.action == "certs":
        return _cluster_certs(ns)
    if ns.command == "ctl" and (not ns.ctl_args or ns.ctl_args[0] in ("help", "-h", "--help")):
        from cpgbroker.runtime.admin import ctl as ctl_commands

        ctl_commands.parser().print_help()
        return 0
    if ns.command in ("status", "cluster", "member", "ctl"):
        from cpgbroker.errors import ConfigError

        try:
            target = _admin_target(ns)
        except ConfigError as e:
            print(f"cpgbroker: {e}", file=sys.stderr)
            return 1
        if ns.command == "status":
            return _status(target, ns.json)
        if ns.command == "ctl":
            from cpgbroker.runtime.admin import ctl as ctl_commands

            return ctl_commands.run(target, ns.ctl_args)
        if ns.command == "cluster" and ns.action == "upgrade-finish":
            return _upgrade_finish(target, ns.model_version)
        return _stop(target, getattr(ns, "id", 0), ns.timeout)
    parser.error(f"unknown command {ns.command}")
    return 2


def _admin_options(args: list[str]) -> tuple[list[str], list[str]]:
    """Split ``cpgbroker ctl`` arguments into the admin endpoint's options and the rest."""
    ours = ("--url", "--config", "--secret-file", "--token", "--cacert")
    mine: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        name = a.split("=", 1)[0]
        if name in ours:
            mine.append(a)
            if "=" not in a and i + 1 < len(args):
                mine.append(args[i + 1])
                i += 1
        else:
            rest.append(a)
        i += 1
    return mine, rest


def _admin_target(ns: argparse.Namespace) -> AdminTarget:
    from cpgbroker.runtime.admin import adminclient

    return adminclient.target(
        url=ns.url,
        config_path=ns.config,
        default_config=DEFAULT_CONFIG,
        secret_file=ns.secret_file,
        token=ns.token,
        cacert=ns.cacert,
    )


def _seed(path: str | None) -> bytes | None:
    """``--seed-file``'s bytes (None without one): the key material of `cluster init` and
    `cluster certs` derives from them, so too few would make guessable keys."""
    from pathlib import Path

    from cpgbroker.errors import ConfigError

    if not path:
        return None
    seed = Path(path).read_bytes()
    if len(seed) < 32:
        raise ConfigError(f"--seed-file {path} holds fewer than 32 bytes")
    return seed


def _cluster_init(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from cpgbroker.deploy import init
    from cpgbroker.errors import ConfigError

    try:
        seed = _seed(ns.seed_file)
        opts = init.InitOptions(
            nodes=tuple(init.parse_node(n) for n in ns.node),
            cluster_name=ns.name,
            group=ns.group,
            prefix=ns.prefix,
            amqp_port=ns.amqp_port,
            admin_port=ns.admin_port,
            user=ns.user,
            token_ms=ns.token_ms,
            seed=seed,
            service_user=ns.service_user,
            update_port=ns.update_port,
            tls=ns.tls,
            amqps_port=ns.amqps_port,
            ca_cert=Path(ns.ca_cert).read_bytes() if ns.ca_cert else None,
            ca_key=Path(ns.ca_key).read_bytes() if ns.ca_key else None,
        )
        result = init.write(opts, Path(ns.out))
    except (ConfigError, OSError) as e:
        print(f"cpgbroker: {e}", file=sys.stderr)
        return 1
    for path in result.files:
        print(f"wrote {path}")
    print(f"AMQP user {ns.user!r}: its password is in {result.password_file}")
    out = Path(ns.out)
    if out / "ca.pem" in result.files:
        print(f"amqps: clients verify the members with {out / 'ca.pem'}")
    if out / "ca.key" in result.files:
        print(f"the private CA's key is {out / 'ca.key'}: keep it off the machines")
    return 0


def _cluster_certs(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from cpgbroker.deploy import init
    from cpgbroker.errors import ConfigError

    try:
        seed = _seed(ns.seed_file)
        opts = init.InitOptions(
            nodes=tuple(init.parse_node(n) for n in ns.node),
            seed=seed,
            tls=True,
            ca_cert=Path(ns.ca_cert).read_bytes(),
            ca_key=Path(ns.ca_key).read_bytes(),
        )
        files = init.write_certs(opts, Path(ns.out))
    except (ConfigError, OSError) as e:
        print(f"cpgbroker: {e}", file=sys.stderr)
        return 1
    for path in files:
        print(f"wrote {path}")
    return 0


def _refused(base: str, http: int, answer: dict[str, object]) -> int:
    print(f"cpgbroker: {base} refused ({http}): {answer.get('error', '')}", file=sys.stderr)
    return 1


def _stop(target: AdminTarget, member: int, timeout: float) -> int:
    """POST /stop to one member; it multicasts the request and answers where in the event
    order it took effect. For a cluster stop, then wait until that member has stopped."""
    import time

    from cpgbroker.runtime.admin.adminclient import request

    base = target.base
    try:
        http, answer = request(target, "POST", "/stop", {"member": member} if member else {})
    except OSError as e:
        print(f"cpgbroker: cannot reach {base}: {e}", file=sys.stderr)
        return 1
    if http >= 300:
        return _refused(base, http, answer)
    what = "the cluster" if not member else f"member {member}"
    print(f"stopping {what} at event {answer.get('at_seq')}")
    if member:
        return 0
    # Every member stops at that event; this one's endpoint goes away once it has exited.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            request(target, "GET", "/status", timeout=2)
        except OSError:
            print("stopped")
            return 0
        time.sleep(0.2)
    print(f"cpgbroker: {base} still answers after {timeout:.0f} s", file=sys.stderr)
    return 1


def _version_text() -> str:
    from cpgbroker import __version__
    from cpgbroker.model import NEWEST, OLDEST

    return f"cpgbroker {__version__} (model versions {OLDEST} to {NEWEST})"


def _upgrade_finish(target: AdminTarget, version: int | None) -> int:
    """POST /upgrade-finish: the cluster moves up at one event, if every member applies the
    version (the answer says which member does not)."""
    from cpgbroker.runtime.admin.adminclient import request

    try:
        http, answer = request(
            target, "POST", "/upgrade-finish", {} if version is None else {"version": version}
        )
    except OSError as e:
        print(f"cpgbroker: cannot reach {target.base}: {e}", file=sys.stderr)
        return 1
    if http >= 300:
        why = answer.get("reason") or answer.get("error", "")
        print(f"cpgbroker: upgrade-finish refused ({http}): {why}", file=sys.stderr)
        return 1
    was, now = answer.get("was"), answer.get("model_version")
    if was == now:
        print(f"the cluster already runs model version {now}")
    else:
        print(f"the cluster runs model version {now} (was {was})")
    return 0


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


def _status(target: AdminTarget, as_json: bool) -> int:
    import json

    from cpgbroker.runtime.admin.adminclient import request

    try:
        http, data = request(target, "GET", "/status", timeout=5)
    except OSError as e:
        print(f"cpgbroker: cannot reach {target.base}: {e}", file=sys.stderr)
        return 1
    if http >= 300:
        return _refused(target.base, http, data)
    if as_json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"state: {data.get('state')}  event_seq: {data.get('event_seq')}")
    sw = data.get("software") or {}
    lo, hi = (sw.get("model_versions") or ["?", "?"])[:2]
    print(
        f"software: cpgbroker {sw.get('release', '?')} (model versions {lo} to {hi})  "
        f"model version: {data.get('model_version')}"
    )
    up = data.get("upgrade")
    if up and (up.get("pending") or len(up.get("releases") or []) > 1):
        print(
            f"upgrade: members run {', '.join(up.get('releases') or [])}; every member applies "
            f"model version {up.get('newest_all_apply')}"
            + (
                "; 'cpgbroker cluster upgrade-finish' moves the cluster to it"
                if up.get("pending")
                else ""
            )
        )
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
        if data.get("mode") == "hot-standby":
            print(
                f"mode: hot-standby  this member: {data.get('role')}  "
                f"primary: member {data.get('primary')} {data.get('primary_url') or ''}"
            )
        if data.get("replication") == "changes":
            b = data.get("batches") or {}
            print(
                f"replication: changes (replicate {data.get('replicate')})  batches shipped "
                f"{b.get('shipped', 0)}, stable {b.get('stable', 0)}; messages acked before "
                f"their batch left (never shipped): {b.get('elided', 0)}"
            )
        for m in data.get("members", []):
            print(f"  member {m['member']}  {m['status']:8}  {m['url']}  {m.get('software', '')}")
        cp = data.get("checkpoint")
        if cp:
            agreed = "agreed" if cp["agreed"] else "DIVERGED"
            print(f"checkpoint: seq {cp['seq']} {agreed} digest {cp['digest'][:16]}")
        _print_error_checks(data.get("error_checks") or {})
        _print_federation(data.get("federation_links") or [])
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
    if lb := data.get("local"):
        where = ", ".join([*lb["listen"], *(f"amqps {a}" for a in lb.get("listen_tls", []))])
        print(
            f"member-local (not replicated) on {where}: {lb['connections']} connections, "
            f"{lb['queues']} queues, {lb['messages']} messages"
        )
    for name, q in sorted(data.get("queues", {}).items()):
        counts = f"{q['ready']} ready, {q['unacked']} unacked, {q['consumers']} consumers"
        print(f"  queue {name}: {counts}")
    return 0


def _print_federation(links: list[dict[str, object]]) -> None:
    if links:
        print("federation links:")
    for x in links:
        where = f" on member {x['member']}" if "member" in x else ""
        uri = f" via {x['uri']}" if x.get("uri") else ""
        print(f"  {x['vhost']}/{x['exchange']} <- {x['upstream']}: {x['status']}{where}{uri}")
        figures = [
            f"{key.replace('_', ' ')} {x[key]}"
            for key in ("forwarded", "upstream_queue_messages", "dropped_loops", "too_large")
            if key in x
        ]
        if figures:
            print("    " + ", ".join(figures))
        if x.get("error"):
            print(f"    last error: {x['error']}")


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


if __name__ == "__main__":
    sys.exit(main())

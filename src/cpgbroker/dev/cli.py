"""``cpgbroker devcluster ...``: the command line of the dev cluster and its brokers.

Every command but ``up`` and ``down`` re-attaches to a cluster started by an earlier
invocation (:meth:`DevCluster.load`, :meth:`BrokerSet.load`). Errors are printed as one line,
never as a traceback. :mod:`cpgbroker.cli` dispatches ``devcluster`` here. This module uses both
:mod:`cpgbroker.dev.cluster` and :mod:`cpgbroker.dev.brokers`; neither of them imports it.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import (
    DEFAULT_PREFIX,
    DEFAULT_STATE_DIR,
    DEFAULT_TOKEN_MS,
    DevCluster,
    DevClusterError,
    NodeStatus,
    check_environment,
)


def _print_status(cluster: DevCluster, statuses: list[NodeStatus]) -> None:
    print(
        f"cluster {cluster.prefix}: {cluster.size} nodes, 10.213.{cluster.subnet}.0/24, "
        f"token {cluster.token_ms} ms, state {cluster.base}"
    )
    print(f"{'node':<5} {'netns':<20} {'address':<15} {'corosync':<16} {'quorate':<8} votes")
    for s in statuses:
        proc = f"{s.process} {s.pid}" if s.pid else s.process
        if s.partitioned:
            proc += " (cut)"
        votes = f"{s.total_votes}/{s.expected_votes}" if s.total_votes is not None else "-"
        quorate = "yes" if s.quorate else "no"
        print(f"n{s.nodeid:<4} {s.netns:<20} {s.address:<15} {proc:<16} {quorate:<8} {votes}")


def _check_ports(base: int, nodes: int, wait: float = 10.0) -> None:
    """Fail early, and clearly, if a broker port is taken (waiting a little: the brokers of a
    cluster that was just taken down may still be closing their listeners)."""
    deadline = time.monotonic() + wait
    for port in [base + i for i in range(nodes)] + [base + 10000 + i for i in range(nodes)]:
        while True:
            with socket.socket() as s:
                # As the broker's listeners do: TIME_WAIT leftovers must not count as in use.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise DevClusterError(
                            f"port {port} on 127.0.0.1 is in use; choose other ports with "
                            "--base-port"
                        ) from None
            time.sleep(0.2)


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--prefix",
        default=DEFAULT_PREFIX,
        help=f"name prefix of the cluster's namespaces (default {DEFAULT_PREFIX})",
    )
    common.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help=f"where cluster state, configs and logs live (default {DEFAULT_STATE_DIR})",
    )
    parser = argparse.ArgumentParser(
        prog="cpgbroker devcluster",
        description="A local N-node corosync cluster in network namespaces (needs root).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", parents=[common], help="create and start the cluster")
    up.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    up.add_argument("--token", type=int, default=DEFAULT_TOKEN_MS, help="totem token timeout in ms")
    up.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for quorum")
    up.add_argument(
        "--realtime",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run corosync at its default real-time priority (sched_rr: yes). Off by default: "
        "all nodes share this machine's cores, and real-time corosyncs preempt the brokers "
        "(without it corosync runs at nice -10)",
    )
    up.add_argument("--template", type=Path, help="corosync.conf template")
    up.add_argument(
        "--with-brokers",
        action="store_true",
        help="also start one cpgbroker member per node, reachable on 127.0.0.1",
    )
    up.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="EVENTS",
        help="the brokers' digest checkpoint interval ([cluster] checkpoint_every; default "
        "10000): lower for short runs, so that an audit checks the replicas",
    )
    up.add_argument(
        "--store",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give each broker a durable store in its node directory (default: yes)",
    )
    up.add_argument(
        "--base-port",
        type=int,
        default=5701,
        help="AMQP port of node 1's broker (node N: base+N-1; status endpoints base+10000+N-1)",
    )
    status = sub.add_parser("status", parents=[common], help="show each node and its quorum")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("down", parents=[common], help="stop and remove everything")
    for name, text in (
        ("kill", "SIGKILL a node's corosync (its broker, if any, then stops by itself)"),
        ("kill-broker", "SIGKILL only the broker process on a node"),
        (
            "start-broker",
            "start a node's broker again: it joins the serving cluster through a state update",
        ),
        ("stop-broker", "stop a node's broker gracefully (its clients get 320)"),
        ("stop", "SIGSTOP a node's corosync"),
        ("resume", "SIGCONT a node's corosync"),
        ("restart", "restart a node's corosync and wait until it rejoined"),
        ("partition", "cut a node's network link"),
        ("heal", "reconnect a node's network link"),
    ):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("node", type=int)
    ex = sub.add_parser("exec", parents=[common], help="run a command inside a node's namespace")
    ex.add_argument("node", type=int)
    ex.add_argument("argv", nargs="*", help="the command; put it after -- if it has options")
    return parser


def main(argv: list[str]) -> int:
    """``cpgbroker devcluster ...``; errors are printed as one line, never as a traceback."""
    command: list[str] = []
    if argv and argv[0] == "exec" and "--" in argv:
        # Everything after -- is the command, whatever options it has.
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_args(argv)
    if args.command == "exec":
        args.argv = list(args.argv) + command
    try:
        return _main(args)
    except DevClusterError as e:
        print(f"cpgbroker devcluster: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cpgbroker devcluster: interrupted", file=sys.stderr)
        return 130


def _main(args: argparse.Namespace) -> int:
    if args.command == "up":
        cluster = DevCluster(
            args.nodes,
            prefix=args.prefix,
            token_ms=args.token,
            state_dir=args.state_dir,
            template=args.template,
            realtime=args.realtime,
        )
        t0 = time.monotonic()
        if args.with_brokers:
            _check_ports(args.base_port, args.nodes)
        cluster.up(timeout=args.timeout)
        print(
            f"dev cluster {cluster.prefix} up: {cluster.size} nodes quorate after "
            f"{time.monotonic() - t0:.1f} s"
        )
        _print_status(cluster, cluster.status())
        if args.with_brokers:
            ports = {
                n.nodeid: (args.base_port + n.nodeid - 1, args.base_port + 10000 + n.nodeid - 1)
                for n in cluster.nodes
            }
            brokers = BrokerSet(
                cluster, ports=ports, checkpoint_every=args.checkpoint_every, store=args.store
            )
            try:
                brokers.start_all(timeout=60)
            except BaseException:
                cluster.down()
                raise
            brokers.save()
            print(f"brokers ready after {time.monotonic() - t0:.1f} s; AMQP URLs:")
            for n in cluster.nodes:
                print(f"  {brokers.url(n.nodeid)}    status: {brokers.admin(n.nodeid)}")
            # The members' admin endpoints answer only with their secret (cpgbroker status).
            print(f"admin secret: --secret-file {brokers.secret_path()}")
        return 0
    if args.command == "down":
        try:
            cluster = DevCluster.load(args.prefix, args.state_dir)
        except DevClusterError:
            # No state file (e.g. a crashed `up`): still sweep namespaces with this prefix.
            cluster = DevCluster(1, prefix=args.prefix, state_dir=args.state_dir)
        problem = check_environment()
        if problem:
            raise DevClusterError(problem)
        cluster.down()
        print(f"dev cluster {args.prefix} removed")
        return 0
    cluster = DevCluster.load(args.prefix, args.state_dir)
    dev_brokers = BrokerSet.load(cluster)
    if args.command == "status":
        statuses = cluster.status()
        broker_status = (
            {n.nodeid: dev_brokers.status(n.nodeid) for n in cluster.nodes} if dev_brokers else {}
        )
        if args.json:
            nodes = [s.to_json() for s in statuses]
            if dev_brokers is not None:
                for entry in nodes:
                    nid = int(entry["node"])
                    entry["broker"] = {
                        "url": dev_brokers.url(nid),
                        "status_url": dev_brokers.admin(nid),
                        "admin_secret_file": str(dev_brokers.secret_path()),
                        "status": broker_status.get(nid),
                    }
            print(
                json.dumps(
                    {
                        "prefix": cluster.prefix,
                        "subnet": f"10.213.{cluster.subnet}.0/24",
                        "token_ms": cluster.token_ms,
                        "state_dir": str(cluster.base),
                        "nodes": nodes,
                    },
                    indent=2,
                )
            )
        else:
            _print_status(cluster, statuses)
            if dev_brokers is not None:
                print(f"{'node':<5} {'broker':<36} {'state':<10} {'events':>8}  connections")
                for n in cluster.nodes:
                    st = broker_status.get(n.nodeid)
                    url = dev_brokers.url(n.nodeid)
                    if st is None:
                        print(f"n{n.nodeid:<4} {url:<36} {'down':<10}")
                        continue
                    conns = st.get("connections", {})
                    print(
                        f"n{n.nodeid:<4} {url:<36} {st.get('state', '?'):<10} "
                        f"{st.get('event_seq', 0):>8}  {conns.get('local', 0)} local, "
                        f"{conns.get('shadow', 0)} shadow"
                    )
        return 0
    if args.command == "kill-broker":
        if dev_brokers is None:
            raise DevClusterError("this dev cluster runs no brokers (up --with-brokers)")
        cluster.record_fault("kill-broker", args.node, url=dev_brokers.url(args.node))
        dev_brokers.kill(args.node)
        return 0
    if args.command == "stop-broker":
        if dev_brokers is None:
            raise DevClusterError("this dev cluster runs no brokers (up --with-brokers)")
        # An orderly shutdown, not a fault: nothing goes to the fault log.
        dev_brokers.stop(args.node)
        return 0
    if args.command == "start-broker":
        if dev_brokers is None:
            raise DevClusterError("this dev cluster runs no brokers (up --with-brokers)")
        if dev_brokers.status(args.node) is not None:
            raise DevClusterError(f"the broker on node {args.node} is already running")
        cluster.record_fault("start-broker", args.node, url=dev_brokers.url(args.node))
        dev_brokers.start(args.node)
        dev_brokers.save()
        dev_brokers.wait_ready([args.node], timeout=600)
        print(f"broker on node {args.node} joined: {dev_brokers.url(args.node)}")
        return 0
    if args.command == "exec":
        cmd = list(args.argv)
        if not cmd:
            raise DevClusterError("exec needs a command, e.g. exec 1 -- corosync-cpgtool")
        return cluster.run_in(args.node, cmd).returncode
    action = {
        "kill": cluster.kill,
        "stop": cluster.stop,
        "resume": cluster.resume,
        "restart": cluster.restart,
        "partition": cluster.partition,
        "heal": cluster.heal,
    }[args.command]
    action(args.node)
    return 0

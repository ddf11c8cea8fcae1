"""A private RabbitMQ node for tests that check cpgbroker against the real thing: Debian's
``rabbitmq-server`` (3.10.8 on bookworm) with only the management plugin, on loopback ports of
its own.

It shares nothing with a default node or another test's node on the machine: its own node
name, Erlang cookie (a private ``HOME``), epmd (own port, started here so that its pid is
known and it can be stopped), distribution, AMQP and HTTP ports, config, enabled-plugins file
and mnesia/log directories, all under the directory it is given. It is stopped by the pid of
the process that started it, never by name.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Debian's layout: the package's scripts are linked here whatever the version (the 3.10.8 of
# bookworm is what the fixtures and this module were checked with).
SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")

# Seconds. A node with the management plugin boots in 3-7 s on two cores; the bound is for a
# loaded CI machine, and a node that does not answer by then is reported with its log. A stop
# takes ~6 s, 5 of them the management plugin's own shutdown timeout on 3.10.8.
START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


def problem() -> str | None:
    """Why a private node cannot run here, or None."""
    if not SERVER.exists():
        return "rabbitmq-server is not installed (scripts/setup.sh installs it)"
    if shutil.which("epmd") is None:
        return "epmd (Erlang) is not on PATH; it comes with Debian's rabbitmq-server"
    return None


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together, so no two are the same)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class RabbitNode:
    """A running node: where to reach it, and its processes."""

    nodename: str
    amqp_port: int
    mgmt_port: int
    base: Path
    server: subprocess.Popen[bytes]
    epmd: subprocess.Popen[bytes]

    @property
    def mgmt_url(self) -> str:
        return f"http://127.0.0.1:{self.mgmt_port}"

    def api(
        self, method: str, path: str, body: Any = None, user: str = "guest", password: str = "guest"
    ) -> tuple[int, Any]:
        """One call to the management API: (status, decoded JSON body or None)."""
        data = None if body is None else json.dumps(body).encode()
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        headers = {"Authorization": f"Basic {token}", "Content-Type": "application/json"}
        req = urllib.request.Request(
            self.mgmt_url + path, data=data, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        return status, json.loads(raw) if raw else None

    def log(self, lines: int = 40) -> str:
        """The last lines of the node's own log and of its console output, for a failure."""
        out = []
        for path in [self.base / "server.out", *sorted((self.base / "log").glob("*.log"))]:
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def stop(self) -> None:
        """SIGTERM to the start script, which stops the node (Erlang takes SIGTERM as
        init:stop) and waits for it; SIGKILL to the script's process group if that takes too
        long. The node's epmd is stopped by whoever started it, after the node."""
        _stop_process(self.server)


def _environment(base: Path, nodename: str, ports: dict[str, int]) -> dict[str, str]:
    home = base / "home"
    # Nothing of a RabbitMQ setting in the caller's environment may reach this node.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
    env.update(
        HOME=str(home),  # the Erlang cookie is read from (and kept in) $HOME
        ERL_EPMD_PORT=str(ports["epmd"]),
        ERL_EPMD_ADDRESS="127.0.0.1",
        ERL_CRASH_DUMP=str(base / "erl_crash.dump"),
        RABBITMQ_NODENAME=nodename,
        RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
        RABBITMQ_NODE_PORT=str(ports["amqp"]),
        RABBITMQ_DIST_PORT=str(ports["dist"]),
        RABBITMQ_MNESIA_BASE=str(base / "mnesia"),
        RABBITMQ_LOG_BASE=str(base / "log"),
        RABBITMQ_CONFIG_FILE=str(base / "rabbitmq.conf"),
        RABBITMQ_ADVANCED_CONFIG_FILE=str(base / "advanced.config"),
        RABBITMQ_ENABLED_PLUGINS_FILE=str(base / "enabled_plugins"),
        # An empty file of our own, so that /etc/rabbitmq/rabbitmq-env.conf is not read.
        RABBITMQ_CONF_ENV_FILE=str(base / "rabbitmq-env.conf"),
        RABBITMQ_PID_FILE=str(base / "node.pid"),
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
    )
    return env


def _write_config(base: Path, ports: dict[str, int]) -> None:
    home = base / "home"
    for d in (home, base / "mnesia", base / "log"):
        d.mkdir(parents=True, exist_ok=True)
    cookie = home / ".erlang.cookie"
    cookie.write_text(secrets.token_hex(16))
    cookie.chmod(0o400)  # Erlang refuses a cookie that others can read
    (base / "rabbitmq-env.conf").write_text("")
    (base / "advanced.config").write_text("[].\n")
    # Only the management plugin: every other plugin adds to the boot time.
    (base / "enabled_plugins").write_text("[rabbitmq_management].\n")
    (base / "rabbitmq.conf").write_text(
        f"listeners.tcp.default = 127.0.0.1:{ports['amqp']}\n"
        "management.tcp.ip = 127.0.0.1\n"
        f"management.tcp.port = {ports['mgmt']}\n"
        "log.console = false\n"
        "log.file.level = info\n"
    )


def _wait_for_epmd(epmd: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + 10
    while not _port_open(port):
        if epmd.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"epmd did not listen on 127.0.0.1:{port} (rc={epmd.poll()})")
        time.sleep(0.05)


def _wait_for_management(node: RabbitNode) -> None:
    """Until ``GET /api/overview`` answers 200: the node has booted and the plugin serves."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if node.server.poll() is not None:
            raise RuntimeError(
                f"RabbitMQ node {node.nodename} exited with {node.server.returncode} while "
                f"starting:\n{node.log()}"
            )
        with contextlib.suppress(OSError):
            if node.api("GET", "/api/overview")[0] == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"RabbitMQ node {node.nodename} did not answer on its management port within "
                f"{START_TIMEOUT}s:\n{node.log()}"
            )
        time.sleep(0.2)


@contextlib.contextmanager
def rabbitmq_node(base: Path) -> Iterator[RabbitNode]:
    """Start a private node with its state under ``base``; stop it (and its epmd) on exit,
    also when starting failed half-way."""
    epmd_port, dist_port, amqp_port, mgmt_port = _free_ports(4)
    ports = {"epmd": epmd_port, "dist": dist_port, "amqp": amqp_port, "mgmt": mgmt_port}
    nodename = f"defs-{secrets.token_hex(4)}@localhost"
    _write_config(base, ports)
    env = _environment(base, nodename, ports)
    with contextlib.ExitStack() as cleanup:
        # Our own epmd, in the foreground: its pid is ours to stop. Left to itself the node
        # would start a daemonised epmd that outlives the test.
        epmd = subprocess.Popen(
            ["epmd", "-port", str(epmd_port), "-address", "127.0.0.1"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        cleanup.callback(_stop_process, epmd)
        _wait_for_epmd(epmd, epmd_port)
        with open(base / "server.out", "wb") as out:
            server = subprocess.Popen(
                [str(SERVER.resolve())],
                cwd=base,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        node = RabbitNode(nodename, amqp_port, mgmt_port, base, server, epmd)
        cleanup.callback(node.stop)
        _wait_for_management(node)
        yield node


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        # The group is the one start_new_session made for this process: only it and its
        # children (a node's beam and the beam's helpers) are in it.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT)

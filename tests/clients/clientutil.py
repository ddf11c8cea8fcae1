"""Helpers shared by the client tests: the broker subprocess, pika connection parameters with
timeouts, waiting loops with a bound, and a raw AMQP socket client for protocol-violation
tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
from pamqp import commands, frame, header
from pamqp import heartbeat as pheartbeat

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"

START_TIMEOUT = 15.0
STOP_TIMEOUT = 15.0

_LISTENING = re.compile(r"msg=listening host=(\S+) port=(\d+)")


@dataclass
class BrokerProcess:
    """A broker subprocess and where to reach it."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    host: str = "127.0.0.1"
    port: int = 0
    listeners: list[tuple[str, int]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@{self.host}:{self.port}/"

    @property
    def addr(self) -> tuple[str, int]:
        return self.host, self.port

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> int:
        """SIGTERM, then wait; SIGKILL if the broker does not exit in STOP_TIMEOUT."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT)
                raise AssertionError(
                    f"broker did not exit within {STOP_TIMEOUT}s of SIGTERM; log:\n{self.log()}"
                ) from None
        return self.proc.returncode


def start_broker(
    workdir: Path, config: str | None = None, listen: str | None = "127.0.0.1:0"
) -> BrokerProcess:
    """Start ``cpgbroker start`` in ``workdir``; return once it logged its listeners.

    ``config`` is TOML text written to ``workdir/cpgbroker.toml``. ``listen`` overrides the
    config's listeners (``None`` keeps the config's own)."""
    workdir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    cmd = [sys.executable, "-m", "cpgbroker", "start"]
    if config is not None:
        cfg_path = workdir / f"cpgbroker-{tag}.toml"
        cfg_path.write_text(config)
        cmd += ["--config", str(cfg_path)]
    if listen is not None:
        cmd += ["--listen", listen]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    log_path = workdir / f"broker-{tag}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    broker = BrokerProcess(proc, log_path)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        found = [(h, int(p)) for h, p in _LISTENING.findall(broker.log())]
        if found:
            # Both lines of a two-listener config are logged together; give the second a beat.
            time.sleep(0.05)
            found = [(h, int(p)) for h, p in _LISTENING.findall(broker.log())]
            broker.listeners = found
            broker.host, broker.port = found[0]
            return broker
        if not broker.alive():
            raise RuntimeError(
                f"broker exited with {proc.returncode} before listening; log:\n{broker.log()}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT)
            raise RuntimeError(f"broker did not listen within {START_TIMEOUT}s:\n{broker.log()}")
        time.sleep(0.05)


BrokerFactory = Callable[..., BrokerProcess]


def pika_params(addr: tuple[str, int], **kw: Any) -> pika.ConnectionParameters:
    """Connection parameters that cannot hang: socket, stack and blocked-connection timeouts."""
    kw.setdefault("socket_timeout", 5)
    kw.setdefault("stack_timeout", 10)
    kw.setdefault("blocked_connection_timeout", 10)
    kw.setdefault("connection_attempts", 1)
    return pika.ConnectionParameters(host=addr[0], port=addr[1], **kw)


def blocking(addr: tuple[str, int], **kw: Any) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika_params(addr, **kw))


def wait_until(
    pred: Callable[[], bool],
    timeout: float = 5.0,
    step: float = 0.05,
    pump: Callable[[float], None] | None = None,
) -> bool:
    """Poll ``pred`` until true or ``timeout``; ``pump(step)`` (e.g. a pika connection's
    ``sleep``) keeps a client's I/O going between polls."""
    end = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > end:
            return False
        if pump is not None:
            pump(step)
        else:
            time.sleep(step)


def drain_get(ch: Any, queue: str, limit: int = 1000) -> list[bytes]:
    """basic.get with auto-ack until get-empty; the bodies in order."""
    out = []
    for _ in range(limit):
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            break
        out.append(body)
    return out


class RawClient:
    """A hand-driven AMQP 0-9-1 client over a plain socket, for sending what no library
    would send. Reads are bounded by ``timeout``."""

    def __init__(self, addr: tuple[str, int], timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(addr, timeout=timeout)
        self.sock.settimeout(timeout)
        self.buf = b""
        self.frame_max = 0
        self.channel_max = 0
        self.heartbeat = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_method(self, channel: int, method: Any) -> None:
        self.send(frame.marshal(method, channel))

    def recv_raw(self, n: int) -> bytes:
        """Exactly ``n`` bytes (fewer only if the broker closed the socket)."""
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_frame(self) -> tuple[int, Any] | None:
        """The next frame as (channel, pamqp object), or None when the broker closed."""
        while True:
            if len(self.buf) >= 7:
                size = struct.unpack_from(">I", self.buf, 3)[0]
                if len(self.buf) >= size + 8:
                    consumed, channel, value = frame.unmarshal(self.buf)
                    self.buf = self.buf[consumed:]
                    return channel, value
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk

    def read_method(self, skip_heartbeats: bool = True) -> tuple[int, Any] | None:
        while True:
            f = self.read_frame()
            if f is None:
                return None
            if skip_heartbeats and isinstance(f[1], pheartbeat.Heartbeat):
                continue
            return f

    def wait_closed(self, timeout: float = 5.0) -> bool:
        """True once the broker closed its side of the socket (reads EOF) within timeout."""
        end = time.monotonic() + timeout
        self.sock.settimeout(0.2)
        while time.monotonic() < end:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                return True
            if not chunk:
                return True
            self.buf += chunk
        return False

    def handshake(
        self,
        user: str = "guest",
        password: str = "guest",
        vhost: str = "/",
        heartbeat: int = 0,
        frame_max: int | None = None,
        capabilities: dict[str, bool] | None = None,
    ) -> Any:
        """Protocol header .. connection.open; returns the broker's last method (open-ok)."""
        self.send(PROTOCOL_HEADER)
        f = self.read_method()
        assert f is not None and isinstance(f[1], commands.Connection.Start), f
        self.send_method(
            0,
            commands.Connection.StartOk(
                client_properties={
                    "product": "raw-test-client",
                    "capabilities": capabilities or {},
                },
                mechanism="PLAIN",
                response=f"\x00{user}\x00{password}",
                locale="en_US",
            ),
        )
        f = self.read_method()
        assert f is not None, "broker closed during the handshake"
        if not isinstance(f[1], commands.Connection.Tune):
            return f[1]
        tune = f[1]
        self.frame_max = tune.frame_max if frame_max is None else frame_max
        self.channel_max = tune.channel_max
        self.heartbeat = heartbeat
        self.send_method(
            0,
            commands.Connection.TuneOk(
                channel_max=tune.channel_max, frame_max=self.frame_max, heartbeat=heartbeat
            ),
        )
        self.send_method(0, commands.Connection.Open(virtual_host=vhost))
        f = self.read_method()
        assert f is not None, "broker closed instead of answering connection.open"
        return f[1]

    def open_channel(self, channel: int = 1) -> None:
        self.send_method(channel, commands.Channel.Open())
        f = self.read_method()
        assert f is not None and isinstance(f[1], commands.Channel.OpenOk), f

    def publish(self, channel: int, exchange: str, routing_key: str, body: bytes) -> None:
        self.send_method(
            channel, commands.Basic.Publish(exchange=exchange, routing_key=routing_key)
        )
        self.send(
            frame.marshal(header.ContentHeader(0, len(body), commands.Basic.Properties()), channel)
        )
        if body:
            self.send(struct.pack(">BHI", 3, channel, len(body)) + body + b"\xce")

"""Definitions travel both ways between cpgbroker and a real RabbitMQ 3.10.8.

A setup built on a standalone cpgbroker through its management API and over AMQP (users with
passwords and tags, a vhost, permissions with real patterns, policies, durable exchanges of
several types with an alternate exchange, an exchange-to-exchange binding, durable queues
with arguments, bindings with headers arguments) is exported with ``GET /api/definitions``
and imported into a private RabbitMQ node. RabbitMQ's own export must then hold every item of
ours as we wrote it, our users must log in there with their passwords (so our
``password_hash`` is RabbitMQ's format), and RabbitMQ must enforce what came with them (the
policy's max-length and dead-letter exchange, the permissions, the bindings). Then RabbitMQ's
export goes into a fresh cpgbroker, whose users log in with the same passwords.

Items are compared whole, as dicts matched by what names them: RabbitMQ orders items and keys
its own way, and its header fields (``rabbit_version``, ``product_*``) and ``internal_cluster_id``
global parameter are its own; nothing else of ours is allowed to differ (none did on 3.10.8,
``guest``'s hash included: ours replaces RabbitMQ's, and guest/guest goes on working there).
"""

from __future__ import annotations

import base64
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pika
import pika.exceptions
import pytest
import trio
from clientutil import blocking
from rabbitmqnode import RabbitNode, problem, rabbitmq_node

from prereq import unavailable

T = TypeVar("T")

# The whole test (two cpgbrokers and the work against the node, which was started before the
# test's clock ran) fails well inside conftest's TEST_DEADLINE, so trio reports where.
WORK_DEADLINE = 40.0

VHOST = "shop/eu"  # a "/" inside the name: it must survive percent-encoding both ways

# (name, password, tags), made through the API. Tags as a list: what both exports write.
USERS: list[tuple[str, str, list[str]]] = [
    ("shop-admin", "admin-pw-7", ["administrator"]),
    ("svc-shop", "shop-secret", ["monitoring", "policymaker"]),
]
# A user of the first broker's configuration file, with a plain password (exported as a hash
# salted from its name) and limits (exported as the user's "limits").
CONFIGURED_USER = (
    '[[users]]\nname = "svc-batch"\npassword = "batch-secret"\ntags = ["management"]\n'
    "max_connections = 5\nmax_channels = 16\n"
)
PASSWORDS = {
    "guest": "guest",
    "svc-batch": "batch-secret",
    **{name: pw for name, pw, _ in USERS},
}

PERMISSIONS: list[dict[str, str]] = [
    {"user": "guest", "vhost": VHOST, "configure": ".*", "write": ".*", "read": ".*"},
    {"user": "shop-admin", "vhost": VHOST, "configure": ".*", "write": ".*", "read": ".*"},
    {"user": "shop-admin", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
    {
        "user": "svc-shop",
        "vhost": VHOST,
        "configure": "^shop\\.tmp\\.",
        "write": "^(shop\\.events|amq\\.default)$",
        "read": "^shop\\..*|^amq\\..*",
    },
    {"user": "svc-shop", "vhost": "/", "configure": "", "write": "", "read": "^audit\\."},
    # From the configuration file: a vhost listed for a user is full access.
    {"user": "svc-batch", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
]

POLICIES: list[dict[str, Any]] = [
    {
        "vhost": VHOST,
        "name": "shop-cap",
        "pattern": "^shop\\.capped$",
        "apply-to": "queues",
        "definition": {"max-length": 2, "dead-letter-exchange": "shop.dlx"},
        "priority": 3,
    },
    {
        "vhost": VHOST,
        "name": "shop-ae",
        "pattern": "^shop\\.events$",
        "apply-to": "exchanges",
        "definition": {"alternate-exchange": "shop.unrouted"},
        "priority": 0,
    },
]


Args = dict[str, Any]


def _exchange(
    name: str, type_: str, arguments: Args | None = None, internal: bool = False
) -> dict[str, Any]:
    return {
        "name": name,
        "vhost": VHOST,
        "type": type_,
        "durable": True,
        "auto_delete": False,
        "internal": internal,
        "arguments": arguments or {},
    }


EXCHANGES: list[dict[str, Any]] = [
    _exchange("shop.unrouted", "fanout"),
    _exchange("shop.orders", "direct", {"alternate-exchange": "shop.unrouted"}),
    _exchange("shop.events", "topic"),
    _exchange("shop.docs", "headers"),
    _exchange("shop.dlx", "direct"),
    _exchange("shop.internal", "topic", internal=True),
]
HTTP_EXCHANGES = {"shop.dlx"}  # declared through the API; the others over AMQP


def _queue(name: str, arguments: Args | None = None, vhost: str = VHOST) -> dict[str, Any]:
    return {
        "name": name,
        "vhost": vhost,
        "durable": True,
        "auto_delete": False,
        "arguments": arguments or {},
    }


QUEUES: list[dict[str, Any]] = [
    _queue("shop.capped"),
    _queue("shop.dead"),
    _queue("shop.work", {"x-max-length": 1000, "x-overflow": "reject-publish"}),
    _queue("shop.quorum", {"x-queue-type": "quorum", "x-delivery-limit": 5}),
    _queue("shop.priority", {"x-max-priority": 10}),
    _queue("shop.unrouted"),
    _queue("audit.log", {"x-message-ttl": 60000}, vhost="/"),
]
HTTP_QUEUES = {"shop.dead"}


def _binding(
    source: str,
    dest: str,
    key: str,
    arguments: Args | None = None,
    dest_type: str = "queue",
    vhost: str = VHOST,
) -> dict[str, Any]:
    return {
        "source": source,
        "vhost": vhost,
        "destination": dest,
        "destination_type": dest_type,
        "routing_key": key,
        "arguments": arguments or {},
    }


BINDINGS: list[dict[str, Any]] = [
    _binding("shop.orders", "shop.work", "orders.new"),
    _binding("shop.orders", "shop.quorum", "orders.new"),
    _binding("shop.orders", "shop.priority", "orders.urgent"),
    _binding("shop.unrouted", "shop.unrouted", ""),
    _binding("shop.dlx", "shop.dead", "shop.capped"),
    _binding("shop.events", "shop.orders", "orders.*", dest_type="exchange"),
    _binding("shop.events", "shop.internal", "audit.#", dest_type="exchange"),
    _binding("shop.docs", "shop.work", "", {"x-match": "all", "format": "pdf", "type": "report"}),
    _binding("shop.docs", "shop.priority", "", {"x-match": "any", "format": "pdf", "priority": 3}),
    _binding("amq.topic", "audit.log", "audit.#", vhost="/"),
]
HTTP_BINDINGS = {("shop.dlx", "shop.dead")}

# What names an item of each kind of a definitions file (bindings: the whole item).
KEYS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "users": lambda x: x["name"],
    "vhosts": lambda x: x["name"],
    "permissions": lambda x: (x["user"], x["vhost"]),
    "policies": lambda x: (x["vhost"], x["name"]),
    "queues": lambda x: (x["vhost"], x["name"]),
    "exchanges": lambda x: (x["vhost"], x["name"]),
    "bindings": lambda x: json.dumps(x, sort_keys=True),
}


def _expected_users() -> list[dict[str, Any]]:
    # The hash is salted, so not known in advance: that it carries the password is what the
    # logins below prove. Here: the other fields RabbitMQ exports, with the values we gave.
    sha256 = "rabbit_password_hashing_sha256"
    return [
        *(
            {"name": n, "hashing_algorithm": sha256, "tags": tags, "limits": {}}
            for n, _, tags in USERS
        ),
        {
            "name": "svc-batch",
            "hashing_algorithm": sha256,
            "tags": ["management"],
            "limits": {"max-connections": 5, "max-channels": 16},
        },
    ]


def _q(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Api:
    """The management API of one broker, as guest (an administrator on loopback)."""

    def __init__(self, base: str, user: str = "guest", password: str = "guest") -> None:
        self.base = base
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        self.auth = f"Basic {token}"

    def __call__(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Authorization": self.auth}
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=20) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        return status, json.loads(raw) if raw else None

    def must(self, method: str, path: str, body: Any = None) -> Any:
        status, answer = self(method, path, body)
        assert status in (200, 201, 204), f"{method} {path} -> {status} {answer}"
        return answer


def _connect(port: int, user: str, vhost: str) -> pika.BlockingConnection:
    return blocking(
        ("127.0.0.1", port),
        virtual_host=vhost,
        credentials=pika.PlainCredentials(user, PASSWORDS[user]),
    )


@asynccontextmanager
async def _cpgbroker(workdir: Path, users: str = "") -> AsyncIterator[tuple[Api, int]]:
    """A standalone cpgbroker in this process with its management API on a port of its own,
    guest and ``users`` (TOML) configured: (its API as guest, its AMQP port)."""
    from cpgbroker.runtime.config import settings
    from cpgbroker.runtime.process import main as runtime_main

    workdir.mkdir()
    admin_port = _free_port()
    toml = workdir / "cpgbroker.toml"
    toml.write_text(
        f'[server]\nlisten = ["127.0.0.1:0"]\nadmin = "127.0.0.1:{admin_port}"\n'
        '[[users]]\nname = "guest"\npassword = "guest"\nloopback_only = true\n'
        'tags = ["administrator"]\n' + users
    )
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(runtime_main.serve, settings.load(str(toml)))
        yield Api(f"http://127.0.0.1:{admin_port}"), bound[0][1]
        nursery.cancel_scope.cancel()


@pytest.fixture(scope="module")
def rabbit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitNode]:
    """A private RabbitMQ node for this module (module scope: it boots before the test's
    deadline starts counting)."""
    missing = problem()
    if missing:
        unavailable(f"the RabbitMQ definitions tests cannot run here: {missing}")
    with rabbitmq_node(tmp_path_factory.mktemp("rabbitmq")) as node:
        yield node


def _build(api: Api, port: int) -> None:
    """The setup, through the API (users, vhost, permissions, policies, one exchange, queue
    and binding) and over AMQP (the rest)."""
    api.must("PUT", f"/api/vhosts/{_q(VHOST)}")
    for name, password, tags in USERS:
        # Tags as RabbitMQ's classic comma-separated string; both export a list.
        api.must("PUT", f"/api/users/{_q(name)}", {"password": password, "tags": ",".join(tags)})
    for p in PERMISSIONS:
        if p["user"] == "svc-batch":
            continue  # the configuration file's
        body = {k: p[k] for k in ("configure", "write", "read")}
        api.must("PUT", f"/api/permissions/{_q(p['vhost'])}/{_q(p['user'])}", body)
    for pol in POLICIES:
        body = {k: pol[k] for k in ("pattern", "apply-to", "definition", "priority")}
        api.must("PUT", f"/api/policies/{_q(pol['vhost'])}/{_q(pol['name'])}", body)
    conns = {vh: _connect(port, "shop-admin", vh) for vh in (VHOST, "/")}
    try:
        for x in EXCHANGES:
            if x["name"] in HTTP_EXCHANGES:
                body = {k: v for k, v in x.items() if k not in ("name", "vhost")}
                api.must("PUT", f"/api/exchanges/{_q(x['vhost'])}/{_q(x['name'])}", body)
                continue
            conns[x["vhost"]].channel().exchange_declare(
                x["name"],
                x["type"],
                durable=x["durable"],
                auto_delete=x["auto_delete"],
                internal=x["internal"],
                arguments=x["arguments"],
            )
        for q in QUEUES:
            if q["name"] in HTTP_QUEUES:
                body = {k: v for k, v in q.items() if k not in ("name", "vhost")}
                api.must("PUT", f"/api/queues/{_q(q['vhost'])}/{_q(q['name'])}", body)
                continue
            conns[q["vhost"]].channel().queue_declare(
                q["name"],
                durable=q["durable"],
                auto_delete=q["auto_delete"],
                arguments=q["arguments"],
            )
        for b in BINDINGS:
            if (b["source"], b["destination"]) in HTTP_BINDINGS:
                kind = "q" if b["destination_type"] == "queue" else "e"
                source, dest = _q(b["source"]), _q(b["destination"])
                path = f"/api/bindings/{_q(b['vhost'])}/e/{source}/{kind}/{dest}"
                api.must(
                    "POST", path, {"routing_key": b["routing_key"], "arguments": b["arguments"]}
                )
                continue
            ch = conns[b["vhost"]].channel()
            if b["destination_type"] == "queue":
                ch.queue_bind(b["destination"], b["source"], b["routing_key"], b["arguments"])
            else:
                ch.exchange_bind(b["destination"], b["source"], b["routing_key"], b["arguments"])
    finally:
        for c in conns.values():
            c.close()


def _differences(
    kind: str, wanted: list[dict[str, Any]], got: list[dict[str, Any]], fields: bool = False
) -> list[str]:
    """Each item of ``wanted`` that ``got`` lacks or holds otherwise, described. ``fields``:
    compare only the fields ``wanted`` has (for users, whose salted hash is not known in
    advance); otherwise the whole item, as a dict."""
    key = KEYS[kind]
    by_key = {key(x): x for x in got}
    out = []
    for w in wanted:
        g = by_key.get(key(w))
        shown = {k: g[k] for k in w if k in g} if g is not None and fields else g
        if shown != w:
            out.append(f"{kind}: wanted {w}\n{' ' * len(kind)}  found  {g}")
    return out


def _ours_in(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Every user, vhost, permission, policy, queue, exchange and binding of ``ours`` as it is
    in ``theirs`` (whole items: a field ours adds, drops or writes otherwise is a difference)."""
    out = []
    for kind in KEYS:
        out += _differences(kind, ours[kind], theirs[kind])
    return out


def _expected_in(defs: dict[str, Any]) -> list[str]:
    """The setup as we wrote it, in ``defs``."""
    return [
        *_differences("users", _expected_users(), defs["users"], fields=True),
        *_differences("vhosts", [{"name": VHOST}], defs["vhosts"]),
        *_differences("permissions", PERMISSIONS, defs["permissions"]),
        *_differences("policies", POLICIES, defs["policies"]),
        *_differences("exchanges", EXCHANGES, defs["exchanges"]),
        *_differences("queues", QUEUES, defs["queues"]),
        *_differences("bindings", BINDINGS, defs["bindings"]),
    ]


def _none(differences: list[str]) -> None:
    assert not differences, "\n".join(differences)


def _refused(port: int, user: str, vhost: str) -> None:
    """A wrong password is refused (so a login with the right one proves something)."""
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        blocking(
            ("127.0.0.1", port),
            virtual_host=vhost,
            credentials=pika.PlainCredentials(user, "not-" + PASSWORDS[user]),
        )


def _check_on_rabbitmq(port: int) -> None:
    """What came with the definitions works on RabbitMQ: logins with our passwords, the
    permissions, the policy's max-length and dead-letter exchange, the bindings."""
    _refused(port, "svc-shop", VHOST)
    svc = _connect(port, "svc-shop", VHOST)
    try:
        ch = svc.channel()
        ch.confirm_delivery()
        for i in range(5):
            ch.basic_publish("", "shop.capped", b"m%d" % i)
        # shop-cap: max-length 2 keeps the newest two; the three dropped from the head are
        # dead-lettered through shop.dlx (bound to shop.dead by their routing key).
        assert _drain(ch, "shop.capped", 2) == [b"m3", b"m4"]
        assert _drain(ch, "shop.dead", 3) == [b"m0", b"m1", b"m2"]
        # The exchange-to-exchange binding and the policy's alternate exchange of shop.events.
        ch.basic_publish("shop.events", "orders.new", b"order")
        ch.basic_publish("shop.events", "nowhere", b"lost")
        assert _drain(ch, "shop.work", 1) == [b"order"]
        assert _drain(ch, "shop.unrouted", 1) == [b"lost"]
        # svc-shop's write pattern does not cover shop.orders.
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.basic_publish("shop.orders", "orders.new", b"x")
        assert refused.value.reply_code == 403
    finally:
        if svc.is_open:
            svc.close()
    admin = _connect(port, "shop-admin", VHOST)
    try:
        ch = admin.channel()
        ch.confirm_delivery()
        # The headers bindings' arguments: x-match all and any.
        headers = pika.BasicProperties(headers={"format": "pdf", "type": "report"})
        ch.basic_publish("shop.docs", "", b"doc", headers)
        ch.basic_publish("shop.orders", "orders.none", b"ae")  # shop.orders' alternate-exchange
        assert _drain(ch, "shop.work", 1) == [b"doc"]
        assert _drain(ch, "shop.priority", 1) == [b"doc"]
        assert _drain(ch, "shop.unrouted", 1) == [b"ae"]
    finally:
        admin.close()


def _drain(ch: Any, queue: str, count: int) -> list[bytes]:
    """The bodies of ``queue``, got until ``count`` came (dead-lettering and routing
    through exchanges reach a queue a moment after the publisher's confirm), then one more
    get to show there is nothing else."""
    bodies: list[bytes] = []
    deadline = time.monotonic() + 5
    while len(bodies) < count and time.monotonic() < deadline:
        method, _, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            time.sleep(0.05)
        else:
            bodies.append(body)
    method, _, body = ch.basic_get(queue, auto_ack=True)
    return bodies if method is None else [*bodies, body]


def _logins(port: int, users: list[dict[str, Any]], permissions: list[dict[str, Any]]) -> None:
    """Every user of ``users`` logs in with its password, into a vhost it may open."""
    for u in users:
        vhost = next(p["vhost"] for p in permissions if p["user"] == u["name"])
        _connect(port, u["name"], vhost).close()


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    return await trio.to_thread.run_sync(fn, *args)


async def test_our_definitions_import_into_rabbitmq_and_back(
    rabbit: RabbitNode, tmp_path: Path
) -> None:
    rmq = Api(rabbit.mgmt_url)
    with trio.fail_after(WORK_DEADLINE):
        async with _cpgbroker(tmp_path / "ours", CONFIGURED_USER) as (api, port):
            await _in_thread(_build, api, port)
            ours = await _in_thread(api.must, "GET", "/api/definitions")
        # Our export holds the setup as we wrote it (else the checks below prove little).
        _none(_expected_in(ours))

        status, body = await _in_thread(rmq, "POST", "/api/definitions", ours)
        assert (status, body) == (204, None), body
        theirs = await _in_thread(rmq.must, "GET", "/api/definitions")
        assert sorted(ours) == sorted(theirs)  # the same sections, none left out or added
        _none(_ours_in(theirs, ours))
        _none(_expected_in(theirs))
        await _in_thread(_logins, rabbit.amqp_port, _expected_users(), PERMISSIONS)
        await _in_thread(_check_on_rabbitmq, rabbit.amqp_port)

        # The way back: RabbitMQ's export of all that into a fresh cpgbroker.
        async with _cpgbroker(tmp_path / "fresh") as (api, port):
            status, body = await _in_thread(api, "POST", "/api/definitions", theirs)
            assert (status, body) == (204, None), body
            again = await _in_thread(api.must, "GET", "/api/definitions")
            await _in_thread(_logins, port, theirs["users"], theirs["permissions"])
            await _in_thread(_refused, port, "svc-batch", "/")
        _none(_ours_in(again, theirs))

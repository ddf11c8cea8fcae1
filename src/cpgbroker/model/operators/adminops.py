"""Operators' changes to queues, exchanges, bindings, messages and connections
(model/operators/admin.py routes them here): the management API's declares, deletes, purges, binds,
publishes, gets and connection closes.

They go through the very handlers AMQP clients reach, on a *management connection*: a
connection object that exists only for the one event (never in the broker's connections, never
snapshotted), of the asking user in the named vhost, that emits nothing. So an HTTP declare gets
the checks, limits, permissions and texts a client's declare gets, as in RabbitMQ (whose
management plugin declares through an AMQP channel too). Owns nothing.
"""

from __future__ import annotations

import base64
import binascii
from types import SimpleNamespace
from typing import Any

from pamqp import commands
from pamqp import header as pheader

from cpgbroker.errors import AMQPError, ReplyCode
from cpgbroker.model import entities as E
from cpgbroker.model.access.permissions import READ, WRITE, Permissions
from cpgbroker.model.clients.connection import ConnectionProtocol
from cpgbroker.model.messages.consumers import Consumers
from cpgbroker.model.messages.delivery import Delivery
from cpgbroker.model.operators.adminargs import (
    AdminError,
    Answer,
    bad_request,
    bool_arg,
    int_arg,
    json_value,
    not_found,
    properties_key,
    table_arg,
    text_arg,
)
from cpgbroker.model.routing.topology import Topology
from cpgbroker.model.versions import EXACT_FIELD_TABLES, ModelVersion
from cpgbroker.wire.fastpath import parse_content_header, with_headers
from cpgbroker.wire.fieldtable import BOOL, DOUBLE, LONG, VOID, Field, Table
from cpgbroker.wire.framer import FrameReader

R = ReplyCode

# RabbitMQ's reason for a connection closed through the management API (its default when the
# request carries no X-Reason header).
CLOSED_VIA_MANAGEMENT = "Closed via management plugin"
GET_ACKMODES = (
    "ack_requeue_true",
    "ack_requeue_false",
    "reject_requeue_true",
    "reject_requeue_false",
)


class ResourceOps:
    def __init__(
        self,
        permissions: Permissions,
        topology: Topology,
        conns: ConnectionProtocol,
        delivery: Delivery,
        consumers: Consumers,
        version: ModelVersion,
    ) -> None:
        # The cluster's model version (read at every use: it moves up at an event).
        self._version = version
        self._permissions = permissions
        self._topology = topology
        self._conns = conns
        self._delivery = delivery
        self._consumers = consumers
        # Whether the command being applied is this replica's operator's (set by Admin):
        # only then is an answer that is output alone (the messages of a get) built at all.
        self.answering = False

    # ------------------------------------------------------------------ queues, exchanges

    def _session(self, who: str, vhost: str) -> tuple[E.Connection, E.Channel]:
        """A management connection (module docstring) of ``who`` in ``vhost``."""
        if vhost not in self._topology.vhosts:
            raise AdminError(404, "not_found", "vhost_not_found")
        conn = E.Connection(
            id=-1, member=-1, peer="management", loopback=True, reader=FrameReader(4096)
        )
        conn.user = who
        conn.vhost = vhost
        conn.state = E.OPEN
        conn.emit = False
        return conn, E.Channel(1, conn)

    def put_queue(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = text_arg(args, "vhost"), text_arg(args, "name")
        conn, ch = self._session(who, vhost)
        new = name not in self._topology.vhosts[vhost].queues
        self._topology.q_declare(
            conn,
            ch,
            SimpleNamespace(
                queue=name,
                passive=False,
                durable=bool_arg(args, "durable", False),
                exclusive=False,
                auto_delete=bool_arg(args, "auto_delete", False),
                nowait=True,
                arguments=table_arg(args, "arguments"),
            ),
        )
        return (201 if new else 204), None

    def delete_queue(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = text_arg(args, "vhost"), text_arg(args, "name")
        conn, ch = self._session(who, vhost)
        if name not in self._topology.vhosts[vhost].queues:
            raise not_found()
        self._topology.q_delete(
            conn,
            ch,
            SimpleNamespace(
                queue=name,
                if_unused=bool_arg(args, "if_unused", False),
                if_empty=bool_arg(args, "if_empty", False),
                nowait=True,
            ),
        )
        return 204, None

    def purge_queue(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = text_arg(args, "vhost"), text_arg(args, "name")
        conn, ch = self._session(who, vhost)
        if name not in self._topology.vhosts[vhost].queues:
            raise not_found()
        self._topology.q_purge(conn, ch, SimpleNamespace(queue=name, nowait=True))
        return 204, None

    def put_exchange(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = text_arg(args, "vhost"), text_arg(args, "name")
        conn, ch = self._session(who, vhost)
        new = name not in self._topology.vhosts[vhost].exchanges
        self._topology.ex_declare(
            conn,
            ch,
            SimpleNamespace(
                exchange=name,
                exchange_type=text_arg(args, "type", "direct"),
                passive=False,
                durable=bool_arg(args, "durable", False),
                auto_delete=bool_arg(args, "auto_delete", False),
                internal=bool_arg(args, "internal", False),
                nowait=True,
                arguments=table_arg(args, "arguments"),
            ),
        )
        return (201 if new else 204), None

    def delete_exchange(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = text_arg(args, "vhost"), text_arg(args, "name")
        conn, ch = self._session(who, vhost)
        if name not in self._topology.vhosts[vhost].exchanges:
            raise not_found()
        self._topology.ex_delete(
            conn,
            ch,
            SimpleNamespace(
                exchange=name, if_unused=bool_arg(args, "if_unused", False), nowait=True
            ),
        )
        return 204, None

    # ------------------------------------------------------------------ bindings

    def _binding_ends(self, args: dict[str, Any], who: str) -> tuple[E.Connection, E.Channel, str]:
        vhost = text_arg(args, "vhost")
        conn, ch = self._session(who, vhost)
        vh = self._topology.vhosts[vhost]
        kind = text_arg(args, "destination_type")
        if kind not in ("q", "e"):
            raise bad_request("destination_type must be q or e")
        source, dest = text_arg(args, "source"), text_arg(args, "destination")
        # RabbitMQ answers 404 for a binding whose ends do not exist, before anything else.
        if source not in vh.exchanges:
            raise AdminError(404, "not_found", f"no exchange '{source}' in vhost '{vhost}'")
        if dest not in (vh.queues if kind == "q" else vh.exchanges):
            what = "queue" if kind == "q" else "exchange"
            raise AdminError(404, "not_found", f"no {what} '{dest}' in vhost '{vhost}'")
        return conn, ch, kind

    def bind(self, args: dict[str, Any], who: str) -> Answer:
        conn, ch, kind = self._binding_ends(args, who)
        key = text_arg(args, "routing_key", "")
        arguments = table_arg(args, "arguments")
        if kind == "q":
            self._topology.q_bind(
                conn,
                ch,
                SimpleNamespace(
                    queue=args["destination"],
                    exchange=args["source"],
                    routing_key=key,
                    arguments=arguments,
                    nowait=True,
                ),
            )
        else:
            self._topology.ex_bind(
                conn,
                ch,
                SimpleNamespace(
                    destination=args["destination"],
                    source=args["source"],
                    routing_key=key,
                    arguments=arguments,
                    nowait=True,
                ),
            )
        # The new binding's id, for the Location header RabbitMQ answers with.
        return 201, {"properties_key": properties_key(key, arguments)}

    def unbind(self, args: dict[str, Any], who: str) -> Answer:
        conn, ch, kind = self._binding_ends(args, who)
        vh = self._topology.vhosts[conn.vhost]
        props = text_arg(args, "properties_key")
        src = vh.exchanges[args["source"]]
        dest: Any = (vh.queues if kind == "q" else vh.exchanges)[args["destination"]]
        found = next(
            (b for b in src.bindings if b.dest is dest and properties_key(b.key, b.args) == props),
            None,
        )
        if found is None:
            raise not_found()
        m = SimpleNamespace(
            routing_key=found.key, arguments=found.args, nowait=True, source=src.name
        )
        if kind == "q":
            m.queue, m.exchange = dest.name, src.name
            self._topology.q_unbind(conn, ch, m)
        else:
            m.destination = dest.name
            self._topology.ex_unbind(conn, ch, m)
        return 204, None

    # ------------------------------------------------------------------ messages

    def publish(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = text_arg(args, "vhost"), text_arg(args, "name")
        conn, _ = self._session(who, vhost)
        vh = self._topology.vhosts[vhost]
        ex = vh.exchanges.get(name)
        if ex is None:
            raise bad_request(f"404 NOT_FOUND - no exchange '{name}' in vhost '{vhost}'")
        self._permissions.check(conn, WRITE, "exchange", name)
        if ex.internal:
            raise AMQPError(
                R.ACCESS_REFUSED,
                f"cannot publish to internal exchange '{name}' in vhost '{vhost}'",
            )
        missing = [k for k in ("routing_key", "payload", "payload_encoding") if k not in args]
        if missing:
            raise bad_request("[" + ",".join(f"{{key_missing,{k}}}" for k in missing) + "]")
        payload = text_arg(args, "payload")
        encoding = text_arg(args, "payload_encoding")
        if encoding == "string":
            body = payload.encode()
        elif encoding == "base64":
            try:
                body = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise bad_request(f"not_base64: {payload}"[:200]) from None
        else:
            raise bad_request(f"unsupported_encoding: {encoding}"[:200])
        header = _content_header(
            table_arg(args, "properties"),
            len(body),
            exact=self._version.at_least(EXACT_FIELD_TABLES),
        )
        routed = self._delivery.publish_admin(
            vh, ex, text_arg(args, "routing_key", ""), header, body
        )
        return 200, {"routed": routed}

    def get(self, args: dict[str, Any], who: str) -> Answer:
        vhost, name = text_arg(args, "vhost"), text_arg(args, "name")
        conn, ch = self._session(who, vhost)
        ackmode = text_arg(args, "ackmode", "")
        if not ackmode and "requeue" in args:
            # RabbitMQ before 3.7 took requeue: true/false; clients still send it.
            ackmode = "ack_requeue_true" if bool_arg(args, "requeue", True) else "ack_requeue_false"
        if ackmode not in GET_ACKMODES:
            raise bad_request(f"ackmode must be one of {', '.join(GET_ACKMODES)}")
        encoding = text_arg(args, "encoding", "auto")
        if encoding not in ("auto", "base64"):
            raise bad_request("Unsupported encoding. Please use auto or base64.")
        truncate = args.get("truncate")
        limit = None if truncate in (None, "") else int_arg(args, "truncate", 0)
        self._permissions.check(conn, READ, "queue", name)
        q = self._topology.queue(conn, ch, name)
        out: list[dict[str, Any]] = []
        for e, left in self._consumers.admin_get(q, int_arg(args, "count", 1), ackmode):
            if not self.answering:
                continue  # the messages are output: only the asking member shows them
            body = e.msg.body if limit is None else e.msg.body[:limit]
            if encoding == "auto":
                try:
                    payload, kind = body.decode(), "string"
                except UnicodeDecodeError:
                    payload, kind = base64.b64encode(body).decode(), "base64"
            else:
                payload, kind = base64.b64encode(body).decode(), "base64"
            out.append(
                {
                    "payload_bytes": len(e.msg.body),
                    "redelivered": e.redelivered,
                    "exchange": e.msg.exchange,
                    "routing_key": e.msg.routing_key,
                    "message_count": left,
                    # RabbitMQ shows no properties as [] (an empty Erlang proplist).
                    "properties": _properties_json(e.msg.header) or [],
                    "payload": payload,
                    "payload_encoding": kind,
                }
            )
        return 200, out

    # ------------------------------------------------------------------ connections

    def close_connection(self, args: dict[str, Any], who: str) -> Answer:
        conn_id = int_arg(args, "conn", 0)
        conn = self._conns.connections.get(conn_id)
        if conn is None:
            raise not_found()
        reason = text_arg(args, "reason", "") or CLOSED_VIA_MANAGEMENT
        self._conns.close(conn.id, R.CONNECTION_FORCED, reason)
        return 204, None


# The properties the management API takes, with the pamqp names they are set by.
_PROPERTY_NAMES = {
    "content_type": "content_type",
    "content_encoding": "content_encoding",
    "headers": "headers",
    "delivery_mode": "delivery_mode",
    "priority": "priority",
    "correlation_id": "correlation_id",
    "reply_to": "reply_to",
    "expiration": "expiration",
    "message_id": "message_id",
    "timestamp": "timestamp",
    "type": "message_type",
    "user_id": "user_id",
    "app_id": "app_id",
    "cluster_id": "cluster_id",
}


def _content_header(props: dict[str, Any], size: int, *, exact: bool = False) -> bytes:
    """The content header of a message published through the API, encoded by pamqp (once,
    on every replica alike: its encoding is a pure function of the properties). With
    ``exact`` (model version 8, ``EXACT_FIELD_TABLES``) the ``headers`` table is written as
    RabbitMQ's management plugin writes it (``rabbit_misc:to_amqp_table``): integers as
    signed 64-bit ``l``, numbers with a fraction or an exponent as doubles ``d`` (pamqp writes
    a 32-bit ``f``, which cuts them), strings ``S``, booleans ``t``, objects ``F`` and lists
    ``A`` alike inside, names in order; a JSON null stays a void ``V`` (RabbitMQ refuses it)."""
    kw: dict[str, Any] = {}
    for key, value in props.items():
        name = _PROPERTY_NAMES.get(key)
        if name is not None:  # RabbitMQ ignores a property it does not know
            kw[name] = value
    exp = kw.get("expiration")
    if exp is not None and (not isinstance(exp, str) or not exp.isdigit() or not exp.isascii()):
        raise bad_request(f"invalid expiration {exp!r}")
    headers = kw.pop("headers", None) if exact else None
    try:
        raw = bytes(pheader.ContentHeader(0, size, commands.Basic.Properties(**kw)).marshal())
        if headers is not None:
            if not isinstance(headers, dict):
                raise ValueError(f"headers must be an object, not {_json_type(headers)}")
            raw = with_headers(raw, _rabbit_field(headers).data)
        # Through our own check too: what a client could not publish, the API cannot.
        parse_content_header(raw, roundtrip=not exact)
    except (TypeError, ValueError, OverflowError, AttributeError) as e:
        raise bad_request(f"invalid message properties: {e}") from None
    return raw


def _rabbit_field(v: Any) -> Field:
    """A JSON value as RabbitMQ's management plugin types it (``_content_header``)."""
    if isinstance(v, bool):
        return Field.of(BOOL, v)
    if isinstance(v, int):
        return Field.of(LONG, v)
    if isinstance(v, float):
        return Field.of(DOUBLE, v)
    if isinstance(v, str):
        return Field.longstr(v)
    if isinstance(v, dict):
        return Field.table(Table((str(k), _rabbit_field(x)) for k, x in sorted(v.items())))
    if isinstance(v, list):
        return Field.array(_rabbit_field(x) for x in v)
    if v is None:
        return Field.of(VOID, None)
    raise ValueError(f"unhandled type {_json_type(v)}")


def _json_type(v: Any) -> str:
    return type(v).__name__


def _properties_json(header: bytes) -> dict[str, Any]:
    """A message's properties as RabbitMQ's get answers them (only those set)."""
    try:
        h = pheader.ContentHeader()
        h.unmarshal(header)
    except (ValueError, TypeError, IndexError):
        return {}
    out: dict[str, Any] = {}
    for key, name in _PROPERTY_NAMES.items():
        v = getattr(h.properties, name, None)
        if v is None or (key == "cluster_id" and v == ""):  # pamqp's default for an unset one
            continue
        if key == "timestamp" and hasattr(v, "timestamp"):
            v = int(v.timestamp())
        out[key] = json_value(v)
    return out

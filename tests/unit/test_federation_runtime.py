"""The pure parts of a member's federation links (runtime/federation/links.py): who runs a
link, what the upstream queue is called and bound with, what status shows of a URI, and the TLS
context a link uses towards an amqps upstream."""

from __future__ import annotations

import collections
import ssl
from pathlib import Path
from typing import Any

from pamqp import commands
from pamqp import encode as pencode
from pamqp import header as pheader
from test_admin_model import Ops

import tlscerts
from cpgbroker.model.federation import RECEIVED_FROM, Link, Upstream
from cpgbroker.runtime.config.tls import TlsConfig
from cpgbroker.runtime.federation.links import (
    been_at_exact,
    client_context,
    owner,
    queue_name,
    redacted,
    travelled_exact,
    wanted_bindings,
    with_hop_exact,
)
from cpgbroker.wire import fastpath as fp
from cpgbroker.wire.fieldtable import DOUBLE, Field, Table, decode_table
from modelclient import Harness


def _link(exchange: str, upstream: str = "central") -> Link:
    return Link("/", exchange, Upstream("/", upstream, ("amqp://h/",)))


def test_every_member_picks_the_same_runner_and_links_spread() -> None:
    links = [_link(f"ex{i}") for i in range(300)]
    ready = [12, 7, 31]
    picks = [owner(link, ready) for link in links]
    # The same answer whatever order a member lists the ready members in.
    assert picks == [owner(link, [31, 12, 7]) for link in links]
    spread = collections.Counter(picks)
    assert set(spread) == {7, 12, 31} and min(spread.values()) > 60
    assert owner(links[0], []) is None
    # A member leaving moves only the links it ran (and those the new count re-picks).
    after = [owner(link, [7, 31]) for link in links]
    assert all(a in (7, 31) for a in after)


def test_upstream_queue_names_are_stable_and_any_client_may_declare_them() -> None:
    name = queue_name(_link("orders.in"), "remote-eu")
    assert name == "federation: orders.in to remote-eu from central"
    odd = queue_name(_link("é(x)>y", upstream="c>1"), "r")
    assert odd == "federation: __x__y to r from c_1"


def test_status_never_shows_a_password() -> None:
    assert redacted("amqp://fed:s3cret@10.0.0.1:5672/%2F") == "amqp://fed@10.0.0.1:5672/%2F"
    assert redacted("amqps://10.0.0.1/") == "amqps://10.0.0.1/"


def test_local_bindings_are_normalised_one_per_key() -> None:
    h = Harness()
    ops = Ops(h)
    ops("put_exchange", vhost="/", name="t", type="topic")
    ops("put_exchange", vhost="/", name="hx", type="headers")
    for q in ("a", "b", "c"):
        ops("put_queue", vhost="/", name=q)
        ops("bind", vhost="/", source="t", destination=q, destination_type="q", routing_key="eu.#")
    ops("bind", vhost="/", source="t", destination="a", destination_type="q", routing_key="us.*")
    for q, fmt in (("a", "pdf"), ("b", "pdf"), ("c", "csv")):
        ops(
            "bind",
            vhost="/",
            source="hx",
            destination=q,
            destination_type="q",
            routing_key="",
            arguments={"format": fmt, "x-match": "all"},
        )
    topic = wanted_bindings(h.broker, _link("t"))
    assert [k[0] for k in topic] == ["eu.#", "us.*"]
    headers = wanted_bindings(h.broker, _link("hx"))
    assert sorted(a["format"] for a in headers.values()) == ["csv", "pdf"]
    assert wanted_bindings(h.broker, _link("gone")) == {}


def test_amqps_links_trust_the_configured_ca_and_present_the_members_certificate(
    tmp_path: Path,
) -> None:
    certs = tlscerts.make(tmp_path)
    assert client_context(None) is None
    context = client_context(
        TlsConfig(certfile=certs.server.cert, keyfile=certs.server.key, cacertfile=certs.ca)
    )
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    # The configured CA is what it trusts.
    subjects = [dict(x[0] for x in c["subject"]) for c in context.get_ca_certs()]
    assert any(s.get("organizationName") == tlscerts.ORG for s in subjects)


def test_a_link_whose_runner_left_shows_as_starting_until_the_next_one_reports() -> None:
    from cpgbroker.model.events import MemberLeft
    from cpgbroker.runtime.mgmt.views import cluster_view, federation_links_json

    h = Harness()
    ops = Ops(h)
    ops("put_parameter", component="federation-upstream", vhost="/", name="central",
        value={"uri": "amqp://h/", "push": True})  # fmt: skip
    ops("put_exchange", vhost="/", name="ev", type="topic")
    ops("put_policy", vhost="/", name="f", pattern="^ev$",
        definition={"federation-upstream": "central"}, **{"apply-to": "exchanges"})  # fmt: skip
    state = {"status": "running", "member": 7, "uri": "amqp://h/", "pushed": 12}
    ops("federation_status", vhost="/", exchange="ev", upstream="central", state=state)

    def shown(*ready: int) -> dict[str, object]:
        members = [{"member": m, "url": f"amqp://10.0.0.{m}/", "status": "ready"} for m in ready]
        view = cluster_view({"state": "ready", "members": members}, h.broker, "h")
        (link,) = federation_links_json(h.broker, view)
        return link

    assert shown(7, 8)["status"] == "running" and shown(7, 8)["pushed"] == 12
    # The runner's departure, at its point of the order on every member (model/broker.py).
    h.apply(MemberLeft(7))
    assert shown(8, 9)["status"] == "starting"
    assert h.broker.federation.status[("/", "ev", "central")]["pushed"] == 12


def _header(headers: bytes | None, **props: Any) -> bytes:
    """A content header (class basic, body of 1 byte) with ``headers`` as its table's bytes
    (u32 length first) and other properties from pamqp."""
    raw = bytes(pheader.ContentHeader(0, 1, commands.Basic.Properties(**props)).marshal())
    if headers is None:
        return raw
    flags = (raw[12] << 8 | raw[13]) | fp.FLAG_HEADERS
    at = fp.property_span(raw, fp.FLAG_HEADERS)[0]
    return raw[:12] + bytes((flags >> 8, flags & 0xFF)) + raw[14:at] + headers + raw[at:]


def test_from_model_version_8_a_link_changes_only_x_received_from() -> None:
    """What a link forwards or pushes keeps every header byte for byte (a double, a long
    string that is not UTF-8, a name given twice); its hop goes at the end of
    ``x-received-from``, written as pamqp wrote it at version 7."""
    earlier = Table([("cluster-name", Field.longstr("far")), ("exchange", Field.longstr("e"))])
    table = Table(
        [
            ("price", Field.of(DOUBLE, 1.1)),
            ("id", Field.longstr(b"\xff\xfe")),
            ("dup", Field.long(1)),
            ("dup", Field.long(2)),
            (RECEIVED_FROM, Field.array([Field.table(earlier)])),
            ("after", Field.of(DOUBLE, 4.9e-324)),
        ]
    )
    header = _header(table.encode(), content_type="text/plain", delivery_mode=2)
    got, seen = travelled_exact(header)
    assert got == table and len(seen) == 1
    assert been_at_exact(seen, "far", 10) and not been_at_exact(seen, "near", 10)
    assert been_at_exact(seen, "near", 1)  # max-hops
    hop = {"uri": "amqp://u@h/", "exchange": "x", "cluster-name": "us", "redelivered": False}
    out = with_hop_exact(header, got, seen, hop)
    start, end = fp.property_span(out, fp.FLAG_HEADERS)
    after = decode_table(out, start, end)[0]
    hops = after.get(RECEIVED_FROM)
    assert hops is not None and isinstance(hops.value, list)
    assert hops.value[0] == Field.table(earlier)
    # The new entry: the bytes pamqp wrote for the same dict at version 7.
    assert hops.value[1].data == pencode.field_table(hop)
    # Everything else as it was: the other entries, in their places, and every property.
    assert [(k, f) for k, f in after if k != RECEIVED_FROM] == [
        (k, f) for k, f in table if k != RECEIVED_FROM
    ]
    assert [k for k, _ in after] == [k for k, _ in table]
    h0, h1 = fp.property_span(header, fp.FLAG_HEADERS)
    assert out[:14] == header[:14] and out[14:start] == header[14:h0]
    assert out[end:] == header[h1:]
    # A header without a table gets one holding the hop only.
    bare = _header(None, content_type="a")
    out = with_hop_exact(bare, *travelled_exact(bare), hop)
    start, end = fp.property_span(out, fp.FLAG_HEADERS)
    assert [k for k, _ in decode_table(out, start, end)[0]] == [RECEIVED_FROM]
    assert fp.parse_content_header(out, roundtrip=False).headers_span == (start, end)


def test_hops_name_the_cluster_as_its_connection_start_does_and_queues_keep_their_name() -> None:
    """Without a server id, a downstream pulling from this cluster writes the upstream's
    connection.start ``cluster_name`` ([cluster] name) into ``x-received-from``: this cluster's
    own hops and loop checks use that name too. Its queues upstream keep the group's name, so
    that renaming the cluster leaves them where they are."""
    from cpgbroker.runtime.federation.links import FederationLinks

    def links(server_id: str, cluster_name: str) -> FederationLinks:
        return FederationLinks(
            1,
            server_id,
            server_id or "group",
            None,  # type: ignore[arg-type]  # (not used before a link runs)
            lambda: None,  # type: ignore[arg-type,return-value]
            list,
            lambda: False,
            cluster_name=cluster_name,
        )

    named = links("", "prod-eu")
    assert (named.name, named.hop_name) == ("group", "prod-eu")
    assert queue_name(_link("x"), named.name) == queue_name(_link("x"), "group")
    assert links("", "group").hop_name == "group"  # the default name: as before
    with_id = links("east", "prod-eu")
    assert (with_id.name, with_id.hop_name) == ("east", "east")

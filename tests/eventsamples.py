"""One sample of every kind of model event and cluster control event, with the values that
exercise each field's encoding (a TLS client with a certificate user, a failed record, ...).

Imported by tests/unit/test_eventtypes.py, and run as a script by
tests/integration/test_release_formats.py under every release of tests/upgrade/releases.toml:
``python eventsamples.py`` prints, one line a sample, the bytes each release's CPG codec and
journal codec write for it (release 0.1.0 has the same constructors for all of these)."""

from __future__ import annotations

import sys
from typing import Any


def model_events() -> list[Any]:
    from cpgbroker.model.events import (
        AdminCommand,
        Changes,
        ClientConnected,
        ClientData,
        ClientDisconnected,
        CloseClient,
        ClusterMembers,
        DiskAlarm,
        DoOutput,
        Forward,
        MemberLeft,
        Recovered,
        Tick,
    )

    member = 5 << 22 | 77
    conn = member << 32 | 9
    return [
        ClientData(conn, b"\x01\x00\x01\x00\x00\x00\x04abcd\xce"),
        ClientConnected(conn, member, "10.0.0.1:5555", False),
        ClientConnected(conn, member, "127.0.0.1:6", True, True, "CN=alice é"),
        ClientDisconnected(conn, "reset by peer"),
        DoOutput(conn, 128),
        CloseClient(conn, 320, "forced é"),
        Tick(1_764_000_000_123),
        MemberLeft(member),
        ClusterMembers(("amqp://a:5672/", "amqp://b:5673/")),
        Recovered(),
        DiskAlarm(member, True),
        AdminCommand(member, 3, "ops", "put_user", b'{"name": "x"}'),
        Forward(
            member,
            4,
            "/",
            "fed.ex",
            "up",
            (("rk", b"\x00\x3c\x00\x00", b"body", b"d" * 16, False),),
        ),
        Changes(b"\x01batch"),
    ]


def control_events() -> list[Any]:
    from cpgbroker.cluster import codec

    member = 5 << 22 | 77
    return [
        codec.Hello(member, codec.STATUS_READY, 7, b"d" * 32, "amqp://a/", "cpgbroker x", 1, 2, 3),
        codec.Checkpoint(member, 100, b"c" * 32),
        codec.Progress(member, 100, 90),
        codec.UpdateRequest(member, member + 1, "127.0.0.1:40000", b"t" * 16),
        codec.ErrorCheck(member, 100, "apply-error: KeyError"),
        codec.StopRequest(member, 0),
    ]


def main() -> None:
    import cpgbroker
    from cpgbroker.cluster import codec
    from cpgbroker.store import records

    print("release", cpgbroker.__version__)
    for ev in model_events():
        name = type(ev).__name__
        cpg = "-"
        if name not in ("MemberLeft", "ClusterMembers", "Recovered"):
            cpg = codec.encode(ev).hex()
        print(name, cpg, records.encode(ev).hex(), records.encode(ev, True).hex())
    for ev in control_events():
        print(type(ev).__name__, codec.encode(ev).hex())
    print("HEADER", codec.HEADER.hex())


if __name__ == "__main__":
    sys.exit(main())

"""How long a digest checkpoint stalls a member, inline versus in a forked child; prints JSON.

    python bench/checkpoint_bench.py [--messages 100000 1000000] [--size 100]

Builds a model holding N queued messages (one queue, published through the model as clients
would), then times what the member's event loop is blocked for at a checkpoint: the whole
digest when done inline, only the fork when the digest runs in a child (the child's own time
is reported too: that is how long until the member's checkpoint vote goes out).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

from pamqp import body as pbody
from pamqp import commands, frame, header

from cpgbroker.model.broker import Broker
from cpgbroker.model.events import ClientConnected, ClientData
from cpgbroker.model.state import snapshot
from cpgbroker.runtime.update import transfer as update
from cpgbroker.wire.framer import PROTOCOL_HEADER


def build(n: int, size: int) -> Broker:
    b = Broker()
    b.apply(ClientConnected(1, 0, "127.0.0.1:1", True))
    setup = [
        PROTOCOL_HEADER,
        frame.marshal(commands.Connection.StartOk(response="\0guest\0guest"), 0),
        frame.marshal(commands.Connection.TuneOk(channel_max=8, frame_max=131072), 0),
        frame.marshal(commands.Connection.Open(), 0),
        frame.marshal(commands.Channel.Open(), 1),
        frame.marshal(commands.Queue.Declare(queue="q"), 1),
    ]
    for data in setup:
        b.apply(ClientData(1, data))
    body = b"x" * size
    one = (
        frame.marshal(commands.Basic.Publish(exchange="", routing_key="q"), 1)
        + frame.marshal(header.ContentHeader(0, size, commands.Basic.Properties()), 1)
        + frame.marshal(pbody.ContentBody(body), 1)
    )
    batch = 500
    for _ in range(n // batch):
        b.apply(ClientData(1, one * batch))
    return b


def _write(fd: int, data: bytes) -> None:
    os.write(fd, data)


def measure(n: int, size: int) -> dict[str, float]:
    b = build(n, size)
    assert len(b.vhosts["/"].queues["q"].messages) == n
    t0 = time.perf_counter()
    inline = snapshot.digest_bytes(b)
    inline_s = time.perf_counter() - t0
    r, w = os.pipe()
    t0 = time.perf_counter()
    pid = update.fork_child(lambda: _write(w, snapshot.digest_bytes(b)), "digest", keep=w)
    fork_s = time.perf_counter() - t0
    os.close(w)
    got = b""
    while len(got) < 32:
        got += os.read(r, 32 - len(got))
    child_s = time.perf_counter() - t0
    os.close(r)
    os.waitpid(pid, 0)
    assert got == inline, "the child digested a different state"
    return {
        "messages": n,
        "inline_digest_stall_s": round(inline_s, 4),
        "forked_stall_s": round(fork_s, 5),
        "forked_digest_ready_s": round(child_s, 4),
        "rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--size", type=int, default=100)
    a = ap.parse_args()
    print(json.dumps([measure(n, a.size) for n in a.messages], indent=2))


if __name__ == "__main__":
    main()

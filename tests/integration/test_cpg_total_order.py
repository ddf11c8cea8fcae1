"""Three processes, one per node namespace, deliver one identical stream in total order.

Each process runs this file as a script (``--worker``): it joins the group through the trio
adapter, multicasts its share of messages of mixed sizes (64 B to 2 MiB), receives every
member's messages, checks each one's integrity and that its own arrive in send order, and prints
a digest of the whole delivered stream. The test compares the three digests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import struct
import subprocess
import sys
import zlib
from typing import Any

import pytest

pytestmark = pytest.mark.integration

MESSAGES_PER_SENDER = 2000
SMALLEST = 64
LARGEST = 2 * 1024 * 1024
HEADER = struct.Struct("!IIII")  # sender index, sequence number, body length, crc32 of body


def message_sizes(sender: int, count: int) -> list[int]:
    """Mostly small messages, some medium, a few fragmented ones; the extremes always occur."""
    rng = random.Random(sender)
    sizes = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.89:
            size = rng.randint(SMALLEST, 4096)
        elif roll < 0.99:
            size = rng.randint(4096, 256 * 1024)
        else:
            size = rng.randint(256 * 1024, LARGEST)
        sizes.append(size)
    sizes[0], sizes[count // 2], sizes[-1] = SMALLEST, LARGEST, LARGEST // 2 + 1
    return sizes


def make_message(sender: int, seq: int, size: int, block: bytes) -> bytes:
    start = (seq * 7919) % (len(block) - size + 1) if size < len(block) else 0
    body = block[start : start + size - HEADER.size]
    return HEADER.pack(sender, seq, len(body), zlib.crc32(body)) + body


async def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    import trio

    from cpgbroker.corosync.cpg import tune_malloc
    from cpgbroker.corosync.events import ConfChg, Deliver
    from cpgbroker.runtime.ring.cpg_trio import open_cpg

    tune_malloc()
    block = random.Random(1000 + args.index).randbytes(LARGEST)
    sizes = message_sizes(args.index, args.count)
    errors: list[str] = []
    digest = hashlib.sha256()
    delivered = 0
    own_next = 0
    async with open_cpg(args.group, window=64, window_bytes=16 << 20) as cpg:
        with trio.fail_after(args.timeout):
            while True:
                ev = await cpg.receive()
                if isinstance(ev, ConfChg) and len(ev.members) == args.members:
                    break

            async def send_all() -> None:
                for seq, size in enumerate(sizes):
                    await cpg.send(make_message(args.index, seq, size, block))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all)
                while delivered < args.count * args.members:
                    for ev in await cpg.receive_batch():
                        if not isinstance(ev, Deliver):
                            # A worker that is done may exit (PROCDOWN) while we still
                            # drain the tail of the batch; before that, nobody may leave.
                            done = delivered == args.count * args.members
                            if isinstance(ev, ConfChg) and ev.left and not done:
                                errors.append(f"member left during the run: {ev}")
                            continue
                        delivered += 1
                        data = ev.data
                        digest.update(struct.pack("!IIQ", ev.nodeid, ev.pid, len(data)))
                        digest.update(data)
                        sender, seq, length, crc = HEADER.unpack_from(data)
                        body = memoryview(data)[HEADER.size :]
                        if length != len(body) or zlib.crc32(body) != crc:
                            errors.append(f"corrupt message {sender}/{seq}")
                        if cpg.cpg.is_own(ev):
                            if sender != args.index or seq != own_next:
                                errors.append(f"own message {sender}/{seq}, expected {own_next}")
                            own_next = seq + 1
    return {
        "digest": digest.hexdigest(),
        "delivered": delivered,
        "own": own_next,
        "errors": errors[:10],
        "try_again": cpg.stats.try_again,
    }


def worker_main() -> None:
    import trio

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--group", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--members", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=90)
    args = parser.parse_args()
    print(json.dumps(trio.run(run_worker, args)))


def test_three_processes_deliver_identical_streams(cluster: Any) -> None:
    group = f"order-{cluster.prefix}"
    procs = []
    for node in (1, 2, 3):
        argv = [sys.executable, __file__, "--worker", "--group", group, "--index", str(node)]
        argv += ["--members", "3", "--count", str(MESSAGES_PER_SENDER)]
        procs.append(
            cluster.popen_in(node, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"worker failed: {err[-2000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for r in results:
        assert r["errors"] == []
        assert r["delivered"] == 3 * MESSAGES_PER_SENDER
        assert r["own"] == MESSAGES_PER_SENDER
    assert len({r["digest"] for r in results}) == 1, results


def test_message_mix_covers_the_range() -> None:
    sizes = message_sizes(1, MESSAGES_PER_SENDER)
    assert min(sizes) == SMALLEST and max(sizes) == LARGEST
    assert sum(s > 1024 * 1024 for s in sizes) >= 5  # fragmented by libcpg


if __name__ == "__main__":
    worker_main()

"""Server CPU per message of the amqps stream, without the broker: trio.SSLStream against
the runtime's TlsStream (send_all, and the direct ``send_nowait`` of ``Node.write``), and plain
TCP (trio.SocketStream) for reference.

A client process (blocking ``ssl`` socket) sends ``--window`` messages of ``--size`` bytes,
one write each, and reads the echo of all of them; the server echoes every read. Reported:
the server process's CPU microseconds per message (its user + system time), and msg/s.
``--profile`` prints the server's cProfile top functions instead.

    python bench/tls_stream_bench.py --size 1024 --window 8 --seconds 3
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import pstats
import socket
import ssl
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from cpgbroker.runtime.config.tls import TlsConfig, TlsStream, server_context


def make_certs(directory: Path) -> tuple[str, str]:
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    server.private_key_and_cert_chain_pem.write_to_path(str(directory / "server.pem"))
    return str(directory / "ca.pem"), str(directory / "server.pem")


def client(
    port: int, cafile: str, size: int, window: int, seconds: float, q: Any, tls: bool
) -> None:
    raw = socket.create_connection(("127.0.0.1", port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s: socket.socket = raw
    if tls:
        ctx = ssl.create_default_context(cafile=cafile)
        s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    msg = b"x" * size
    want = size * window
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(window):
            s.sendall(msg)
        got = 0
        while got < want:
            got += len(s.recv(want - got))
        n += window
    s.close()
    q.put(n)


async def serve(
    kind: str, ctx: ssl.SSLContext, args: argparse.Namespace, cafile: str
) -> dict[str, Any]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    q: Any = multiprocessing.get_context("fork").Queue()
    proc = multiprocessing.get_context("fork").Process(
        target=client,
        args=(port, cafile, args.size, args.window, args.seconds, q, kind != "plain TCP"),
    )
    proc.start()
    tcp = await listeners[0].accept()
    stream: Any
    if kind == "plain TCP":
        stream = tcp
    elif kind == "trio.SSLStream":
        stream = trio.SSLStream(tcp, ctx, server_side=True, https_compatible=False)
    else:
        stream = TlsStream(tcp, ctx)
    if kind != "plain TCP":
        await stream.do_handshake()
    prof = cProfile.Profile() if args.profile else None
    cpu0 = time.process_time()
    t0 = time.monotonic()
    if prof:
        prof.enable()
    try:
        while True:
            data = await stream.receive_some(256 * 1024)
            if not data:
                break
            if kind == "TlsStream.send_nowait" and not stream.unsent and stream.send_nowait(data):
                if stream.unsent:
                    await stream.send_all(b"")
            else:
                await stream.send_all(data)
    except trio.BrokenResourceError:
        pass
    if prof:
        prof.disable()
    cpu = time.process_time() - cpu0
    wall = time.monotonic() - t0
    n = q.get()
    proc.join()
    await stream.aclose()
    for lst in listeners:
        await lst.aclose()
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return {
        "msg_s": round(n / wall),
        "server_us_per_msg": round(cpu / n * 1e6, 2),
        "messages": n,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--kinds", default="plain TCP,trio.SSLStream,TlsStream.send_all,TlsStream.send_nowait"
    )
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="tls-stream-bench-"))
    cafile, certfile = make_certs(d)
    ctx = server_context(TlsConfig(certfile=certfile))
    out = {}
    for kind in args.kinds.split(","):
        out[kind] = trio.run(serve, kind, ctx, args, cafile)
        print(kind, out[kind], file=sys.stderr)
    print(json.dumps({"size": args.size, "window": args.window, **out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The admin endpoint's HTTP layer, h11's invariant: any bytes, whole or cut anywhere, end as
answered requests or a 400/413/431 and a closed connection, never an exception out of it."""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from cpgbroker.runtime.mgmt import http11

VALID = (
    b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /stop HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
    b"GET /api/queues/%2F HTTP/1.0\r\n\r\n",
    b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
)


async def _serve(data: bytes, cuts: list[int]) -> bytes:
    async def handler(request: http11.Request) -> http11.Response:
        return http11.Response(200, b'{"ok": true}')

    client, server = trio.testing.memory_stream_pair()
    out = bytearray()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                await http11.serve_connection(server, handler, "fuzz")
                await server.aclose()

            nursery.start_soon(serve)
            start = 0
            for cut in [*sorted(c % (len(data) + 1) for c in cuts), len(data)]:
                if cut > start:
                    try:
                        await client.send_all(data[start:cut])
                    except trio.BrokenResourceError:
                        break
                    start = cut
            await client.send_eof()
            while chunk := await client.receive_some(65536):
                out += chunk
    return bytes(out)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(st.sampled_from(VALID), st.binary(max_size=80)),
        min_size=1,
        max_size=4,
    ),
    st.lists(st.integers(min_value=0, max_value=400), max_size=5),
)
def test_any_bytes_get_answers_or_a_refusal_never_an_exception(
    parts: list[bytes], cuts: list[int]
) -> None:
    data = b"".join(parts)
    out = trio.run(_serve, data, cuts)
    # Whatever came back is whole HTTP responses.
    assert out == b"" or out.startswith(b"HTTP/1.1 ")
    for status in out.split(b"HTTP/1.1 ")[1:]:
        assert status[:3] in (b"200", b"400", b"413", b"431"), out


def test_valid_requests_pipelined_are_each_answered() -> None:
    data = VALID[0] + VALID[1] + VALID[3]
    out = trio.run(_serve, data, [5, 40, 77])
    assert out.count(b"HTTP/1.1 200") == 3

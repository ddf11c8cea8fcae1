"""A member that does not serve turns clients away (``process.refuse``) with connection.close
320 and then lingers as a closed connection does: end of stream, and what the client still
sends is read and discarded until it closes (at most ``server.CLOSE_LINGER``), so the close is
not destroyed by a reset."""

from __future__ import annotations

import trio
from pamqp import body as pbody
from pamqp import commands, frame, header

from cpgbroker.runtime.amqp import server
from cpgbroker.runtime.process.process import refuse
from cpgbroker.wire.framer import PROTOCOL_HEADER

BODY = b"x" * 2000


def publishes(n: int) -> bytes:
    one = (
        frame.marshal(commands.Basic.Publish(exchange="", routing_key="q"), 1)
        + frame.marshal(header.ContentHeader(0, len(BODY), commands.Basic.Properties()), 1)
        + frame.marshal(pbody.ContentBody(BODY), 1)
    )
    return one * n


async def refused(client_closes: bool) -> tuple[bytes, float]:
    """What a client that writes on after its header reads, and how long refuse took."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    took = 0.0
    got = b""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                nonlocal took
                stream = await listener.accept()
                t0 = trio.current_time()
                await refuse(stream, "member is resynchronising")
                took = trio.current_time() - t0

            nursery.start_soon(serve)
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await client.send_all(PROTOCOL_HEADER + publishes(100))  # written before it reads
            while data := await client.receive_some(65536):  # until the member's end of stream
                got += data
            if client_closes:
                await client.aclose()
        await listener.aclose()
        if not client_closes:
            await client.aclose()
    return got, took


async def test_a_refused_client_writing_on_gets_its_close_and_no_reset() -> None:
    got, took = await refused(client_closes=True)
    assert b"member is resynchronising" in got
    assert took < server.CLOSE_LINGER, "the member closes as soon as the client has"


async def test_a_refused_client_that_never_closes_is_dropped_after_the_linger() -> None:
    got, took = await refused(client_closes=False)
    assert b"member is resynchronising" in got
    assert server.CLOSE_LINGER <= took < server.CLOSE_LINGER + 1


class _Quorum:
    quorate = True


class _StoppedMember:
    """What the process reads of a member a stop request stopped at event 7 (it still waits
    for its last confirms before it leaves)."""

    serving = True
    halted = 7

    def stop_text(self) -> str:
        return "cluster shutdown"


async def test_a_client_arriving_while_a_stopped_member_lets_its_clients_go_is_turned_away() -> (
    None
):
    from cpgbroker.runtime.config.settings import ClusterConfig, ServerConfig
    from cpgbroker.runtime.process.process import MemberProcess

    config = ServerConfig(cluster=ClusterConfig(group="g", size=3))
    process = MemberProcess(config, _Quorum())  # type: ignore[arg-type]
    process.node = object()  # type: ignore[assignment]
    process.member = _StoppedMember()  # type: ignore[assignment]
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    got = b""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                await process.handle_client(await listener.accept())

            nursery.start_soon(serve)
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await client.send_all(PROTOCOL_HEADER)
            while data := await client.receive_some(65536):
                got += data
            await client.aclose()
    await listener.aclose()
    _n, _ch, close = frame.unmarshal(got[got.index(b"\x01\x00\x00") :])
    assert isinstance(close, commands.Connection.Close)
    assert close.reply_code == 320 and close.reply_text == "CONNECTION_FORCED - cluster shutdown"
    assert process.refused == 1

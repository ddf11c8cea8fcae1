"""The dead-lettered copy of a message: RabbitMQ's x-death bookkeeping in its content header.

Pure functions (no broker state): delivery decides *when* a message is dead-lettered and
where the copy goes (``delivery.py``); this module only says what the copy looks like.
"""

from __future__ import annotations

import datetime
from typing import Any

from cpgbroker.model.entities import Message, Queue


def dead_letter_header(msg: Message, q: Queue, reason: str, now_ms: int) -> bytes:
    """The content header of a dead-lettered copy: x-death added or counted up (RabbitMQ's
    format), expiration removed (kept as original-expiration). The only place we re-encode a
    client's properties; rare, so pamqp does it."""
    from pamqp import header as pheader

    ch = pheader.ContentHeader()
    ch.unmarshal(msg.header)
    props = ch.properties
    headers: dict[str, Any] = dict(props.headers or {})
    deaths: list[Any] = list(headers.get("x-death") or [])
    # Cluster time, not the wall clock: every replica writes the same header.
    when = datetime.datetime.fromtimestamp(now_ms // 1000, tz=datetime.UTC)
    for i, d in enumerate(deaths):
        if isinstance(d, dict) and d.get("queue") == q.name and d.get("reason") == reason:
            d = dict(d)
            d["count"] = int(d.get("count", 0)) + 1
            d["time"] = when
            deaths.pop(i)
            deaths.insert(0, d)
            break
    else:
        deaths.insert(
            0,
            {
                "count": 1,
                "reason": reason,
                "queue": q.name,
                "time": when,
                "exchange": msg.exchange,
                "routing-keys": [msg.routing_key],
            },
        )
    headers["x-death"] = deaths
    if "x-first-death-reason" not in headers:
        headers["x-first-death-reason"] = reason
        headers["x-first-death-queue"] = q.name
        headers["x-first-death-exchange"] = msg.exchange
    if props.expiration is not None:
        # RabbitMQ keeps it in the x-death entry just added, not as a top-level header.
        if "original-expiration" not in deaths[0]:
            deaths[0]["original-expiration"] = props.expiration
        props.expiration = None
    props.headers = headers
    return bytes(ch.marshal())


def is_cycle(header: bytes, target: str) -> bool:
    """RabbitMQ's cycle rule (``rabbit_dead_letter``): a dead-lettered message whose x-death
    (newest first) names ``target`` already, with no death by rejection on the way there, is
    going round in circles and is dropped instead of enqueued. Without it, two full queues that
    dead-letter into each other would hand messages back and forth for ever within one event.
    """
    from pamqp import header as pheader

    ch = pheader.ContentHeader()
    ch.unmarshal(header)
    deaths = (ch.properties.headers or {}).get("x-death")
    for d in deaths if isinstance(deaths, list) else ():
        if not isinstance(d, dict) or d.get("reason") == "rejected":
            return False
        if d.get("queue") == target:
            return True
    return False

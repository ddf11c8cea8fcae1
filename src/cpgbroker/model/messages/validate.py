"""Checks of a published message's properties that go beyond their encoding.

The wire layer (``wire/fastpath.py``, ``wire/tables.py``) guarantees that a content header it
accepts decodes and re-encodes through pamqp. What remains is what the broker itself later
reads from a stored message without its publisher in sight: dead-lettering counts up the
``count`` of the matching ``x-death`` entry (``deadletter.py``). A publisher's own ``x-death``
header that this could not handle is refused when it is published (406 PRECONDITION_FAILED on
its channel) instead of failing when the message expires, is rejected or overflows, which would
hurt another client or lose the message.
"""

from __future__ import annotations

from pamqp import decode

_X_DEATH = b"\x07x-death"


def dead_letter_problem(header: bytes, span: tuple[int, int]) -> str | None:
    """Why the headers table at ``header[span]`` (already checked by ``check_table``) could not
    be dead-lettered, or None. Only a header that names ``x-death`` is decoded."""
    start, end = span
    if _X_DEATH not in header[start:end]:
        return None
    deaths = decode.field_table(header[start:end])[1].get("x-death")
    # deadletter.py reads list(x-death or []): a false value or any iterable is fine.
    if deaths and not isinstance(deaths, list | str | bytearray | dict):
        return f"x-death header must be an array, not {type(deaths).__name__}"
    if isinstance(deaths, list):
        for d in deaths:
            if isinstance(d, dict) and not isinstance(d.get("count", 0), int):
                return "x-death entry with a count that is not an integer"
    return None

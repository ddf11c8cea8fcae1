"""What the process wing builds for one incarnation of a member and hands to it.

The member (``runtime/member/member.py``) coordinates these parts; it builds none of them. The
process wing's builder (``runtime/process/assembly.py``) builds them in order, each on the ones
before, and hands them in as one :class:`Parts`. The other wings' parts (the replication mode,
the clients' side with its confirm gate, the admin desk, the federation links, both sides of a
state update) read the member only through the parts they are given: the stream, whether the
member serves, where a stop request stopped it. Only the replication mode's lease calls back
into the member itself, which is why :meth:`Replication.attach
<cpgbroker.runtime.replication.modes.Replication.attach>` runs once the member exists.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from cpgbroker.runtime.admin.admindesk import AdminDesk
from cpgbroker.runtime.amqp.confirms import ConfirmGate
from cpgbroker.runtime.amqp.server import AmqpServer
from cpgbroker.runtime.member.eventlog import EventLog
from cpgbroker.runtime.member.stops import Stops
from cpgbroker.runtime.member.stream import Service, Stream
from cpgbroker.runtime.replication.modes import Replication
from cpgbroker.runtime.replication.standby import HotStandby
from cpgbroker.runtime.ring.multicast import Multicaster
from cpgbroker.runtime.update.giving import Updater
from cpgbroker.runtime.update.taking import Newcomer


class Links(Protocol):
    """What the member asks of the federation links it runs (``runtime/federation/links.py``):
    the member never builds them, so it does not import them."""

    def applied(self) -> None:
        """The stream moved on: links may start, stop, or send what the view now holds."""
        ...

    async def run(self) -> None: ...

    def status(self) -> list[dict[str, Any]]: ...


@attrs.frozen
class Parts:
    """One incarnation's parts, built by the process wing."""

    # The broker the stream is applied to, and how far every member stands.
    stream: Stream
    # Whether the member serves (ready, suspended, failing).
    service: Service
    # Submit, direct sends, batching, the sender task, the lag wait.
    multicast: Multicaster
    # The event log and injected faults.
    eventlog: EventLog
    # Stop requests.
    stops: Stops
    # Hot standby: who takes clients (None: active-active, every member does).
    standby: HotStandby | None
    # How this member's clients' changes reach the others.
    replication: Replication
    # Local output held until its confirm is stable.
    confirms: ConfirmGate
    # The clients' side.
    io: AmqpServer
    # Operators' changes.
    desk: AdminDesk
    # The federation links this member runs.
    federation: Links
    # Taking a state update (a newcomer), and giving them.
    newcomer: Newcomer
    updater: Updater

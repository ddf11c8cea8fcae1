"""Model versions: which behaviour a cluster's members agree to replay the stream with.

Theory of operation
-------------------
Every member replays one ordered stream into its own broker; replicas stay equal only while they
all apply each event the same way. A release that changes what the model decides (a reply, a
header it writes, what a snapshot holds) therefore adds a *model version* instead of changing the
behaviour outright, and keeps the old behaviour for the versions before it, as a feature flag
that every member turns on at the same event:

* This software can apply the model versions ``OLDEST`` to ``NEWEST``. ``OLDEST`` is the model
  of the oldest release it upgrades from (``tests/upgrade/releases.toml``).
* A cluster runs at one *effective* version (:class:`ModelVersion`), part of the replicated
  state: it travels in snapshots, state updates and the store, and a member that joins takes
  the cluster's. A newcomer whose range does not hold it is refused (cluster/membership.py).
* The effective version only moves up, through one event of the stream (the operator's
  ``cpgbroker cluster upgrade-finish``, an ``AdminCommand``), applied where every member
  supports the new version: every replica switches at the same event, and a member that could
  not (an older release) is refused before the event is applied anywhere.
* Code gated by a version asks ``version.at_least(FEATURE)``, where ``FEATURE`` is the version
  that introduced the behaviour (the constants below). At an older effective version the new
  code is, bit for bit, the old broker: same replies, same digests, same snapshot bytes.
"""

from __future__ import annotations

# Release 0.1.0 (commit 321146f) ran model version 7, the first model that has releases.
OLDEST = 7
NEWEST = 8

# The behaviour each version introduced, named for what it changes (docs/operations.md,
# "Upgrading", lists them for operators).
VERSION_CHANGES: dict[int, str] = {
    7: "release 0.1.0's model",
    8: "message headers are carried byte for byte: every value the AMQP grammar allows is "
    "accepted at publish, and dead-lettering, federation and the management API's publish keep "
    "or write values with RabbitMQ's types; consumer timeouts ([limits] consumer_timeout, a "
    "queue's x-consumer-timeout) close a channel whose oldest delivery waits too long for its "
    "ack; virtual host names of up to 255 bytes; headers exchanges match as RabbitMQ 3.10.8 "
    "(headers and binding tables read with our codec)",
}
# Model version 8: field tables kept byte for byte (wire/fieldtable.py).
EXACT_FIELD_TABLES = 8
# Model version 8: consumer timeouts (model/messages/consumertimeout.py).
CONSUMER_TIMEOUTS = 8
# Model version 8: virtual host names of up to 255 bytes in connection.open (7 refused more
# than 127 characters, pamqp's limit, with 502).
LONG_VHOST_NAMES = 8


def supports(version: int) -> bool:
    """Whether this software can apply the stream at model version ``version``."""
    return OLDEST <= version <= NEWEST


class ModelVersion:
    """The cluster's effective model version, owned by the broker and read by the components
    whose behaviour it gates (as they all read the one :class:`~cpgbroker.model.output.Clock`).
    Only the version-switch event writes it."""

    __slots__ = ("current",)

    def __init__(self, current: int = NEWEST) -> None:
        if not supports(current):
            raise ValueError(f"model version {current} is outside {OLDEST}..{NEWEST}")
        self.current = current

    def adopt(self, version: int) -> None:
        """The cluster runs ``version`` from now on (an operator's upgrade-finish, checked by
        model/operators/admin.py; the primary's, from a change batch's definitions:
        model/standby/replica.py)."""
        self.current = version

    def at_least(self, version: int) -> bool:
        return self.current >= version

    def __eq__(self, other: object) -> bool:
        # Replicas (and a restored state against its original) compare by the version.
        return isinstance(other, ModelVersion) and other.current == self.current

    __hash__ = None  # type: ignore[assignment]  # mutable: compared, never a key

    def __repr__(self) -> str:
        return f"ModelVersion({self.current})"

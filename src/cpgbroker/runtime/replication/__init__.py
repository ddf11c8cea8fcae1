"""The hot-standby modes: how a primary serves and its backups follow.

* ``standby``: :class:`HotStandby`, in hot-standby mode whether this member takes clients
  (:func:`~.standby.primary_of`).
* ``shipping``: :class:`Shipping`, hot standby shipping changes (``replication = "changes"``):
  the primary's serving broker and its batches.

Active-active and hot standby ``"bytes"`` replicate by replaying clients' bytes in the member
itself. The member builds and calls these; they use the clients' side (``runtime.amqp``), the
admin desk and the state update's giving side, and never the member.
"""

from cpgbroker.runtime.replication.shipping import Shipping
from cpgbroker.runtime.replication.standby import HotStandby, primary_of

__all__ = ["HotStandby", "Shipping", "primary_of"]

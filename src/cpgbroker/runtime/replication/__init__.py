"""The replication modes: how this member's clients' changes reach the other members.

* ``modes``: the :class:`~.modes.Replication` seam the member calls wherever the modes differ:
  :class:`~.modes.ReplayingBytes` (active-active, and hot standby ``replication = "bytes"``) and
  :class:`~.modes.ShippingChanges` (hot standby ``replication = "changes"``).
* ``standby``: :class:`HotStandby`, in hot-standby mode whether this member takes clients
  (:func:`~.standby.primary_of`).
* ``shipping``: :class:`Shipping`, hot standby shipping changes (``replication = "changes"``):
  the primary's serving broker and its batches.

The process wing's builder (``runtime/process/assembly.py``) builds these and the member
calls them; they use the clients' side (``runtime.amqp``), the admin
desk and the state update's giving side, and never the member.
"""

from cpgbroker.runtime.replication.modes import ReplayingBytes, Replication, ShippingChanges
from cpgbroker.runtime.replication.shipping import Shipping
from cpgbroker.runtime.replication.standby import HotStandby, primary_of

__all__ = [
    "HotStandby",
    "ReplayingBytes",
    "Replication",
    "Shipping",
    "ShippingChanges",
    "primary_of",
]

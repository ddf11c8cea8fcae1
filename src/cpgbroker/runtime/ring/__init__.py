"""The ring: corosync's CPG and votequorum under trio, and what the member sends through them.

* ``cpg_trio``: :class:`~.cpg_trio.TrioCpg`, libcpg's handle under trio (dispatch when its fd is
  readable, sends that never block the event loop, a hung corosync noticed).
* ``quorum_trio``: :class:`~.quorum_trio.TrioQuorum`, votequorum's verdicts under trio.
* ``ringgate``: :class:`~.ringgate.RingGate`, whether the ring this member is on may serve
  (quorum), and what waits for a verdict.
* ``multicast``: :class:`~.multicast.Multicaster`, submitting events to CPG in batches, with the
  cluster's flow control and the member's control messages.

It offers the member and the process wing the ring; it imports nothing else of the runtime
(only corosync's wrappers, the pure cluster logic and the model's events).
"""

"""The cluster member: :class:`~.member.ClusterNode` (``member``), a coordinator that routes
each delivered CPG event to the components that own their state, and those components.

* ``member``: the deliver loop and event routing.
* ``applying``: :class:`~.applying.Applier`, applying an event routed to the model, then
  recording, reporting and digesting it.
* ``roster``: :class:`~.roster.Roster`, hellos, joins and leaves, partition merges, the kept
  state.
* ``parts``: :class:`~.parts.Parts`, what the process wing builds and hands the member.
* ``stream``: :class:`~.stream.Stream`, the broker the stream is applied to and how far every
  member stands, and :class:`~.stream.Service`, whether the member serves.
* ``status``: :class:`~.status.MemberStatus`, what the process wing reads of a member (one
  facade, instead of reaching through the member into its components).
* ``checkpoints``, ``errorcheck_rounds``, ``stops``, ``eventlog``, ``applytimes``, ``lease`` (the
  hot-standby primary's lease): the member's bookkeeping components.
* ``storelink``: :class:`~.storelink.StoreLink`, the store as the event loop sees it.
* ``watchdog``: the separate process that kills a member that stops making progress, and the
  :class:`~.watchdog.ApplyMark` the member shares with it.

It offers the process wing one incarnation of a member. It uses the ring (``runtime.ring``:
CPG and votequorum under trio), the clients' side (``runtime.amqp``), the replication modes, the
state update's both sides, the admin desk and the configuration; it runs the federation links it is
handed without importing them; nothing but the process wing imports it.

Nothing is re-exported here: ``python -m cpgbroker.runtime.member.watchdog`` starts the
watchdog by module name, and a package that imported ``member`` on the way would load the whole
member into that small process first.
"""

"""One broker process: ``cpgbroker start``, a member across its incarnations, systemd.

* ``main``: ``cpgbroker start`` (logging, the configuration, standalone or cluster member).
* ``process``: :class:`~.process.MemberProcess`, what outlives one CPG membership (listeners,
  the admin endpoint, the votequorum reader, the watchdog), and ``serve_member``.
* ``assembly``: :func:`~.assembly.assemble`, which builds one incarnation's parts (the other
  wings' among them: the replication mode, the clients' side, the admin desk, the federation
  links, both sides of a state update) and the member over them.
* ``standalone``: :class:`~.standalone.StandaloneStore`, a standalone broker's store
  (``[store]`` without ``[cluster]``): recovery at start, the journal, confirms that wait for it.
* ``sdnotify``: systemd's notify protocol and its watchdog.

The top wing, imported by no other: it builds each incarnation's member, the listeners of the
clients' side and the admin endpoint, and wires them together. The command line imports
``main``.

Nothing is re-exported here: ``main`` imports ``process`` only when it runs a cluster member,
so that a standalone broker never loads the member (with a store, only the member's store link).
"""

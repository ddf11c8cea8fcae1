"""Development tools: a real corosync cluster in Linux network namespaces on one machine, one
broker per node, their command line and their pytest fixtures. For tests, the demo and
benchmarks; a broker member never imports this package.

Modules, each importing only those listed after it:

* :mod:`~cpgbroker.dev.cli` -- ``cpgbroker devcluster ...``;
  :mod:`~cpgbroker.dev.fixtures` -- the pytest plugin (``dev_cluster``, ``cluster``,
  ``brokers``, ...);
* :mod:`~cpgbroker.dev.rabbitnodes` -- a 3-node RabbitMQ cluster on a dev cluster's nodes
  and the fault loop against a quorum queue on it, to compare with ours in one sitting;
* :mod:`~cpgbroker.dev.faultloop` -- a fault loop under confirmed, acked load (lost,
  duplicated, unflagged redeliveries, longest waits), for tests and benchmarks;
* :mod:`~cpgbroker.dev.brokers` -- :class:`BrokerSet`, one broker per node;
* :mod:`~cpgbroker.dev.cluster` -- :class:`DevCluster`, one corosync per node;
* :mod:`~cpgbroker.dev.corosynctools` -- corosync's config, quorum tool output and leftovers;
* :mod:`~cpgbroker.dev.netns` -- namespaces, links, partition and heal, ``/proc``.
"""

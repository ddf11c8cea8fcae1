"""The runtime: trio, sockets, CPG and the store around the pure model, in wings named for their
jobs (docs/architecture.md, "The runtime's wings"). From the bottom up, each importing only
wings below it:

* ``config``: ``cpgbroker.toml`` and its ``[tls]`` section.
* ``ring``: CPG and votequorum under trio, the ring gate, the multicaster.
* ``mgmt``: the management API, metrics, the dashboard, HTTP serving.
* ``admin``: the admin endpoint, its secret, the admin desk, the command line's client.
* ``update``: the state update's giving and taking sides and the transfer.
* ``amqp``: the clients' side: listeners, readers and writers, the confirm gate.
* ``federation``: links to other clusters and their AMQP client.
* ``replication``: the hot-standby modes (standby, shipping changes).
* ``member``: the cluster member, a coordinator of components.
* ``process``: one broker process across incarnations; the only wing that builds the others.

Only the command line, the deployment files' writer and the dev tools import the runtime.
"""

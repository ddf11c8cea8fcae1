"""The clients' side: TCP listeners, one reader and one writer task per client, the ticker, the
confirm gate and member-local clients.

* ``server``: :class:`AmqpServer` (listeners and each client's reader and writer), the
  sequencer it is given (a member's multicaster or, standalone,
  :class:`~.server.LocalSequencer`), the ticker.
* ``confirms``: :class:`ConfirmGate`, local clients' output held until its event is stable.
* ``localbroker``: :class:`LocalBroker`, member-local listeners served by a standalone broker.

It offers the member, the replication modes and the process an :class:`AmqpServer` that reads
clients and writes what the model answers. It knows nothing of the member: it is given a sequencer
and a confirm gate. It uses the configuration (``runtime.config``) and the admin desk
(``runtime.admin.admindesk``) that operators' changes wait on.
"""

from cpgbroker.runtime.amqp.confirms import ConfirmGate
from cpgbroker.runtime.amqp.localbroker import LocalBroker
from cpgbroker.runtime.amqp.server import AmqpServer, LocalSequencer

__all__ = ["AmqpServer", "ConfirmGate", "LocalBroker", "LocalSequencer"]

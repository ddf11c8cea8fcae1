"""Federation: links to other clusters, and the AMQP client they speak.

* ``federation``: :class:`FederationLinks`, this member's share of the cluster's links to
  upstream clusters; what a link consumes enters the cluster as ``Forward`` events.
* ``amqpclient``: :class:`AmqpClient`, an AMQP 0-9-1 client over trio, over ``amqpproto``: its
  sans-IO :class:`~.amqpproto.ClientProtocol`.

The member builds the links and hands them what they need; federation never imports the
member nor the clients' side. It uses the admin desk, the configuration's TLS and the model.
"""

from cpgbroker.runtime.federation.amqpclient import AmqpClient
from cpgbroker.runtime.federation.federation import FederationLinks

__all__ = ["AmqpClient", "FederationLinks"]

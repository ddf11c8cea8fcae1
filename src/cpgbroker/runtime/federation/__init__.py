"""Federation: links to other clusters, and the AMQP client they speak.

* ``links``: :class:`FederationLinks`, this member's share of the cluster's links to
  upstream clusters; what a link consumes enters the cluster as ``Forward`` events.
* ``client``: :class:`AmqpClient`, an AMQP 0-9-1 client over trio, over ``protocol``: its
  sans-IO :class:`~.protocol.ClientProtocol`.

The process wing's builder builds the links and hands them to the member, which runs them;
federation never imports the member nor the clients' side. It uses the admin desk, the
configuration's TLS and the model.
"""

from cpgbroker.runtime.federation.client import AmqpClient
from cpgbroker.runtime.federation.links import FederationLinks

__all__ = ["AmqpClient", "FederationLinks"]

"""The configuration: ``cpgbroker.toml`` read into settings, and its ``[tls]`` section.

* ``settings``: :func:`load` gives a :class:`ServerConfig` (the model's settings plus this
  process's own: listeners, logging, cluster membership).
* ``sections``: a section of the file read into its attrs class (cattrs): each key a field.
* ``definitions``: ``[[users]]``, ``[[policies]]`` and ``[federation]``, read so, then made
  the model's records (``User``, ``Policy``, ``Upstream``) and checked against the vhosts.
* ``digest``: ``config_digest``, what members compare when one joins (``cluster_wide`` fields).
* ``tls``: :class:`~.tls.TlsConfig`, the amqps server context and the user a client
  certificate names.

A bottom wing of the runtime (beside mgmt and ring): it imports no other wing, and every wing
that reads the configuration (the clients' side, federation, the state update, the admin plane,
the member, the process, and the deployment files' writer outside the runtime) imports it.
"""

from cpgbroker.runtime.config.settings import ClusterConfig, ServerConfig, load
from cpgbroker.runtime.config.tls import TlsConfig

__all__ = ["ClusterConfig", "ServerConfig", "TlsConfig", "load"]

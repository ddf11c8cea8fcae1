"""What RabbitMQ users read and write over HTTP: the management API, metrics and the dashboard.

* ``reads``: the management API's read side (``GET /api/...``) answered from the replica;
  ``views``: its JSON shapes, who sees what, the cluster view; ``writes``: its write side,
  requests turned into the model's admin commands.
* ``metrics``: Prometheus, a collector that reads the replica at scrape time.
* ``dashboard``: the web dashboard's static files (``static/``).
* ``http11``: HTTP/1.1 over h11 on a trio stream.

It offers the admin endpoint (``runtime.admin.endpoint``) the handlers it routes to. It imports no
other wing of the runtime: it reads the model's replica and answers with data.
"""

from cpgbroker.runtime.mgmt.reads import ManagementApi
from cpgbroker.runtime.mgmt.views import ClusterView, Identity, MemberView

__all__ = ["ClusterView", "Identity", "ManagementApi", "MemberView"]

"""The admin plane: the admin endpoint, its secret, operators' changes in flight and the
command line's client.

* ``endpoint``: the admin endpoint's routes and logins (status, the management API, metrics,
  the dashboard), served over ``runtime.mgmt.http11``.
* ``secret``: the admin secret file (generated at first start, mode 0600).
* ``admindesk``: :class:`~.admindesk.AdminDesk`, a member's admin commands in flight, answered
  once stable.
* ``adminclient``: the endpoint's client side, for the command line and the dev tools.
* ``ctl``: ``cpgbroker ctl``, rabbitmqctl's commands over the management API.

It offers the process the endpoint; the member, the clients' side, federation and hot standby
the admin desk; the command line and the dev tools its client. It uses the management wing and
the configuration, never the member (the process hands the endpoint what it reads).

Nothing is re-exported here: the command line imports ``adminclient`` and ``ctl`` alone, and a
package that imported the endpoint on the way would load HTTP serving, trio and the
management API for a ``cpgbroker status``.
"""

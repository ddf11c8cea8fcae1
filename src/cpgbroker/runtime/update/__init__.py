"""The state update: a newcomer gets the model's whole state from a member that serves.

* ``giving``: the giving side, :class:`Updater` (the member named by an update request forks a
  child that streams the model as it was at the request's point).
* ``taking``: the taking side, :class:`Newcomer` (asks, receives, installs the state).
* ``transfer``: the transfer itself over a side TCP connection (fork, frames, progress,
  receive), used by both sides.

The process wing's builder builds both sides and the member drives them (the process keeps the
giving side's children across incarnations; hot standby's shipping uses the giving side too); the
wing uses only the
configuration (``runtime.config``) and the pure packages.
"""

from cpgbroker.runtime.update.giving import Updater
from cpgbroker.runtime.update.taking import Newcomer

__all__ = ["Newcomer", "Updater"]

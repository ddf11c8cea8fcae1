"""Typed wrapper over corosync's cmap library, read-only: the running corosync's ring
security, so that a member can refuse to multicast client bytes (PLAIN passwords included) over
a ring anyone on the network can read or join; and its totem timeouts (:func:`totem_timeouts`:
how long the others take to declare a silent member lost).

:func:`ring_security` connects to the local corosync (in a network namespace for a dev
cluster), reads ``totem.crypto_cipher``, ``totem.crypto_hash`` and the nodelist's addresses,
and disconnects. Failures raise the CPG binding's exception classes
(:func:`cpgbroker.corosync.errors.make_error`).
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Iterator
from typing import Final

import attrs

from cpgbroker.corosync.cpg import enter_netns
from cpgbroker.corosync.errors import CpgBindingError, make_error

try:
    from cpgbroker.corosync._cmap import ffi, lib
except ImportError as _e:  # pragma: no cover - depends on how the package was installed
    raise CpgBindingError(
        "cpgbroker's compiled libcmap binding (cpgbroker.corosync._cmap) cannot be imported "
        f"({_e}). Install the package with `pip install -e .`, which builds it; that needs gcc "
        "and the Debian package libcmap-dev."
    ) from _e

# Must match CMB_BINDING_VERSION in cffi_build/cmap_binding.c.
EXPECTED_BINDING_VERSION: Final = 2
if lib.CMB_BINDING_VERSION != EXPECTED_BINDING_VERSION:  # pragma: no cover
    raise CpgBindingError(
        f"cpgbroker.corosync._cmap is binding version {lib.CMB_BINDING_VERSION}, cmap.py "
        f"expects {EXPECTED_BINDING_VERSION}: rebuild it with `pip install -e .`"
    )

# corosync accepts at most this many nodes in a nodelist, and 8 links (ring0..ring7) per node.
MAX_NODES: Final = 384
MAX_LINKS: Final = 8


@attrs.frozen
class RingSecurity:
    cipher: str  # totem.crypto_cipher: "none" when unset
    hash: str  # totem.crypto_hash: "none" when unset
    addresses: tuple[str, ...]  # every ringN_addr of the nodelist (or the interface's bindnetaddr)

    @property
    def encrypted(self) -> bool:
        # knet encrypts only with both: a cipher needs a hash (corosync refuses one alone).
        return self.cipher != "none" and self.hash != "none"

    @property
    def loopback_only(self) -> bool:
        """Whether every address the ring uses is a loopback address: then no other machine
        sees its traffic. A host name counts as not loopback (only ``localhost`` does)."""
        if not self.addresses:
            return False
        for a in self.addresses:
            if a == "localhost":
                continue
            try:
                if not ipaddress.ip_address(a.split("%")[0]).is_loopback:
                    return False
            except ValueError:
                return False
        return True


def _found(rc: int, call: str, key: str) -> bool:
    """Whether a cmap read found ``key``; any other failure raises."""
    if rc == lib.CS_ERR_NOT_EXIST:
        return False
    if rc != lib.CS_OK:
        raise make_error(rc, call, key)
    return True


def _get(handle: int, key: str) -> str | None:
    out = ffi.new("char **")
    if not _found(lib.cmap_get_string(handle, key.encode(), out), "cmap_get_string", key):
        return None
    try:
        return str(ffi.string(out[0]).decode(errors="replace"))
    finally:
        lib.cmb_free(out[0])


@contextlib.contextmanager
def _connected(netns: str | None) -> Iterator[int]:
    """A cmap handle to the local corosync (in ``netns``), finalized on the way out."""
    with enter_netns(netns):
        h = ffi.new("cmap_handle_t *")
        rc = lib.cmap_initialize(h)
        if rc != lib.CS_OK:
            raise make_error(rc, "cmap_initialize")
    handle = h[0]
    try:
        yield int(handle)
    finally:
        lib.cmap_finalize(handle)


def ring_security(netns: str | None = None) -> RingSecurity:
    with _connected(netns) as handle:
        cipher = (_get(handle, "totem.crypto_cipher") or "none").lower()
        hash_ = (_get(handle, "totem.crypto_hash") or "none").lower()
        addresses: list[str] = []
        for i in range(MAX_NODES):
            first = _get(handle, f"nodelist.node.{i}.ring0_addr")
            if first is None:
                break
            addresses.append(first)
            for link in range(1, MAX_LINKS):
                more = _get(handle, f"nodelist.node.{i}.ring{link}_addr")
                if more is not None:
                    addresses.append(more)
        if not addresses:
            # No nodelist: udp multicast configured by interface.
            bind = _get(handle, "totem.interface.0.bindnetaddr")
            if bind is not None:
                addresses.append(bind)
        return RingSecurity(cipher, hash_, tuple(addresses))


@attrs.frozen
class TotemTimeouts:
    token_ms: int  # runtime.config.totem.token: the token timeout in effect
    consensus_ms: int  # runtime.config.totem.consensus


# corosync's own defaults (corosync.conf(5)), should the runtime keys be missing.
DEFAULT_TOKEN_MS: Final = 3000


def _get_u32(handle: int, key: str) -> int | None:
    out = ffi.new("uint32_t *")
    if not _found(lib.cmap_get_uint32(handle, key.encode(), out), "cmap_get_uint32", key):
        return None
    return int(out[0])


def totem_timeouts(netns: str | None = None) -> TotemTimeouts:
    """The token and consensus timeouts the running corosync uses (the ``runtime.config``
    keys: what it computed from corosync.conf, token_coefficient included). A member that
    stops answering is declared lost by the others no sooner than the token timeout after the
    last token it passed, plus the consensus timeout to agree on the new ring."""
    with _connected(netns) as handle:
        token = _get_u32(handle, "runtime.config.totem.token") or DEFAULT_TOKEN_MS
        # corosync computes 1.2 x token when consensus is not configured.
        consensus = _get_u32(handle, "runtime.config.totem.consensus") or token * 6 // 5
        return TotemTimeouts(token, consensus)

"""Password checks (pure): plain passwords, or salted hashes in RabbitMQ's format.

A hash is what ``rabbitmqctl export_definitions`` writes as ``password_hash``: base64 of a
4-byte salt followed by ``H(salt + password)``, with ``H`` named by ``hashing_algorithm``
(``rabbit_password_hashing_sha256``, RabbitMQ's default, ``_sha512`` or ``_md5``). So a user
can be carried over from RabbitMQ, and the configuration need not hold the secret.
``cpgbroker hash-password`` makes one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from cpgbroker.model.config import User

ALGORITHMS = {
    "rabbit_password_hashing_sha256": hashlib.sha256,
    "rabbit_password_hashing_sha512": hashlib.sha512,
    "rabbit_password_hashing_md5": hashlib.md5,
}
DEFAULT_ALGORITHM = "rabbit_password_hashing_sha256"
SALT_BYTES = 4


def hash_password(password: str, salt: bytes, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The ``password_hash`` of ``password`` with ``salt`` (4 bytes: the caller draws them)."""
    h = ALGORITHMS[algorithm]
    return base64.b64encode(salt + h(salt + password.encode()).digest()).decode()


def valid_hash(password_hash: str, algorithm: str) -> bool:
    if algorithm not in ALGORITHMS:
        return False
    try:
        raw = base64.b64decode(password_hash, validate=True)
    except (binascii.Error, ValueError):
        return False
    return len(raw) == SALT_BYTES + ALGORITHMS[algorithm]().digest_size


def password_ok(user: User, password: str) -> bool:
    """Whether ``password`` is ``user``'s (compared in constant time). A blank password never
    is, as in RabbitMQ: neither one a client sends nor a user without any (``password_hash =
    ""``: certificate (EXTERNAL) logins only)."""
    if not password or not (user.password or user.password_hash):
        return False
    if not user.password_hash:
        return hmac.compare_digest(user.password.encode(), password.encode())
    raw = base64.b64decode(user.password_hash)
    salt, digest = raw[:SALT_BYTES], raw[SALT_BYTES:]
    h = ALGORITHMS[user.hashing_algorithm]
    return hmac.compare_digest(h(salt + password.encode()).digest(), digest)

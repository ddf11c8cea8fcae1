"""The one exception root of cpgbroker and the AMQP 0-9-1 reply codes.

Every exception the project raises derives from :class:`CpgBrokerError`, so a caller can catch
the whole family in one place. Client misbehaviour never escapes the model as an exception: it
becomes a channel or connection close carrying one of the :class:`ReplyCode` values.
"""

from __future__ import annotations

import enum


class ReplyCode(enum.IntEnum):
    """Reply codes of AMQP 0-9-1 (section 1.9 of the spec's XML, as RabbitMQ uses them)."""

    REPLY_SUCCESS = 200
    CONTENT_TOO_LARGE = 311
    NO_ROUTE = 312
    NO_CONSUMERS = 313
    CONNECTION_FORCED = 320
    INVALID_PATH = 402
    ACCESS_REFUSED = 403
    NOT_FOUND = 404
    RESOURCE_LOCKED = 405
    PRECONDITION_FAILED = 406
    FRAME_ERROR = 501
    SYNTAX_ERROR = 502
    COMMAND_INVALID = 503
    CHANNEL_ERROR = 504
    UNEXPECTED_FRAME = 505
    RESOURCE_ERROR = 506
    NOT_ALLOWED = 530
    NOT_IMPLEMENTED = 540
    INTERNAL_ERROR = 541


# Codes that the spec classes as channel exceptions; every other error code closes the connection.
CHANNEL_EXCEPTIONS = frozenset(
    {
        ReplyCode.CONTENT_TOO_LARGE,
        ReplyCode.NO_ROUTE,
        ReplyCode.NO_CONSUMERS,
        ReplyCode.ACCESS_REFUSED,
        ReplyCode.NOT_FOUND,
        ReplyCode.RESOURCE_LOCKED,
        ReplyCode.PRECONDITION_FAILED,
    }
)


class CpgBrokerError(Exception):
    """Root of every exception raised by cpgbroker."""


class ConfigError(CpgBrokerError):
    """The configuration file or a command-line option is invalid."""


class InvariantError(CpgBrokerError):
    """The model found its own state inconsistent: a bug. The member must stop, not diverge."""


class AMQPError(CpgBrokerError):
    """A protocol error caused by a client; converted to a close at exactly one boundary.

    ``channel`` is 0 for connection exceptions. ``class_id``/``method_id`` name the offending
    method when known, as connection.close and channel.close carry them.
    """

    def __init__(
        self,
        code: ReplyCode,
        text: str,
        *,
        channel: int = 0,
        class_id: int = 0,
        method_id: int = 0,
    ) -> None:
        super().__init__(f"{int(code)} {code.name} - {text}")
        self.code = code
        self.text = text
        self.channel = channel
        self.class_id = class_id
        self.method_id = method_id

    @property
    def reply_text(self) -> str:
        # RabbitMQ's style ("NOT_FOUND - no queue 'x' in vhost '/'"), which client suites match on.
        # A shortstr holds 255 *bytes*: cut by bytes (never mid-character), or encoding the
        # close would fail for a client-chosen non-ASCII name.
        text = f"{self.code.name} - {self.text}"
        return text.encode()[:255].decode(errors="ignore")


class ChannelError(AMQPError):
    """A channel exception: the channel is closed, the connection stays open."""


class ConnectionError_(AMQPError):
    """A connection exception: the whole connection is closed."""


class FrameError(ConnectionError_):
    """A frame that cannot be parsed or breaks frame_max: always closes the connection."""

    def __init__(self, text: str, code: ReplyCode = ReplyCode.FRAME_ERROR) -> None:
        super().__init__(code, text)


class CpgError(CpgBrokerError):
    """Errors from corosync's CPG library (the binding defines one subclass per cs_error_t)."""


class ClusterError(CpgBrokerError):
    """The cluster layer cannot continue consistently (partition merge, digest mismatch, ...)."""

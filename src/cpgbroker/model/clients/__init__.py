"""The AMQP protocol as clients speak it: connections (handshake, frames, closes) and channels."""

"""cpgbroker: an AMQP 0-9-1 broker that forms an active-active cluster on corosync CPG."""

__version__ = "0.1.0"

# Bumped whenever the model's replicated behaviour or snapshot format changes: every member of a
# cluster must run the same model version, and a newcomer of another version is refused.
MODEL_VERSION = 7

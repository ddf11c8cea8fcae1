"""The durable store of a member: journal, snapshots and metadata."""

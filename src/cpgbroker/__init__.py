"""cpgbroker: an AMQP 0-9-1 broker that forms an active-active cluster on corosync CPG."""

# The release (semantic versioning; CHANGELOG.md has a section per release). The model versions
# a release applies are in cpgbroker.model.versions; tests/upgrade/releases.toml lists the
# releases it upgrades from.
__version__ = "0.2.0"

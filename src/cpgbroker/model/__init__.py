"""The broker model: a deterministic, sans-IO AMQP 0-9-1 broker whose whole state is a function of
the ordered events it was given (docs/architecture.md, "The model's rooms" and "The sans-IO
boundary").

This module is the model's public API: what the runtime, the store, the cluster logic and the
command line may use of it. Everything else in ``cpgbroker.model`` is the model's own, and
import-linter's ``model-api`` contract (pyproject.toml) refuses an import of it from outside the
model. Tests may reach further.

Four of the model's modules are public as modules, because their users need most of what they
hold:

* ``events``: the events :meth:`Broker.apply` takes and the effects it returns (the model's
  vocabulary on the wire, in the journal and towards the clients' side);
* ``snapshot``: a model's snapshot, its digest, its parts for a state update, and a broker
  restored from them;
* ``entities``: the records the management API reads (queues, connections, channels);
* ``auth``: password hashes in RabbitMQ's format (the configuration, the command line).

The rest are names. ``Broker.apply`` is the one way to change a broker's state; a broker's
components are read (the management API, metrics, status), never written from outside.
"""

from cpgbroker.model import entities, events
from cpgbroker.model.access import auth
from cpgbroker.model.access.permissions import FIELDS as PERMISSION_FIELDS
from cpgbroker.model.access.permissions import TRUSTED, check_user
from cpgbroker.model.access.users import hashed as hashed_user
from cpgbroker.model.broker import Broker
from cpgbroker.model.changes import REPLICATE, ChangeLog
from cpgbroker.model.clients.connection import MECHANISMS, server_properties
from cpgbroker.model.config import (
    CLUSTER_WIDE,
    BrokerConfig,
    Permission,
    Policy,
    User,
    cluster_wide,
)
from cpgbroker.model.eventtypes import EVENT_TYPES, cpg_type, journal_type
from cpgbroker.model.federation import (
    RECEIVED_FROM,
    SERVER_ID_PROPERTY,
    UPSTREAM,
    Link,
    Upstream,
    upstream_from_value,
)
from cpgbroker.model.operators.admin import RAISE_MODEL_VERSION
from cpgbroker.model.operators.adminargs import json_value, properties_key
from cpgbroker.model.routing.exchange import Exchange
from cpgbroker.model.routing.policies import Policies
from cpgbroker.model.routing.policies import validate as validate_policy
from cpgbroker.model.routing.topology import PEER_EXCHANGE, VHost
from cpgbroker.model.shipping import Shipper, promote
from cpgbroker.model.state import snapshot
from cpgbroker.model.versions import (
    EXACT_FIELD_TABLES,
    NEWEST,
    OLDEST,
    VERSION_CHANGES,
    supports,
)

__all__ = [
    "CLUSTER_WIDE",
    "EVENT_TYPES",
    "EXACT_FIELD_TABLES",
    "MECHANISMS",
    "NEWEST",
    "OLDEST",
    "PEER_EXCHANGE",
    "PERMISSION_FIELDS",
    "RAISE_MODEL_VERSION",
    "RECEIVED_FROM",
    "REPLICATE",
    "SERVER_ID_PROPERTY",
    "TRUSTED",
    "UPSTREAM",
    "VERSION_CHANGES",
    "Broker",
    "BrokerConfig",
    "ChangeLog",
    "Exchange",
    "Link",
    "Permission",
    "Policies",
    "Policy",
    "Shipper",
    "Upstream",
    "User",
    "VHost",
    "auth",
    "check_user",
    "cluster_wide",
    "cpg_type",
    "entities",
    "events",
    "hashed_user",
    "journal_type",
    "json_value",
    "promote",
    "properties_key",
    "server_properties",
    "snapshot",
    "supports",
    "upstream_from_value",
    "validate_policy",
]

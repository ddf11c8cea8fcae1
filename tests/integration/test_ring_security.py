"""A member refuses a corosync ring other machines could read (client bytes and PLAIN
passwords cross it) unless the operator says the network is private; on an encrypted ring it
says so in its log."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster, new_test_prefix
from cpgbroker.dev.corosynctools import default_template

pytestmark = pytest.mark.integration


@pytest.fixture
def plaintext_cluster(cluster_support: None, tmp_path: Path) -> Iterator[DevCluster]:
    text = default_template().read_text()
    for encrypted, plain in (
        ("crypto_cipher: aes256", "crypto_cipher: none"),
        ("crypto_hash: sha256", "crypto_hash: none"),
    ):
        assert encrypted in text
        text = text.replace(encrypted, plain)
    template = tmp_path / "plaintext.conf.in"
    template.write_text(text)
    dc = DevCluster(
        1, prefix=new_test_prefix(), token_ms=1000, owner_pid=os.getpid(), template=template
    )
    dc.up()
    try:
        yield dc
    finally:
        dc.down()


def test_a_member_refuses_a_plaintext_ring_unless_told_the_network_is_private(
    plaintext_cluster: DevCluster,
) -> None:
    refused = BrokerSet(plaintext_cluster, name="refused", event_log=False)
    proc = refused.start(1)
    assert proc.wait(60) == 3
    log = refused.log_path(1).read_text()
    assert "the corosync ring is not encrypted (crypto_cipher none, crypto_hash none)" in log
    assert plaintext_cluster.node(1).address in log and "allow_plaintext_ring" in log
    assert "serving clients" not in log

    allowed = BrokerSet(
        plaintext_cluster,
        name="allowed",
        event_log=False,
        extra_config="allow_plaintext_ring = true\n",  # lands in [cluster]
    )
    try:
        allowed.start_all(timeout=60)
        log = allowed.log_path(1).read_text()
        assert "corosync ring NOT encrypted" in log and "allow_plaintext_ring" in log
    finally:
        allowed.stop_all()


def test_members_on_an_encrypted_ring_say_so(brokers: BrokerSet) -> None:
    for n in (1, 2, 3):
        assert (
            "corosync ring encrypted cipher=aes256 hash=sha256" in brokers.log_path(n).read_text()
        )

"""Publish with confirms and consume with manual acks against a cpgbroker cluster, failing over
to another member when the one in use goes away.

    python docs/examples/pika_failover.py amqp://127.0.0.1:5701/ amqp://127.0.0.1:5702/ ...

pika tries the parameters in order; on a lost connection we reconnect and carry on. The cluster
promises at-least-once delivery: a message whose ack was lost with a member is redelivered
(redelivered=True), so consumers should be idempotent.
"""

from __future__ import annotations

import sys
import time

import pika
import pika.exceptions

QUEUE = "failover-demo"


def connect(urls: list[str]) -> pika.BlockingConnection:
    params = [pika.URLParameters(u) for u in urls]
    for p in params:
        p.connection_attempts = 1
        p.socket_timeout = 2
    while True:
        try:
            return pika.BlockingConnection(params)
        except pika.exceptions.AMQPConnectionError:
            time.sleep(0.5)


def main(urls: list[str]) -> None:
    sent = 0
    while sent < 100:
        conn = connect(urls)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare(QUEUE, durable=True)
            while sent < 100:
                ch.basic_publish("", QUEUE, f"message {sent}".encode())  # returns once confirmed
                sent += 1
            conn.close()
        except pika.exceptions.AMQPError as e:
            print(f"publisher lost its member ({e!r}); failing over")
    seen: set[bytes] = set()
    while len(seen) < 100:
        conn = connect(urls)
        try:
            ch = conn.channel()
            ch.basic_qos(prefetch_count=10)
            for method, _props, body in ch.consume(QUEUE, inactivity_timeout=5):
                if method is None:
                    break
                seen.add(body)
                ch.basic_ack(method.delivery_tag)
                if len(seen) == 100:
                    break
            conn.close()
        except pika.exceptions.AMQPError as e:
            print(f"consumer lost its member ({e!r}); failing over")
    print(f"published {sent} (all confirmed) and consumed {len(seen)} distinct messages")


if __name__ == "__main__":
    main(sys.argv[1:] or ["amqp://guest:guest@127.0.0.1:5672/"])

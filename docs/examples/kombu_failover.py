"""kombu (and so celery) against a cpgbroker cluster: give every member's URL separated by ';'
and kombu fails over between them (``failover_strategy`` round-robin or shuffle).

    python docs/examples/kombu_failover.py 'amqp://127.0.0.1:5701//;amqp://127.0.0.1:5702//'

For celery: ``broker_url = "amqp://h1//;amqp://h2//;amqp://h3//"`` and
``broker_transport_options = {"confirm_publish": True}``.
"""

from __future__ import annotations

import sys

from kombu import Connection, Exchange, Queue

EXCHANGE = Exchange("kombu-demo", type="direct")
QUEUE = Queue("kombu-demo", EXCHANGE, routing_key="demo")


def main(url: str) -> None:
    with Connection(
        url, failover_strategy="round-robin", transport_options={"confirm_publish": True}
    ) as conn:
        producer = conn.Producer(serializer="json")
        publish = conn.ensure(producer, producer.publish, max_retries=10)
        for i in range(10):
            publish({"n": i}, exchange=EXCHANGE, routing_key="demo", declare=[QUEUE])
        got = []
        with conn.Consumer(QUEUE, callbacks=[lambda body, msg: (got.append(body), msg.ack())]):
            while len(got) < 10:
                conn.drain_events(timeout=5)
        print("connected to", conn.as_uri(), "received", [b["n"] for b in got])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "amqp://guest:guest@127.0.0.1:5672//")

"""Messages through queues to consumers: publish, deliver, ack, confirms, transactions, consumer
timeouts."""

"""Vhosts, exchanges, queues and bindings: what routes a message, what expires, where dead letters
go."""

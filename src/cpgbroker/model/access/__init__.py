"""Who may do what: users, password hashes in RabbitMQ's format, permissions."""

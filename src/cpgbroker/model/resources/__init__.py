"""What clients may make the cluster hold: the memory mark, resource limits, queue flow."""

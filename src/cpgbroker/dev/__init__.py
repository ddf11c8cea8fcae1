"""Development tools: a real corosync cluster in Linux network namespaces on one machine, one
broker per node, and their command line. For tests, the demo and benchmarks; a broker member
never imports this package."""

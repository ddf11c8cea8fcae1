"""The ``cpgbroker`` command line: ``start``, ``status``, ``devcluster`` ..."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "devcluster":
        from cpgbroker import devcluster

        return devcluster.main(args[1:])
    parser = argparse.ArgumentParser(prog="cpgbroker")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="run a broker (standalone, or a cluster member)")
    start.add_argument("--config", help="TOML configuration file")
    start.add_argument("--listen", help="HOST:PORT to serve AMQP on (overrides the config)")
    sub.add_parser("devcluster", help="local corosync cluster in network namespaces")
    ns = parser.parse_args(args)
    if ns.command == "start":
        from cpgbroker.runtime import server

        return server.main(config_path=ns.config, listen=ns.listen)
    parser.error(f"unknown command {ns.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

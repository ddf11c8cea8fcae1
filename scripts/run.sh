#!/usr/bin/env bash
# Set up (see setup.sh) and start a broker on 127.0.0.1:5672 (guest/guest from loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/cpgbroker start "$@"

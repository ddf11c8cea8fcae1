#!/usr/bin/env bash
# Set up this machine (see setup.sh), start a local 3-member cpgbroker cluster on a real
# 3-node corosync cluster in network namespaces, run a confirmed publisher and two consumers
# on different members, kill one node half-way, and show the clients carrying on with no
# confirmed message lost; then bring the node back and show its broker rejoin through a state
# update; last, audit the run (`cpgbroker audit`, a PySpark job) from the members' event logs,
# the clients' histories and the fault log. The cluster is removed at the end; the audit's
# verdict and HTML report stay in demo-audit/. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PREFIX=${DEMO_PREFIX:-demo}
BASE=${DEMO_BASE_PORT:-5701}
CPGB=.venv/bin/cpgbroker
$CPGB devcluster down --prefix "$PREFIX" >/dev/null 2>&1 || true
trap '$CPGB devcluster down --prefix "$PREFIX"' EXIT
# Digest checkpoints every 500 events (not 10,000): this short run then gets its replicas
# compared by the audit at the end.
$CPGB devcluster up --nodes 3 --with-brokers --prefix "$PREFIX" --base-port "$BASE" \
  --checkpoint-every 500
echo
echo "== traffic: publisher on member 1, consumers on members 2 and 3; node 2 dies after 5 s"
HISTORY=$(mktemp -d -t demo-history-XXXXXX)
trap '$CPGB devcluster down --prefix "$PREFIX"; rm -rf "$HISTORY"' EXIT
set +e
.venv/bin/python scripts/demo_traffic.py --history "$HISTORY" \
  --url "amqp://guest:guest@127.0.0.1:$BASE/" \
  --url "amqp://guest:guest@127.0.0.1:$((BASE + 1))/" \
  --url "amqp://guest:guest@127.0.0.1:$((BASE + 2))/" \
  --kill "$CPGB devcluster kill 2 --prefix $PREFIX" --kill-after 5 --seconds 14
rc=$?
set -e
echo
echo "== cluster after the failure"
$CPGB devcluster status --prefix "$PREFIX"
echo
echo "== node 2 comes back: its broker joins the serving cluster through a state update"
$CPGB devcluster restart 2 --prefix "$PREFIX"
$CPGB devcluster start-broker 2 --prefix "$PREFIX"
STATE_DIR=$($CPGB devcluster status --prefix "$PREFIX" --json |
  .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["state_dir"])')
grep -h "state update" "$STATE_DIR"/n*/broker.log | sed 's/^/  /' || true
$CPGB devcluster status --prefix "$PREFIX"
echo
echo "== audit: event logs of the members, histories of the clients, the fault log"
# The members flush their event logs when they stop.
for n in 1 2 3; do $CPGB devcluster stop-broker "$n" --prefix "$PREFIX"; done
set +e
# The verdict goes to demo-audit/verdict.json; progress and a summary to the terminal.
$CPGB audit "$STATE_DIR" "$HISTORY" --out demo-audit --master 'local[2]' >/dev/null
audit_rc=$?
set -e
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
exit "$audit_rc"

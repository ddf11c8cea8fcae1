#!/usr/bin/env bash
# Provision one node of a cpgbroker cluster on Debian 12: packages, the project, the cluster's
# files (written by `cpgbroker cluster init`), corosync and the cpgbroker systemd unit.
#
#   provision.sh NODE NODES SEED_FILE
#     NODE       this node's name, e.g. n1
#     NODES      every node as NAME=ADDRESS, comma-separated: n1=192.168.56.11,n2=...,n3=...
#     SEED_FILE  the same random bytes on every node (the Vagrantfile makes them once): the
#                authkey and the AMQP password derive from them, so that nodes provisioned
#                separately share them without copying files between machines
#
# The Vagrantfile runs it on each VM. A test runs the same script for three network
# namespaces on one machine, with:
#   CPGBROKER_PREFIX=DIR         install under DIR instead of / (DIR/etc/corosync/..., and
#                                every path written into the files is under DIR too)
#   CPGBROKER_SKIP_PACKAGES=1    no apt-get, no pip: use CPGBROKER_BIN, already installed
#   CPGBROKER_BIN=PATH           the cpgbroker command (default /opt/cpgbroker/bin/cpgbroker)
#   CPGBROKER_SERVICE_USER=USER  the user the broker runs as (default cpgbroker, created here)
#   CPGBROKER_START=no           install only; do not enable or start the services
#   CPGBROKER_SOURCE=DIR         the project's source tree (default: this script's parent)
#   CPGBROKER_TLS=1              clients use amqps (`cluster init --tls`): each member gets a
#                                certificate from the cluster's private CA, derived from the
#                                seed like the authkey; clients trust /etc/cpgbroker/tls/ca.pem
# Safe to run again: files already installed are left as they are.
set -euo pipefail

NODE=${1:?usage: provision.sh NODE NODES SEED_FILE}
NODES=${2:?usage: provision.sh NODE NODES SEED_FILE}
SEED=${3:?usage: provision.sh NODE NODES SEED_FILE}
PREFIX=${CPGBROKER_PREFIX:-}
SOURCE=${CPGBROKER_SOURCE:-$(cd "$(dirname "$0")/.." && pwd)}
VENV=/opt/cpgbroker
BIN=${CPGBROKER_BIN:-$VENV/bin/cpgbroker}
USER_NAME=${CPGBROKER_SERVICE_USER:-cpgbroker}
START=${CPGBROKER_START:-yes}
TLS=${CPGBROKER_TLS:-0}
[ -n "$PREFIX" ] && START=no

say() { echo "provision[$NODE]: $*"; }

# --- 1. Packages and the project (a VM; a test has them already).
if [ "${CPGBROKER_SKIP_PACKAGES:-0}" != 1 ]; then
  say "installing packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
    corosync libcpg-dev libcorosync-common-dev libquorum-dev libvotequorum-dev libcmap-dev \
    libqb-dev gcc python3-dev python3-venv
  # Debian starts corosync with its single-node default configuration; ours replaces it below.
  systemctl stop corosync || true
  if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
  "$VENV/bin/pip" install -q --upgrade pip
  # A copy, not an editable install: the VM must not depend on the synced folder later.
  "$VENV/bin/pip" install -q "$SOURCE"
fi
mkdir -p "$PREFIX/usr/local/bin"
ln -sf "$BIN" "$PREFIX/usr/local/bin/cpgbroker"

# --- 2. The user the broker runs as (the systemd unit's User=).
if [ "$USER_NAME" != root ] && ! id "$USER_NAME" >/dev/null 2>&1; then
  say "creating user $USER_NAME"
  useradd --system --home-dir /var/lib/cpgbroker --no-create-home \
    --shell /usr/sbin/nologin "$USER_NAME"
fi

# --- 3. The cluster's files: the same seed gives every node the same corosync.conf, authkey
# and password; each node installs its own cpgbroker.toml.
INIT="$PREFIX/var/lib/cpgbroker-init"
if [ ! -f "$INIT/corosync.conf" ]; then
  say "writing the cluster's files (cpgbroker cluster init)"
  args=()
  IFS=, read -r -a nodes <<<"$NODES"
  for n in "${nodes[@]}"; do args+=(--node "$n"); done
  rm -rf "$INIT"
  # It holds the authkey and the password: root's only.
  mkdir -p -m 0700 "$INIT"
  [ "$TLS" = 1 ] && args+=(--tls)
  "$BIN" cluster init "${args[@]}" --out "$INIT" --seed-file "$SEED" \
    --service-user "$USER_NAME" ${PREFIX:+--prefix "$PREFIX"}
fi
if [ ! -f "$INIT/$NODE/cpgbroker.toml" ]; then
  echo "provision: node $NODE is not in $NODES" >&2
  exit 2
fi

say "installing configuration under ${PREFIX:-/}"
install -d -m 0755 "$PREFIX/etc/corosync" "$PREFIX/var/log/corosync" "$PREFIX/var/lib/corosync"
install -m 0644 "$INIT/corosync.conf" "$PREFIX/etc/corosync/corosync.conf"
install -m 0400 "$INIT/authkey" "$PREFIX/etc/corosync/authkey"
install -d -m 0750 -g "$USER_NAME" "$PREFIX/etc/cpgbroker"
install -m 0640 -g "$USER_NAME" "$INIT/$NODE/cpgbroker.toml" "$PREFIX/etc/cpgbroker/cpgbroker.toml"
if [ -f "$INIT/$NODE/tls/cert.pem" ]; then
  # The member's certificate and the CA's (anyone may read them: clients need ca.pem), its
  # key readable by the broker's group only.
  install -d -m 0755 "$PREFIX/etc/cpgbroker/tls"
  install -m 0644 "$INIT/$NODE/tls/cert.pem" "$INIT/$NODE/tls/ca.pem" "$PREFIX/etc/cpgbroker/tls/"
  install -m 0640 -g "$USER_NAME" "$INIT/$NODE/tls/key.pem" "$PREFIX/etc/cpgbroker/tls/key.pem"
fi
# The AMQP user's password, for clients run on this node (root only).
install -m 0600 "$INIT/admin.password" "$PREFIX/etc/cpgbroker/admin.password"
install -d -m 0750 -o "$USER_NAME" -g "$USER_NAME" \
  "$PREFIX/var/lib/cpgbroker" "$PREFIX/var/log/cpgbroker"
install -d -m 0755 "$PREFIX/etc/systemd/system"
install -m 0644 "$SOURCE/configs/systemd/cpgbroker.service" \
  "$PREFIX/etc/systemd/system/cpgbroker.service"

# --- 4. Services (a VM): corosync, then the member. --no-block: a member reports READY only
# once every node's member has joined, and the other VMs may not be up yet.
if [ "$START" = yes ]; then
  say "starting corosync and cpgbroker"
  systemctl daemon-reload
  systemctl enable corosync cpgbroker
  systemctl restart corosync
  systemctl start --no-block cpgbroker
fi
say "done"

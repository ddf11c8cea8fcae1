#!/usr/bin/env bash
# Install what cpgbroker needs on Debian 12 (run as root or with sudo available) and build the
# package with its compiled libcpg binding into ./.venv. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# default-jre-headless: Java 17, for the PySpark audit job (`cpgbroker audit`) and its tests.
# systemd: `systemd-analyze verify` checks configs/systemd/cpgbroker.service in the tests
# (minimal images leave it out; nothing here needs systemd running).
# vagrant: `vagrant validate` checks vagrant/Vagrantfile in the tests (no hypervisor needed).
# chromium, chromium-driver: the web dashboard's test loads the page in a real headless browser
# (tests/integration/test_dashboard_browser.py, through selenium); Debian's build, since
# browser downloads of their own cannot be fetched everywhere the tests run.
APT_PACKAGES=(corosync libcpg-dev libcorosync-common-dev libquorum-dev libvotequorum-dev
  libcmap-dev libqb-dev gcc python3-dev python3-venv iproute2 procps default-jre-headless
  systemd vagrant chromium chromium-driver)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
  # The JRE's post-install step fails where minimal images leave this directory out.
  $SUDO mkdir -p /usr/share/man/man1
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends "${missing[@]}"
fi

# rabbitmq-server: Debian's RabbitMQ 3.10.8, the reference that
# tests/clients/test_definitions_rabbitmq.py imports our definitions export into (the test runs
# a private node of its own on free loopback ports). Installed apart from the list above because
# its postinst would start a default node (port 5672, user rabbitmq) that nothing here wants: a
# policy-rc.d that forbids every action (101) holds that back, ours only if the machine has
# none, and removed again also when the install fails.
if ! dpkg -s rabbitmq-server >/dev/null 2>&1; then
  echo "setup: installing rabbitmq-server (its default node neither started nor enabled)"
  policy=/usr/sbin/policy-rc.d
  own_policy=""
  if [ ! -e "$policy" ]; then own_policy=1; fi
  (
    if [ -n "$own_policy" ]; then
      trap '$SUDO rm -f "$policy"' EXIT
      printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
      $SUDO chmod 755 "$policy"
    fi
    $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
      --no-install-recommends rabbitmq-server
  )
  # Not at boot either (the systemd unit and the SysV links the postinst enabled); and stopped,
  # should the machine's own policy-rc.d have let the postinst start it.
  $SUDO deb-systemd-helper disable rabbitmq-server.service >/dev/null 2>&1 || true
  $SUDO update-rc.d rabbitmq-server disable >/dev/null 2>&1 || true
  if [ -z "$own_policy" ]; then
    $SUDO invoke-rc.d rabbitmq-server stop >/dev/null 2>&1 || true
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import cpgbroker, cpgbroker.corosync.cpg, cpgbroker.corosync.votequorum, cpgbroker.corosync.cmap" && echo "setup: cpgbroker installed in .venv"

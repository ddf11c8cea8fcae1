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

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import cpgbroker, cpgbroker.corosync.cpg, cpgbroker.corosync.votequorum, cpgbroker.corosync.cmap" && echo "setup: cpgbroker installed in .venv"

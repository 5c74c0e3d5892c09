#!/usr/bin/env bash
# System packages the tests use beside the venv: iproute2 (`ip netns`) and iptables for the
# network-namespace harness and its --cut/--blackhole drills; chromium (+ a font) for the admin
# console's browser tests (driven by the venv's playwright with executable_path, never
# `playwright install`). Installed with apt-get when this runs as root on a Debian-like machine and
# they are missing; otherwise it says what is missing and the tests that need them skip with that
# reason. Never fails the build.
set -u
missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
[ -x /usr/lib/chromium/chromium ] || missing+=(chromium)
[ -e /usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf ] || missing+=(fonts-liberation)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "sysdeps: installing ${missing[*]} (network-namespace and browser tests)"
  { apt-get -o DPkg::Lock::Timeout=600 update -qq && \
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}"; } >/dev/null 2>&1 \
    || echo "sysdeps: could not install ${missing[*]}; the network-namespace / browser tests will skip"
else
  echo "sysdeps: ${missing[*]} missing and not installable here (needs root + apt-get); the network-namespace / browser tests will skip"
fi
exit 0

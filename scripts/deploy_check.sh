#!/usr/bin/env bash
# `make deploy-check`: build deploy/Containerfile for real and run a small mesh from the image, one container per
# host, each in a network namespace of its own (python -m tiermesh.deploy_check). Root only; not part of `make test`.
#
#   1. podman, runc, debootstrap: installed with apt-get when missing.
#   2. podman's settings for this machine in a containers.conf of our own (CONTAINERS_CONF), the system's untouched:
#      runc (crun refuses this machine's hybrid cgroups) and ulimits the host can grant.
#   3. the base image: no registry is reachable here, so a Debian bookworm is made offline with debootstrap from the
#      apt mirror this machine uses, cached as a tarball under .tiermesh/deploy-check/ (about 40 s the first time).
#   4. the image, FROM that base (--build-arg BASE); pip reaches PyPI over the host's network with the host's CA
#      bundle (a build secret: a TLS-intercepting egress re-signs PyPI's certificate here). pip's downloads stay in a
#      build cache, so a rebuild after a source change takes seconds, not minutes.
#   5. the mesh: tiermesh.deploy_check (it removes every container, namespace and bridge it made, even on failure).
#
# Environment: DEBIAN_MIRROR (default: the first Debian mirror in /etc/apt/sources.list*), TIERMESH_BASE_IMAGE (use
# that base instead, e.g. python:3.11-slim where a registry is reachable), DEPLOY_CHECK_ARGS (passed to the mesh run).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
work=.tiermesh/deploy-check
base=${TIERMESH_BASE_IMAGE:-localhost/tiermesh-base:bookworm}
image=localhost/tiermesh:deploy-check
say() { printf 'deploy-check: %s\n' "$*" >&2; }

if [ "$(id -u)" != 0 ]; then
  say "needs root (network namespaces, a bridge, rootful podman)"; exit 2
fi
missing=()
for tool in podman runc debootstrap ip; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  pkgs=("${missing[@]/ip/iproute2}")
  say "installing ${pkgs[*]}"
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${pkgs[@]}" >/dev/null
fi

mkdir -p "$work"
cat > "$work/containers.conf" <<'EOF'
# written by scripts/deploy_check.sh: podman as it works on this machine (see DESIGN.md, "containers")
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF="$PWD/$work/containers.conf"

if [ -z "${TIERMESH_BASE_IMAGE:-}" ] && ! podman image exists "$base"; then
  tarball="$work/bookworm-base.tar"
  if [ ! -s "$tarball" ]; then
    mirror=${DEBIAN_MIRROR:-$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
      2>/dev/null | tr ' ' '\n' | grep -E '^https?://.*/debian/?$' | head -n1 || true)}
    [ -n "$mirror" ] || { say "no Debian mirror found in /etc/apt/sources.list*: set DEBIAN_MIRROR"; exit 2; }
    root=$(mktemp -d "$PWD/$work/rootfs.XXXXXX")
    trap 'rm -rf "$root"' EXIT
    say "making the base image offline: debootstrap bookworm from $mirror"
    t0=$SECONDS
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" \
      > "$work/debootstrap.log" 2>&1 || { tail -n 20 "$work/debootstrap.log" >&2; exit 1; }
    tar -C "$root" -c . > "$tarball.part" && mv "$tarball.part" "$tarball"
    rm -rf "$root"
    trap - EXIT
    say "debootstrap took $((SECONDS - t0)) s; cached as $tarball"
  fi
  podman import -q "$tarball" "$base" >/dev/null
  say "base image $base imported from $tarball"
fi

# pip's CA bundle: pip's own setting where there is one, else the system's
ca=${PIP_CERT:-$(.venv/bin/python -m pip config get global.cert 2>/dev/null || true)}
[ -s "$ca" ] || ca=/etc/ssl/certs/ca-certificates.crt
secret=()
[ -s "$ca" ] && secret=(--secret "id=pip-ca,src=$ca")
say "building $image FROM $base"
t0=$SECONDS
podman build --network host --build-arg "BASE=$base" "${secret[@]}" -f deploy/Containerfile -t "$image" . \
  > "$work/build.log" 2>&1 || { tail -n 30 "$work/build.log" >&2; say "image build failed: $work/build.log"; exit 1; }
say "image built in $((SECONDS - t0)) s ($(podman image inspect --format '{{.Size}}' "$image" | numfmt --to=iec-i)B); log $work/build.log"

rc=0
# shellcheck disable=SC2086  # DEPLOY_CHECK_ARGS is a list of words
.venv/bin/python -m tiermesh.deploy_check --image "$image" --work "$work" ${DEPLOY_CHECK_ARGS:-} || rc=$?
say "total $((SECONDS - started)) s, exit $rc"
exit $rc

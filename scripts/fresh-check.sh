#!/usr/bin/env bash
# The clean-room check: runs `make test` then `make demo` (a few seconds of it) in a fresh Debian
# root, as a new user would on a machine that has only the base image's packages and the Rust
# toolchain. Proves that the README's two commands depend on nothing this machine happens to
# have installed by hand.
#
#   scripts/fresh-check.sh          (as root; `make fresh-check` runs it)
#
# How:
#   - debootstrap a minimal Debian (the host's release) with only what the project's machine
#     kind ships beside Rust: gcc, libc, make, git, CA certificates. The pristine root is cached
#     as a tarball (FRESH_CACHE) and unpacked anew for every run, so each run starts clean.
#   - copy the working tree (tracked and untracked files that git does not ignore; no target/).
#   - in a private mount namespace, mount /proc, /sys, /dev and a /run for `ip netns`, and the
#     host's Rust toolchain and cargo registry read-only, as overlays so cargo can still write
#     its caches inside the root. Nothing is compiled ahead: the build starts from nothing.
#   - chroot, `CI=true make test`, then `DEMO_SECONDS=… make demo`.
#
# Environment: FRESH_SUITE (default: the host's codename), FRESH_MIRROR, FRESH_CACHE
# (default /var/tmp/split-felix-fresh-base.tar), FRESH_KEEP=1 keeps the root for inspection,
# FRESH_DEMO_SECONDS (default 8).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

[ "$(id -u)" = 0 ] || { echo "fresh-check: needs root (debootstrap, chroot, mounts)" >&2; exit 1; }

. /etc/os-release
SUITE=${FRESH_SUITE:-$VERSION_CODENAME}
MIRROR=${FRESH_MIRROR:-http://deb.debian.org/debian}
CACHE=${FRESH_CACHE:-/var/tmp/split-felix-fresh-base-$SUITE.tar}
DEMO_SECONDS=${FRESH_DEMO_SECONDS:-8}
RUSTUP_DIR=${RUSTUP_HOME:-$HOME/.rustup}
CARGO_DIR=${CARGO_HOME:-$HOME/.cargo}
BASE_PACKAGES=gcc,libc6-dev,make,git,ca-certificates

if [ ! -s "$CACHE" ]; then
  command -v debootstrap >/dev/null || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
  }
  build=$(mktemp -d /var/tmp/split-felix-debootstrap.XXXXXX)
  echo "fresh-check: debootstrap $SUITE (minbase + $BASE_PACKAGES) into $build"
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$build" "$MIRROR" \
    >"$build.log" 2>&1 || { tail -30 "$build.log" >&2; exit 1; }
  # The same package sources the host uses, so `apt-get` inside sees the same archive.
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    cp /etc/apt/sources.list.d/debian.sources "$build/etc/apt/sources.list.d/"
    rm -f "$build/etc/apt/sources.list"
  fi
  tar -C "$build" -cf "$CACHE.tmp" . && mv "$CACHE.tmp" "$CACHE"
  rm -rf "$build" "$build.log"
fi

ROOT=$(mktemp -d /var/tmp/split-felix-fresh.XXXXXX)
cleanup() {
  if [ "${FRESH_KEEP:-0}" = 1 ]; then echo "fresh-check: root kept at $ROOT"; else rm -rf "$ROOT"; fi
}
trap cleanup EXIT
tar -C "$ROOT" -xf "$CACHE"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
mkdir -p "$ROOT/src"
git -C "$REPO" ls-files -z --cached --others --exclude-standard |
  (cd "$REPO" && xargs -0 tar --ignore-failed-read -cf - 2>/dev/null) | tar -C "$ROOT/src" -xf -
present=""
for t in protoc etcd iptables ipset ip nft nc ping; do
  chroot "$ROOT" sh -c "command -v $t" >/dev/null 2>&1 && present="$present $t"
done
echo "fresh-check: fresh root has $(chroot "$ROOT" dpkg-query -W | wc -l) packages;" \
  "of the project's tools it has:${present:- none}"

# Everything below runs in a private mount namespace: its mounts vanish when it exits.
unshare --mount --propagation private bash -euo pipefail -s -- "$ROOT" "$RUSTUP_DIR" "$CARGO_DIR" "$DEMO_SECONDS" <<'INNER'
ROOT=$1 RUSTUP_DIR=$2 CARGO_DIR=$3 DEMO_SECONDS=$4
# The root must be a mount point of its own: `ip netns exec` remounts "/" as a slave.
mount --bind "$ROOT" "$ROOT"
mount -t proc proc "$ROOT/proc"
mount --rbind /sys "$ROOT/sys"
mount --rbind /dev "$ROOT/dev"
mount -t tmpfs tmpfs "$ROOT/run"
mount -t tmpfs tmpfs "$ROOT/tmp"
# The machine's Docker engine (it comes with the machine kind, like the Rust toolchain): its
# socket, and the CLI when it is not a Debian package the root could install.
if [ -S /var/run/docker.sock ]; then
  # The root's /var/run is a link to /run, the tmpfs just mounted.
  touch "$ROOT/run/docker.sock"
  mount --bind /var/run/docker.sock "$ROOT/run/docker.sock"
  if [ -x /usr/local/bin/docker ]; then
    touch "$ROOT/usr/local/bin/docker"
    mount --bind /usr/local/bin/docker "$ROOT/usr/local/bin/docker"
  fi
fi
# The toolchain and the registry, read-only underneath a writable layer inside the root.
for pair in "$RUSTUP_DIR:/root/.rustup" "$CARGO_DIR:/root/.cargo"; do
  lower=${pair%%:*} target=$ROOT${pair#*:}
  name=$(basename "$target")
  mkdir -p "$target" "$ROOT/.overlay/$name/upper" "$ROOT/.overlay/$name/work"
  mount -t overlay overlay \
    -o "lowerdir=$lower,upperdir=$ROOT/.overlay/$name/upper,workdir=$ROOT/.overlay/$name/work" "$target"
done
chroot "$ROOT" /usr/bin/env -i HOME=/root TERM=dumb CI=true DOCKER_HOST=unix:///run/docker.sock \
  PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  bash -euo pipefail -c "
    cd /src
    start=\$SECONDS
    make test
    echo \"fresh-check: make test passed in \$((SECONDS - start)) s\"
    DEMO_SECONDS=$DEMO_SECONDS make demo > /tmp/demo.log 2>&1 || { cat /tmp/demo.log; exit 1; }
    tail -5 /tmp/demo.log
    grep -q 'endpoint \"k8s/' /tmp/demo.log || { echo 'fresh-check: the demo programmed no endpoint'; cat /tmp/demo.log; exit 1; }
    echo 'fresh-check: make demo ran'
  "
INNER
echo "fresh-check: passed (make test and make demo in a fresh $SUITE root)"

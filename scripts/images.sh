#!/usr/bin/env bash
# `make images`: the calc-server and dataplane-agent images, built on a machine that can pull
# nothing (no container registry), from the host's release build.
#
#   scripts/images.sh            (as root, or as a member of the docker group that may sudo)
#
# The Dockerfiles keep their public bases for users (`docker build -f docker/….Dockerfile .`
# with a registry: a Rust image compiles, distroless / debian-slim run). Here:
#   - the binaries come from `cargo build --release` on the host, copied to docker/bin/, which
#     the Dockerfiles' build stage takes instead of compiling (BUILDER is then a local image);
#   - the bases are made locally: `debootstrap --variant=minbase` of the host's Debian release
#     with only what the agent runs (iptables, ipset, iproute2, nftables, CA certificates),
#     cached as a tarball (IMAGES_CACHE), trimmed (docs, man pages, locales, apt lists) and
#     `docker import`ed as split-felix/runtime-base:<suite>; calc-server's base
#     (split-felix/static-base:<suite>) holds only the shared libraries its binary links, the
#     CA certificates and a `nonroot` (65532) user: distroless' shape, no shell, no apt;
#   - the compose cluster (docker/compose.yaml) also needs split-felix/etcd:<suite> (the runtime
#     base plus Debian's etcd-server) and split-felix/workload:<suite> (plus netcat and ping),
#     built here from the same tarball.
#
# Environment: IMAGES_SUITE (default: the host's codename), IMAGES_MIRROR, IMAGES_CACHE,
# IMAGES_TAG (default dev), IMAGES_ONLY ("agent server" by default; add "cluster" for the
# compose images; `make images` builds all).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

[ "$(id -u)" = 0 ] || { echo "images: needs root (debootstrap, docker)" >&2; exit 1; }
command -v docker >/dev/null && docker info >/dev/null 2>&1 || {
  echo "images: no Docker engine (docker info failed)" >&2; exit 1; }

. /etc/os-release
SUITE=${IMAGES_SUITE:-$VERSION_CODENAME}
MIRROR=${IMAGES_MIRROR:-http://deb.debian.org/debian}
CACHE=${IMAGES_CACHE:-/var/tmp/split-felix-images-base-$SUITE.tar}
TAG=${IMAGES_TAG:-dev}
ONLY=${IMAGES_ONLY:-agent server cluster}
RUNTIME_PACKAGES=iptables,ipset,iproute2,nftables,ca-certificates
CLUSTER_PACKAGES=etcd-server,etcd-client,netcat-openbsd,iputils-ping
CARGO=${CARGO:-cargo}

log() { echo "images: $*"; }

# 1. The binaries, from the host's release build.
log "cargo build --release (calc-server, dataplane-agent)"
$CARGO build --release --locked -p calc-server --bin calc-server -p dataplane-agent --bin dataplane-agent
mkdir -p docker/bin
for b in calc-server dataplane-agent; do
  install -m 0755 "target/release/$b" "docker/bin/$b"
  # The line tables stay in target/; the image carries the code only.
  strip --strip-debug "docker/bin/$b"
done

# 2. The base root, once per suite.
if [ ! -s "$CACHE" ]; then
  command -v debootstrap >/dev/null || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
  }
  build=$(mktemp -d /var/tmp/split-felix-images-debootstrap.XXXXXX)
  log "debootstrap $SUITE (minbase + $RUNTIME_PACKAGES,$CLUSTER_PACKAGES) into $build"
  debootstrap --variant=minbase --include="$RUNTIME_PACKAGES,$CLUSTER_PACKAGES" \
    "$SUITE" "$build" "$MIRROR" >"$build.log" 2>&1 || { tail -30 "$build.log" >&2; exit 1; }
  tar -C "$build" -cf "$CACHE.tmp" . && mv "$CACHE.tmp" "$CACHE"
  rm -rf "$build" "$build.log"
fi

WORK=$(mktemp -d /var/tmp/split-felix-images.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# A root from the cached tarball, without the given packages' files, trimmed of what no
# container reads (documentation, man pages, locales, apt's lists and caches).
root_without() {
  local dir=$1; shift
  mkdir -p "$dir"
  tar -C "$dir" -xf "$CACHE"
  for pkg in "$@"; do
    chroot "$dir" dpkg --purge --force-depends "$pkg" >/dev/null 2>&1 || true
  done
  rm -rf "$dir"/usr/share/doc/* "$dir"/usr/share/man/* "$dir"/usr/share/info/* \
    "$dir"/usr/share/locale/* "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/* \
    "$dir"/var/cache/debconf/*-old "$dir"/var/log/*.log
}

import_root() {
  local dir=$1 image=$2; shift 2
  tar -C "$dir" -c . | docker import "$@" - "$image" >/dev/null
  log "imported $image"
}

# 3. The runtime base: the agent's tools; etcd and the workload tools taken out again.
if [[ " $ONLY " == *" agent "* || " $ONLY " == *" cluster "* ]]; then
  root_without "$WORK/runtime" etcd-server etcd-client netcat-openbsd iputils-ping
  import_root "$WORK/runtime" "split-felix/runtime-base:$SUITE" --change 'CMD ["/bin/sh"]'
fi

# 4. calc-server's base: the libraries its binary links, CA certificates, a nonroot user.
if [[ " $ONLY " == *" server "* ]]; then
  full="$WORK/full"; mkdir -p "$full"; tar -C "$full" -xf "$CACHE"
  s="$WORK/static"
  mkdir -p "$s/etc/ssl/certs" "$s/tmp" "$s/home/nonroot" "$s/usr/share/zoneinfo"
  chmod 1777 "$s/tmp"
  # The loader and every library the binary links (ldd resolves them as in the image: the
  # host and the root are the same Debian release).
  for lib in $(ldd docker/bin/calc-server | grep -o '/[^ ]*'); do
    mkdir -p "$s$(dirname "$lib")"
    cp -L "$full$lib" "$s$lib"
  done
  cp -L "$full/etc/ssl/certs/ca-certificates.crt" "$s/etc/ssl/certs/"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$s/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' >"$s/etc/group"
  chown 65532:65532 "$s/home/nonroot"
  import_root "$s" "split-felix/static-base:$SUITE"
fi

# 5. The product images, through their Dockerfiles: BUILDER is a local image (the build stage
#    only copies docker/bin/), BASE the local base.
build() {
  local name=$1 base=$2
  log "docker build $name"
  DOCKER_BUILDKIT=0 docker build -q -f "docker/$name.Dockerfile" \
    --build-arg "BUILDER=split-felix/runtime-base:$SUITE" \
    --build-arg "BASE=$base" \
    -t "split-felix/$name:$TAG" . >/dev/null
}
if [[ " $ONLY " == *" agent "* ]]; then
  build dataplane-agent "split-felix/runtime-base:$SUITE"
fi
if [[ " $ONLY " == *" server "* ]]; then
  [[ " $ONLY " == *" agent "* || " $ONLY " == *" cluster "* ]] || {
    root_without "$WORK/runtime" etcd-server etcd-client netcat-openbsd iputils-ping
    import_root "$WORK/runtime" "split-felix/runtime-base:$SUITE" --change 'CMD ["/bin/sh"]'; }
  build calc-server "split-felix/static-base:$SUITE"
fi

# The classic builder leaves the build stages as untagged images.
docker image prune -f --filter label=split-felix.stage=build >/dev/null

# 6. The compose cluster's other images: etcd, and a workload with nc and ping.
if [[ " $ONLY " == *" cluster "* ]]; then
  root_without "$WORK/etcd" netcat-openbsd iputils-ping iptables ipset nftables
  import_root "$WORK/etcd" "split-felix/etcd:$SUITE" \
    --change 'ENTRYPOINT ["/usr/bin/etcd"]' --change 'USER 65532:65532' \
    --change 'ENV ETCD_DATA_DIR=/tmp/etcd'
  root_without "$WORK/workload" etcd-server etcd-client iptables ipset nftables
  import_root "$WORK/workload" "split-felix/workload:$SUITE" --change 'CMD ["sleep", "infinity"]'
fi

size() { docker image inspect --format '{{.Size}}' "$1" 2>/dev/null | awk '{printf "%.1f MB", $1/1e6}'; }
for image in "split-felix/calc-server:$TAG" "split-felix/dataplane-agent:$TAG" \
  "split-felix/etcd:$SUITE" "split-felix/workload:$SUITE"; do
  docker image inspect "$image" >/dev/null 2>&1 && log "$image: $(size "$image")"
done

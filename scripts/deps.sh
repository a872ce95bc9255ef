#!/usr/bin/env bash
# Installs the system packages the build and the tests read, then checks that every file they
# need is really there. Idempotent: installs only what dpkg says is missing (`apt-get update`
# first), and the check runs every time, so a half-installed machine fails here with a list of
# what is missing instead of in a build script minutes later.
#
# What reads what:
#   protoc + the well-known type protos  etcd-client's and our proto crate's build scripts
#                                        (etcd-client imports google/protobuf/*.proto, which
#                                        Debian ships in libprotobuf-dev, not protobuf-compiler)
#   cc                                   ring's build script (the Rust toolchain's base image has it)
#   etcd, etcdctl                        the etcd datastore tests
#   iptables(-nft/-legacy)-restore, ipset, ip, nft, nc, ping
#                                        the Linux driver tests in network namespaces
#   python3-grpcio, python3-protobuf, grpc_python_plugin
#                                        the Goldmane client test (flow_logs_server.rs): stubs
#                                        generated from goldmane.proto by another toolchain
#   debootstrap, docker-compose          `make images` and the container tests (the Docker
#                                        engine itself comes with the machine, not from here:
#                                        without one, those tests skip unless CI is set)
#   chromium, chromedriver               the admin console's browser test (integration/tests/
#                                        console.rs drives headless chromium over WebDriver)
set -euo pipefail

PACKAGES=(
  protobuf-compiler libprotobuf-dev
  etcd-server etcd-client
  iptables ipset iproute2 nftables
  netcat-openbsd iputils-ping
  python3-grpcio python3-protobuf protobuf-compiler-grpc
  debootstrap docker-compose
  chromium chromium-driver
)

SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

missing=()
for p in "${PACKAGES[@]}"; do
  # `dpkg -s` succeeds for removed-but-configured packages too; ask for the install state.
  state=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [ "$state" = installed ] || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "deps: all packages present"
fi

# Check what the build and the tests actually open, whatever installed it.
problems=()
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
for tool in cc protoc grpc_python_plugin etcd etcdctl ip ipset nft nc ping debootstrap docker-compose \
  chromium chromedriver \
  iptables-nft-restore iptables-nft-save ip6tables-nft-restore ip6tables-nft-save \
  iptables-legacy-restore iptables-legacy-save ip6tables-legacy-restore ip6tables-legacy-save; do
  have "$tool" || problems+=("command '$tool' not found")
done
include=${PROTOC_INCLUDE:-/usr/include}
for proto in descriptor struct timestamp duration empty any wrappers; do
  [ -f "$include/google/protobuf/$proto.proto" ] ||
    problems+=("$include/google/protobuf/$proto.proto not found (libprotobuf-dev ships it)")
done
# Debian's interpreter, whatever else is first on PATH: the Goldmane client test runs it.
/usr/bin/python3 -c 'import grpc, google.protobuf' 2>/dev/null ||
  problems+=("/usr/bin/python3 cannot import grpc and google.protobuf (python3-grpcio, python3-protobuf)")
# nc must be the OpenBSD flavour: the tests use `nc -z -w 1` and `nc -l -k`.
if have nc && ! nc -h 2>&1 | grep -q -- '-k'; then
  problems+=("nc is not netcat-openbsd (the tests need -k and -z)")
fi

if [ ${#problems[@]} -gt 0 ]; then
  echo "deps: the build or the tests would fail; missing:" >&2
  printf '  - %s\n' "${problems[@]}" >&2
  exit 1
fi
echo "deps: protoc $(protoc --version | cut -d' ' -f2), etcd $(etcd --version 2>/dev/null | head -1 | awk '{print $3}'), every tool and proto present"

# dataplane-agent, built from the workspace root:
#   docker build -f docker/dataplane-agent.Dockerfile -t split-felix/dataplane-agent:dev .
# The runtime image carries the tools the Linux driver runs: iptables (legacy and nft
# variants), ipset, iproute2 and nftables, and nothing to build with. It runs as root with
# NET_ADMIN and NET_RAW (docs/operations.md, "Containers"): privileged in the host network
# namespace as a node agent, or in an application's network namespace as a sidecar.
# `make images` builds the same image on a machine that pulls nothing: BUILDER and BASE are
# then local images (BASE already holds the tools) and the binary comes from the host's release
# build, in docker/bin/ (scripts/images.sh). No BuildKit-only syntax.

ARG BUILDER=rust:1.90-bookworm
ARG BASE=debian:bookworm-slim

FROM ${BUILDER} AS build
# The classic builder keeps this stage as an untagged image: make images removes it by label.
LABEL split-felix.stage=build
WORKDIR /src
COPY . .
# A prebuilt binary (docker/bin/, from `make images`) is taken as is; otherwise compile.
RUN if [ -x docker/bin/dataplane-agent ]; then cp docker/bin/dataplane-agent /dataplane-agent; \
    else apt-get update && apt-get install -y --no-install-recommends protobuf-compiler \
      && cargo build --release --locked -p dataplane-agent --bin dataplane-agent \
      && cp target/release/dataplane-agent /dataplane-agent; fi

FROM ${BASE}
# The public base lacks the tools; a base that has them (make images) installs nothing.
RUN if ! command -v iptables >/dev/null || ! command -v ipset >/dev/null \
      || ! command -v ip >/dev/null || ! command -v nft >/dev/null; then \
      apt-get update \
      && apt-get install -y --no-install-recommends iptables ipset iproute2 nftables ca-certificates \
      && rm -rf /var/lib/apt/lists/*; fi
COPY --from=build /dataplane-agent /usr/local/bin/dataplane-agent
# 9097: admin HTTP (/liveness, /readiness, /metrics) when --admin-listen is set (the
# DaemonSet uses 127.0.0.1:9097; Felix's health port 9099 and Typha's 9098 stay free).
EXPOSE 9097
ENTRYPOINT ["/usr/local/bin/dataplane-agent"]

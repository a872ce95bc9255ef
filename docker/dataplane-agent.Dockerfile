# dataplane-agent: multi-stage build from the workspace root.
#   docker build -f docker/dataplane-agent.Dockerfile -t split-felix/dataplane-agent:dev .
# The runtime image carries the tools the Linux driver runs: iptables (legacy and nft
# variants), ipset and iproute2. It must run privileged in the host network namespace.

FROM rust:1.90-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p dataplane-agent --bin dataplane-agent \
    && cp target/release/dataplane-agent /dataplane-agent

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends iptables ipset iproute2 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /dataplane-agent /usr/local/bin/dataplane-agent
# 9097: admin HTTP (/liveness, /readiness, /metrics) when --admin-listen is set (the
# DaemonSet uses 127.0.0.1:9097; Felix's health port 9099 and Typha's 9098 stay free).
EXPOSE 9097
ENTRYPOINT ["/usr/local/bin/dataplane-agent"]

# calc-server: multi-stage build from the workspace root.
#   docker build -f docker/calc-server.Dockerfile -t split-felix/calc-server:dev .
# The runtime image is distroless (glibc, CA certificates, no shell) running as nonroot.

FROM rust:1.90-bookworm AS build
# protoc: etcd-client's build script compiles etcd's protos.
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p calc-server --bin calc-server \
    && cp target/release/calc-server /calc-server

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /calc-server /usr/local/bin/calc-server
# 50051: gRPC CalcServer.Sync; 9099: admin HTTP (/liveness, /readiness, /metrics, /status).
EXPOSE 50051 9099
USER nonroot
ENTRYPOINT ["/usr/local/bin/calc-server"]
CMD ["serve", "--listen", "0.0.0.0:50051", "--admin-listen", "0.0.0.0:9099"]

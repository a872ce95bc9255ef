# calc-server: multi-stage build from the workspace root.
#   docker build -f docker/calc-server.Dockerfile -t split-felix/calc-server:dev .
# The runtime image is distroless (glibc, CA certificates, no shell) running as nonroot.
#
# With no arguments the image serves the example cluster from the file datastore
# (`docker run -p 50051:50051 -p 9096:9096 split-felix/calc-server:dev`); the Kubernetes
# manifests in docker/k8s/ replace the command with `serve --datastore-type=kubernetes …`.

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
# The default command's --file-dir. Owned by nonroot: the file datastore writes endpoint
# status (status/<node>.json) and its last-good store (status/last-good/) inside it.
COPY --from=build --chown=65532:65532 /src/examples/cluster /var/lib/calc-server/cluster
# 50051: gRPC CalcServer.Sync; 9096: admin HTTP (/liveness, /readiness, /metrics, /status).
EXPOSE 50051 9096
USER nonroot
ENTRYPOINT ["/usr/local/bin/calc-server"]
CMD ["serve", "--file-dir", "/var/lib/calc-server/cluster", "--listen", "0.0.0.0:50051", "--admin-listen", "0.0.0.0:9096"]

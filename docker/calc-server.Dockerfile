# calc-server, built from the workspace root:
#   docker build -f docker/calc-server.Dockerfile -t split-felix/calc-server:dev .
# With a registry, the build stage compiles in a Rust image and the runtime image is distroless
# (glibc, CA certificates, no shell) running as nonroot (65532). `make images` builds the same
# image on a machine that pulls nothing: BUILDER and BASE are then local images and the binary
# comes from the host's release build, in docker/bin/ (scripts/images.sh).
# No BuildKit-only syntax: the builder that ships with Debian's docker.io reads this file too.
#
# With no arguments the image serves the example cluster from the file datastore
# (`docker run -p 50051:50051 split-felix/calc-server:dev`), its admin endpoint on the
# container's loopback (`docker exec … calc-server status`): an admin endpoint on a routable
# address needs authentication (docs/tls.md). The Kubernetes manifests in docker/k8s/ replace
# the command with `serve --datastore-type=kubernetes …`.

ARG BUILDER=rust:1.90-bookworm
ARG BASE=gcr.io/distroless/cc-debian12:nonroot

FROM ${BUILDER} AS build
# The classic builder keeps this stage as an untagged image: make images removes it by label.
LABEL split-felix.stage=build
WORKDIR /src
COPY . .
# A prebuilt binary (docker/bin/, from `make images`) is taken as is; otherwise compile.
# protoc: etcd-client's build script compiles etcd's protos.
RUN if [ -x docker/bin/calc-server ]; then cp docker/bin/calc-server /calc-server; \
    else apt-get update && apt-get install -y --no-install-recommends protobuf-compiler \
      && cargo build --release --locked -p calc-server --bin calc-server \
      && cp target/release/calc-server /calc-server; fi \
    && mkdir -p /cluster && cp examples/cluster/*.yaml /cluster/

FROM ${BASE}
COPY --from=build /calc-server /usr/local/bin/calc-server
# The default command's --file-dir. Owned by nonroot: the file datastore writes endpoint
# status (status/<node>.json) and its last-good store (status/last-good/) inside it.
COPY --from=build --chown=65532:65532 /cluster /var/lib/calc-server/cluster
# 50051: gRPC CalcServer.Sync; 9096: admin (/liveness, /readiness, /metrics, /status,
# /explain), reachable from outside once --admin-listen and its authentication are set.
EXPOSE 50051 9096
# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/calc-server"]
CMD ["serve", "--file-dir", "/var/lib/calc-server/cluster", "--listen", "0.0.0.0:50051", "--admin-listen", "127.0.0.1:9096"]

# The two commands a new user runs: `make demo` and `make test`. See README.md.
CARGO ?= cargo
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# System tools the build and the integration tests need (protoc for etcd-client's build script,
# etcd for the datastore tests, iptables/ipset/iproute2/nftables for the dataplane tests).
APT_PACKAGES := protobuf-compiler etcd-server etcd-client iptables ipset iproute2 nftables

.PHONY: deps build test demo bench lint fmt clean

## deps: install the missing system packages (idempotent; apt-get update first)
deps:
	@missing=""; \
	for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "deps: all present"; fi

## build: build every binary of the workspace
build: deps
	$(CARGO) build --workspace --bins

## test: unit, data-driven and integration tests (integration tests run the built binaries)
test: build
	$(CARGO) test --workspace

## demo: run the main job on the embedded default datastore (examples/)
demo: build
	./scripts/demo.sh

## bench: print the benchmark figures recorded in docs/benchmarks.md
bench: deps
	./scripts/bench.sh

## lint: formatting and clippy, warnings are errors
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean

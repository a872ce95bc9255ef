# The two commands a new user runs: `make demo` and `make test`. See README.md.
CARGO ?= cargo

.PHONY: deps build test demo bench bench-calc bench-sync bench-stats bench-flows lint fmt clean fresh-check images demo-containers

## deps: install the missing system packages (idempotent; apt-get update first), then check that
## every tool and file the build and the tests read is present (scripts/deps.sh lists them)
deps:
	./scripts/deps.sh

## build: build every binary of the workspace
build: deps
	$(CARGO) build --workspace --bins

## test: unit, data-driven and integration tests (integration tests run the built binaries).
## The tests that need root, etcd or the namespace tools are #[ignore]d for a plain `cargo test`;
## here deps installed what they need, so they run too, and fail if something is still missing;
## scripts/test.sh prints the totals and names any test that did not run.
test: build
	@[ "$$(id -u)" = 0 ] || echo "make test: not root; the network-namespace tests need root and will fail"
	CARGO=$(CARGO) ./scripts/test.sh

## demo: run the main job on the embedded default datastore (examples/)
demo: build
	./scripts/demo.sh

## images: the calc-server and dataplane-agent images (and the compose cluster's etcd and
## workload images), from the host's release build and locally made Debian bases: nothing is
## pulled (scripts/images.sh; docker/README.md)
images: deps
	CARGO=$(CARGO) ./scripts/images.sh

## demo-containers: etcd, calc-server and three agent "nodes" with workload containers
## (docker/compose.yaml): shows enforcement and `calc-server status`, then stops
demo-containers: images
	./scripts/demo-containers.sh

## bench: print the benchmark figures recorded in docs/benchmarks.md
bench: deps
	./scripts/bench.sh all

## bench-calc: only the calculation-graph benchmarks (10k and 100k endpoints): prints
## `calc 10k: floor … ms, compute … ms, ratio …`, the same for 100k, and `memory per endpoint`
bench-calc: deps
	./scripts/bench.sh calc

## bench-sync: only the 1,000-agent Sync benchmark: prints `sync 1000 agents: in sync … s, rss above idle … MiB`
bench-sync: deps
	./scripts/bench.sh sync

## bench-stats: the same 1,000 agents each sending a RuleStats report every second: prints
## `stats 1000 agents: reports … /s, cpu … % of a core (… µs/report, … ns/hit), rss above in-sync … MiB, entries …`
bench-stats: deps
	./scripts/bench.sh stats

## bench-flows: flow logs (issue 42): calc-server's ingest on one core and memory per flow key,
## then (as root) the agent's CPU per 1,000 new connections/s: prints
## `flows ingest: … µs/record, … records/s on one core, …x Goldmane's 13 µs/flow`,
## `flows ingest instructions: … per record`, `flows memory: … bytes/key, … MiB at --flow-max-keys …`
## and `agent flows: … CPU-ms/s per 1k conn/s with flow logs (… % of a core), … without`
bench-flows: deps
	./scripts/bench.sh flows

## lint: formatting and clippy, warnings are errors
lint: deps
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

## fresh-check: `make test` and `make demo` in a fresh Debian root (debootstrap), as a new user
## would run them on a machine with only the base image's packages (scripts/fresh-check.sh)
fresh-check:
	./scripts/fresh-check.sh

clean:
	$(CARGO) clean

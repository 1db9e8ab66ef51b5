# pvrdma-backend: build, check, test and demo.
# Prerequisite: Go >= 1.26 (at /usr/local/go). Everything else is installed by `make deps`
# (Debian bookworm packages) and `make image` (the VM test bed's cache). Run as root: the
# VM tests create network namespaces, bridges and taps.

export PATH := /usr/local/go/bin:$(HOME)/go/bin:$(PATH)
GO ?= go
# `make unit`: every package's unit tests. `make vmtest`: every package with the vm tag,
# one package at a time since the guests run under TCG on 2 cores, verbose so that the
# guests' output and the BASELINE/TIMING figures are in the log. `make test`: both, each
# test once (below).
UNIT_TIMEOUT ?= 20m
VM_TIMEOUT ?= 40m

.PHONY: all build bin deps image test unit vmtest demo bench bench-vm bench-scale bench-handover bench-hosts bench-report bench-guard soak check clean-cache deb

all: build

build:
	$(GO) build ./...

# The daemon binary.
bin:
	$(GO) build -o bin/pvrdma-backend ./cmd/pvrdma-backend

# The Debian package (dist/pvrdma-backend_VERSION_ARCH.deb): the binary, its systemd
# unit, /etc/default/pvrdma-backend and the man page, built by nfpm (packaging/nfpm.yaml).
# The binary is built with cgo (the ibverbs relay; libibverbs itself is loaded at run time,
# only when the relay is used), so the package depends on libc6.
NFPM_VERSION ?= v2.44.0
DEB_VERSION ?= 0.1.0~git$(shell git log -1 --format=%cd.%h --date=format:%Y%m%d 2>/dev/null || echo 0)
DIST ?= dist
deb:
	@command -v nfpm >/dev/null || $(GO) install github.com/goreleaser/nfpm/v2/cmd/nfpm@$(NFPM_VERSION)
	CGO_ENABLED=1 $(GO) build -trimpath -o bin/pvrdma-backend ./cmd/pvrdma-backend
	mkdir -p $(DIST)
	VERSION=$(DEB_VERSION) ARCH=$$($(GO) env GOARCH) nfpm package --config packaging/nfpm.yaml --packager deb --target $(DIST)/

deps:
	./scripts/deps.sh

image: deps
	$(GO) run ./tests/vm/cmd/vmimage

unit:
	$(GO) test -timeout $(UNIT_TIMEOUT) ./...

vmtest: image
	$(GO) test -tags vm -count=1 -p 1 -v -timeout $(VM_TIMEOUT) ./...

# Packages with VM tests (test files built with the vm tag), and the others. `make test`
# runs each test once: the other packages' tests in parallel, in the background (their
# output is printed after the VM tests'), while the VM packages run with the tag, their
# unit tests with them, verbose, VM_PARALLEL packages at a time, the longest first (the
# guests run under TCG; one package's guests mostly wait on another's, so two packages
# fill the two cores); it fails if either run did (each `go test` runs every package it is
# given and reports every failure).
VM_PARALLEL ?= 2
VM_FIRST = ./tests/e2e/ ./tests/packaging/ ./hostverbs/soft/
VM_PKGS = $(sort $(dir $(shell grep -rl --include='*_test.go' '^//go:build vm' .)))
VM_ORDER = $(foreach p,$(VM_FIRST),$(filter $(p),$(VM_PKGS))) $(filter-out $(VM_FIRST),$(VM_PKGS))
UNIT_PKGS = $(filter-out $(VM_PKGS),$(shell $(GO) list -f '{{.Dir}}/' ./... | sed 's|^$(CURDIR)/|./|'))

test: deps image
	@unit=0; vm=0; ulog=$$(mktemp); \
	$(GO) test -count=1 -timeout $(UNIT_TIMEOUT) $(UNIT_PKGS) >$$ulog 2>&1 & upid=$$!; \
	$(GO) test -tags vm -count=1 -p $(VM_PARALLEL) -v -timeout $(VM_TIMEOUT) $(VM_ORDER) || vm=$$?; \
	wait $$upid || unit=$$?; \
	echo "== unit tests (run beside the VM tests):"; cat $$ulog; rm -f $$ulog; \
	if [ $$unit -ne 0 ] || [ $$vm -ne 0 ]; then \
		echo "make test: unit tests $$([ $$unit -eq 0 ] && echo passed || echo FAILED), VM tests $$([ $$vm -eq 0 ] && echo passed || echo FAILED)" >&2; \
		exit 1; \
	fi

# The main job: the daemon plus two stock guests doing RDMA through it.
demo: deps image bin
	$(GO) run ./tests/demo -backend bin/pvrdma-backend

# Micro-benchmarks, each printing ratios against a reference measured in the
# same run (bare socket ping-pong, UDP blast and ping-pong, memcpy).
bench:
	$(GO) test -run '^$$' -bench . -benchmem -benchtime 2s ./vfiouser ./vdev ./hostverbs/soft ./guestmem

# One daemon, N VMs of the fake driver (real vfio-user connections, no QEMU), N = 2, 8,
# 32, 128 (PVRDMA_SCALE_N=8,32 for others): aggregate WRITE throughput against N=8 in the
# same run, Jain's fairness, a probe's doorbell-to-CQE latency, and what each VM costs;
# then one VM creating and destroying as many CQs, QPs and MRs as its device allows (up
# to 16k, 16k, 64k): the creation rate of the first and last 1024, memory per object.
bench-scale:
	$(GO) test -run '^$$' -bench 'Scale|Objects' -benchtime 1x -timeout 30m ./tests/hostile

# The guest-visible pause of a live upgrade (pvrdma-backend upgrade) with 2, 8 and 32
# VMs of the fake driver streaming WRITEs, a probe's longest WRITE across it against
# its median in the same run, and the RC QPs that kept their connections.
bench-handover:
	$(GO) test -run '^$$' -bench 'Handover' -benchtime 1x -timeout 10m ./tests/hostile

# Four hosts (network namespaces, a daemon each, two fake-driver VMs each), every VM
# streaming verified WRITEs to every VM of the other hosts: in IP mode across a router
# (two subnets) and in L2 mode across a kernel VXLAN overlay. The all-to-all aggregate
# and Jain's fairness across hosts and across the 48 streams. Needs root.
bench-hosts:
	$(GO) test -run '^$$' -bench 'ManyHosts' -benchtime 1x -timeout 10m ./tests/hostile

# A longer soak than the test suite's 200 sessions: VM sessions in a row
# (connect, traffic, disconnect), then goroutines, fds, locked memory and RSS
# against the start.
SOAK_SESSIONS ?= 2000
soak:
	PVRDMA_SOAK_SESSIONS=$(SOAK_SESSIONS) $(GO) test -count=1 -run TestSoakSessions -v -timeout 30m ./tests/hostile

# Guests through our device vs rxe in the guest, same run, as ratios; then the
# ibverbs relay vs a plain libibverbs program on the same rxe device in one guest.
bench-vm: image
	$(GO) test -tags vm -run '^$$' -bench VMvsRxe -benchtime 1x -timeout 30m ./tests/e2e
	$(GO) test -tags vm -run '^$$' -bench RelayVsPlain -benchtime 1x -timeout 30m ./hostverbs/ibverbs

# The benchmark report, docs/BENCHMARKS.md: runs the benchmarks above section by section
# (tests/benchreport/sections.go: device, wire, incast, vm, relay, scale, handover, hosts),
# each with its date, commit, machine, load average and exact command, and writes the
# figures as the benchmarks printed them. BENCH_SECTIONS=wire,scale regenerates only those
# sections (the others stay as they are). Run it on a machine nothing else is using.
BENCH_SECTIONS ?= all
# Is the working tree slower than the last release (the newest tag v*)? Alternated pairs
# of the guests' and the soft transport's benchmarks, a table, exit 1 on a regression
# (docs/DEVELOPING.md). GUARD_PAIRS pairs per benchmark; needs a quiet machine.
GUARD_PAIRS ?= 5
bench-guard: image
	./scripts/bench-guard -n $(GUARD_PAIRS)

bench-report: deps
	$(GO) run ./tests/benchreport -sections '$(BENCH_SECTIONS)' -report docs/BENCHMARKS.md -raw out/bench

check:
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt -l:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) vet -tags vm ./...
	@command -v staticcheck >/dev/null || $(GO) install honnef.co/go/tools/cmd/staticcheck@latest
	staticcheck ./...
	staticcheck -tags vm ./...

# Removes the VM image cache (the next `make image` rebuilds it).
clean-cache:
	$(GO) run ./tests/vm/cmd/vmimage -print-dir | xargs -r rm -rf

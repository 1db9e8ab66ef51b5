# pvrdma-backend: build, check, test and demo.
# Prerequisite: Go >= 1.26 (at /usr/local/go). Everything else is installed by `make deps`
# (Debian bookworm packages) and `make testbed` (the test bed's cache: the VM image, the
# packaging tests' roots, nfpm). Run as root: the VM tests create network namespaces,
# bridges and taps.

export PATH := /usr/local/go/bin:$(HOME)/go/bin:$(PATH)
GO ?= go
# Every go command run from here (and every one the tests run) builds with -trimpath, as
# `make deb` builds the package's binary: the tests, the package and the binaries then
# share one set of compiled packages in Go's build cache instead of compiling everything
# twice (a cold cache's largest cost after the guests).
export GOFLAGS := $(strip $(filter-out -trimpath,$(shell $(GO) env GOFLAGS 2>/dev/null)) -trimpath)
# `make unit`: every package's unit tests. `make vmtest`: every package with the vm tag,
# one package at a time since the guests run under TCG on 2 cores, verbose so that the
# guests' output and the BASELINE/TIMING figures are in the log. `make test`: both, each
# test once (below).
UNIT_TIMEOUT ?= 15m
VM_TIMEOUT ?= 30m

# The test bed's cache: the VM image (tests/vm), the packaging tests' bookworm roots
# (pkgroot/) and nfpm (tools/). The same directory as tests/vm's DefaultCacheDir:
# $PVRDMA_VM_CACHE, else $XDG_CACHE_HOME/pvrdma-backend, else /var/cache/pvrdma-backend.
VM_CACHE := $(or $(PVRDMA_VM_CACHE),$(if $(XDG_CACHE_HOME),$(XDG_CACHE_HOME)/pvrdma-backend),/var/cache/pvrdma-backend)

.PHONY: all build bin deps image roots nfpm testbed testbed-update testbed-lock test unit vmtest demo bench bench-vm bench-scale bench-handover bench-hosts bench-report bench-guard soak check clean-cache deb

all: build

build:
	$(GO) build ./...

# The daemon binary.
bin:
	$(GO) build -o bin/pvrdma-backend ./cmd/pvrdma-backend

# The Debian package (dist/pvrdma-backend_VERSION_ARCH.deb): the binary, its systemd
# unit, /etc/default/pvrdma-backend, the libvirt hook, the man page, and README with the
# docs it links to, built by nfpm (packaging/nfpm.yaml). Run as root unless PVRDMA_VM_CACHE
# or XDG_CACHE_HOME puts the cache (where nfpm is built) somewhere writable.
# The binary is built with cgo (the ibverbs relay; libibverbs itself is loaded at run time,
# only when the relay is used), so the package depends on libc6. nfpm is built once, at
# the pinned version, into the test bed's cache (NFPM=/path/to/nfpm uses another).
NFPM_VERSION ?= v2.44.0
NFPM ?= $(VM_CACHE)/tools/nfpm-$(NFPM_VERSION)/nfpm
DEB_VERSION ?= 0.1.0~git$(shell git log -1 --format=%cd.%h --date=format:%Y%m%d 2>/dev/null || echo 0)
DIST ?= dist
deb: $(NFPM)
	CGO_ENABLED=1 $(GO) build -trimpath -o bin/pvrdma-backend ./cmd/pvrdma-backend
	mkdir -p $(DIST)
	VERSION=$(DEB_VERSION) ARCH=$$($(GO) env GOARCH) $(NFPM) package --config packaging/nfpm.yaml --packager deb --target $(DIST)/

$(VM_CACHE)/tools/nfpm-%/nfpm:
	@./scripts/nfpm.sh $* $@

nfpm: $(NFPM)

deps:
	./scripts/deps.sh

image: deps
	$(GO) run ./tests/vm/cmd/vmimage

# The packaging tests' bookworm roots: the clean root (debootstrap) and the package
# layers the tests install over it, each built once into $(VM_CACHE)/pkgroot/ under a
# directory keyed on its recipe (a changed recipe builds a new one).
roots: deps
	$(GO) run ./tests/packaging/cmd/pkgroots

# Everything the tests take from the cache, built side by side where missing (the image
# and the roots mostly download and unpack, nfpm compiles); a warm cache costs a few
# seconds. Each part is built under a lock and renamed into place when complete, so that
# a test that needs a part before it is ready waits for it (or builds it itself).
testbed: deps
	@$(MAKE) --no-print-directory -j3 image roots nfpm

# The test bed lock (tests/vm/testbed.lock.json) pins every package the test bed and the
# demo use. `make testbed-update` moves it to what the Debian mirror serves now and
# rewrites it only if a smoke set of VM tests passes on the new versions (KERNEL=ABI
# pins another guest kernel); `make testbed-lock` pins only what the lock lacks (after a
# package list changed). Both print what changed.
testbed-update: deps
	./scripts/testbed-update all

testbed-lock: deps
	./scripts/testbed-update missing

unit:
	$(GO) test -timeout $(UNIT_TIMEOUT) ./...

vmtest: testbed
	$(GO) test -tags vm -count=1 -p 1 -v -timeout $(VM_TIMEOUT) ./...

# Packages with VM tests (test files built with the vm tag), and the others, both computed
# from the tree. `make test` runs each test once: the other packages' tests in parallel,
# beside the VM packages, which run with the tag, their unit tests with them,
# VM_PARALLEL packages at a time, the longest first (the guests run under TCG; one
# package's guests mostly wait on another's, so two packages fill the two cores).
# tests/cmd/testrun runs both `go test -json` commands and reports as they go: each
# package as it starts and ends, each VM test as it starts and ends, every failure as it
# happens, all with the time since the start, and what is still running when nothing
# else was said for HEARTBEAT; then the packages by time, the failed tests' output and
# the closing lines (the failed tests' names, then "PASS: N passed, N failed, N skipped"
# or FAIL). Each package's whole output (go test -v) is in TESTLOG/<package>.log.
VM_PARALLEL ?= 2
VM_FIRST = ./tests/e2e/ ./tests/packaging/ ./hostverbs/soft/
VM_PKGS = $(sort $(dir $(shell grep -rl --include='*_test.go' '^//go:build vm' .)))
VM_ORDER = $(foreach p,$(VM_FIRST),$(filter $(p),$(VM_PKGS))) $(filter-out $(VM_FIRST),$(VM_PKGS))
UNIT_PKGS = $(filter-out $(VM_PKGS),$(shell $(GO) list -f '{{.Dir}}/' ./... | sed 's|^$(CURDIR)/|./|'))
TESTLOG ?= test-logs
HEARTBEAT ?= 30s
# A test that prints nothing for IDLE (its guests' consoles and output included) is taken
# as hung: testrun stops its command with the goroutines' stacks and reports it.
IDLE ?= 5m
TESTRUN_FLAGS ?=

# The test bed is built (`testbed`, a group of its own whose lines testrun prints as they
# come) while the go commands compile and the unit tests run: a cold cache's downloads
# overlap the compilation, and the VM tests wait on the parts' locks for what is not
# ready yet. The commands that build the image and the roots are compiled first, with
# testrun, so that the downloads start at once rather than after the tests' compilation.
test: deps
	@$(GO) build -o bin/ ./tests/cmd/testrun ./tests/vm/cmd/vmimage ./tests/packaging/cmd/pkgroots
	@bin/testrun -logdir $(TESTLOG) -tests vm -heartbeat $(HEARTBEAT) -idle $(IDLE) $(TESTRUN_FLAGS) \
		-run 'testbed=$(MAKE) --no-print-directory testbed' \
		-run 'unit=$(GO) test -json -count=1 -timeout $(UNIT_TIMEOUT) $(UNIT_PKGS)' \
		-run 'vm=$(GO) test -json -tags vm -count=1 -p $(VM_PARALLEL) -timeout $(VM_TIMEOUT) $(VM_ORDER)'

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

# Guests through our device vs rxe in the guest, same run, as ratios (verbs, then the
# kernel's NVMe-oF, then the two doorbell modes); then the ibverbs relay vs a plain
# libibverbs program on the same rxe device in one guest.
bench-vm: image
	$(GO) test -tags vm -run '^$$' -bench VMvsRxe -benchtime 1x -timeout 30m ./tests/e2e
	$(GO) test -tags vm -run '^$$' -bench StorageVsRxe -benchtime 1x -timeout 30m ./tests/e2e
	$(GO) test -tags vm -run '^$$' -bench Doorbells -benchtime 1x -timeout 60m ./tests/e2e
	$(GO) test -tags vm -run '^$$' -bench RelayVsPlain -benchtime 1x -timeout 30m ./hostverbs/ibverbs

# The benchmark report, docs/BENCHMARKS.md: runs the benchmarks above section by section
# (tests/benchreport/sections.go: device, wire, incast, vm, storage, doorbells, relay, scale,
# handover, hosts), each with its date, commit, machine, load average and exact command,
# and writes the figures as the benchmarks printed them. BENCH_SECTIONS=wire,scale
# regenerates only those sections (the others stay as they are). Run it on a machine
# nothing else is using.
BENCH_SECTIONS ?= all
# Is the working tree slower than the last release (the commit RELEASE names)? Alternated
# pairs of the guests' and the soft transport's benchmarks, a table, exit 1 on a regression
# or a failed run (docs/DEVELOPING.md). GUARD_PAIRS pairs per benchmark; GUARD_FLAGS more
# options (--slow-candidate, --candidate REV, -s guest); needs a quiet machine.
GUARD_PAIRS ?= 5
GUARD_FLAGS ?=
bench-guard: image
	./scripts/bench-guard -n $(GUARD_PAIRS) $(GUARD_FLAGS)

bench-report: deps
	$(GO) run ./tests/benchreport -sections '$(BENCH_SECTIONS)' -report docs/BENCHMARKS.md -raw out/bench

check:
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt -l:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) vet -tags vm ./...
	@command -v staticcheck >/dev/null || $(GO) install honnef.co/go/tools/cmd/staticcheck@latest
	staticcheck ./...
	staticcheck -tags vm ./...

# Removes the test bed's cache: the VM image, the packaging tests' roots and nfpm (the
# next `make testbed` rebuilds them).
clean-cache:
	$(GO) run ./tests/vm/cmd/vmimage -print-dir | xargs -r rm -rf

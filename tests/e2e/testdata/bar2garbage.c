/*
 * bar2garbage: a hostile root process in a guest. Built on the host at test
 * time (static) and run in a guest (tests/e2e TestMemoryDoorbellsGarbage).
 *
 *   bar2garbage -r /sys/bus/pci/devices/BDF/resource2 [-p] [-t SECONDS]
 *
 * It maps the PVRDMA device's UAR BAR (BAR2: 512 pages, one per context;
 * the doorbell words of a page are the QP word at 0, the CQ word at 4 and
 * the SRQ word at 8) through the PCI resource file and prints
 *   bar2garbage: mapped SIZE bytes
 * or "bar2garbage: mmap: ERROR" (exit 1). With -p it stops there (a probe
 * of what the guest kernel allows). Otherwise it writes garbage to pages
 * 1 to 511 (never page 0, the kernel's) until killed or SECONDS pass:
 * sweeps over every page, each sweep one kind of garbage in the three
 * doorbell words and a few random words elsewhere in the page:
 *   - random words;
 *   - small handles (0 to 63: the objects a guest has, its own or another
 *     context's) with every combination of the kind bits (29 to 31);
 *   - every value of the top byte over a random handle, and the extremes
 *     (all ones, the kind bits alone, the handle mask alone).
 * Never a zero word: a zero store can only cancel a doorbell of the same
 * guest the device has not seen yet (the guest hurting itself, as its root
 * can in many ways); what is tested is that nonzero garbage is counted and
 * confined. After every sweep it sleeps a millisecond (the guest has one
 * vCPU, which the victim application shares). At the end it prints
 *   bar2garbage: sweeps=N stores=M
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096
#define PAGES 512

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
	(void)sig;
	stop = 1;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (uint32_t)(rng >> 16);
}

static uint32_t nonzero(uint32_t v)
{
	return v ? v : 0x80000000u;
}

int main(int argc, char **argv)
{
	const char *res = NULL;
	int probe = 0, secs = 600, c;
	while ((c = getopt(argc, argv, "r:pt:")) != -1) {
		switch (c) {
		case 'r': res = optarg; break;
		case 'p': probe = 1; break;
		case 't': secs = atoi(optarg); break;
		default: return 2;
		}
	}
	if (!res) {
		fprintf(stderr, "usage: bar2garbage -r RESOURCE_FILE [-p] [-t SECONDS]\n");
		return 2;
	}
	int fd = open(res, O_RDWR | O_SYNC);
	if (fd < 0) {
		printf("bar2garbage: open %s: %s\n", res, strerror(errno));
		return 1;
	}
	struct stat st;
	if (fstat(fd, &st) < 0 || st.st_size < PAGES * PAGE) {
		printf("bar2garbage: %s: size %lld, want %d\n", res, (long long)st.st_size, PAGES * PAGE);
		return 1;
	}
	volatile uint32_t *bar = mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (bar == MAP_FAILED) {
		printf("bar2garbage: mmap: %s\n", strerror(errno));
		return 1;
	}
	printf("bar2garbage: mapped %d bytes\n", PAGES * PAGE);
	fflush(stdout);
	if (probe)
		return 0;
	signal(SIGTERM, on_signal);
	signal(SIGINT, on_signal);
	rng ^= (uint64_t)time(NULL) * 0x2545f4914f6cdd1dull;
	time_t end = time(NULL) + secs;
	unsigned long sweeps = 0, stores = 0;
	static const uint32_t extremes[] = {0xffffffffu, 0x80000000u, 0x40000000u, 0x20000000u,
					    0xe0000000u, 0x00ffffffu, 0x00fffffeu, 0x01000000u};
	while (!stop && time(NULL) < end) {
		unsigned kind = sweeps % 4;
		for (int p = 1; p < PAGES && !stop; p++) {
			volatile uint32_t *w = bar + p * (PAGE / 4);
			for (int off = 0; off < 3; off++) {
				uint32_t v;
				switch (kind) {
				case 0: v = rnd(); break;
				case 1: v = ((rnd() & 7u) << 29) | (rnd() & 63u); break;
				case 2: v = ((sweeps / 4 + (unsigned)p + (unsigned)off) & 0xffu) << 24 | (rnd() & 0xffffffu); break;
				default: v = extremes[(sweeps / 4 + (unsigned)p + (unsigned)off) % 8]; break;
				}
				w[off] = nonzero(v);
				stores++;
			}
			/* Elsewhere in the page: bytes the device must ignore. */
			for (int i = 0; i < 2; i++) {
				w[3 + rnd() % (PAGE / 4 - 3)] = nonzero(rnd());
				stores++;
			}
		}
		sweeps++;
		usleep(1000);
	}
	printf("bar2garbage: sweeps=%lu stores=%lu\n", sweeps, stores);
	return 0;
}

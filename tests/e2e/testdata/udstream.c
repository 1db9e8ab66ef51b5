/*
 * udstream: two processes stream small UD datagrams at each other, both ways at
 * once, and check every receive completion. Built on the host at test time and
 * run in two guests (tests/e2e TestUDStream).
 *
 *   udstream -d DEV -g GIDX [-p PORT] [-n COUNT] [-s SIZE] [-r RXDEPTH]
 *            [-t TXDEPTH] [-m SIGNAL_EVERY] [-c] [-1] [-R RECVS]
 *            [-T STALL_SECONDS] [SERVER]
 *
 * Without SERVER it listens on PORT (TCP, for the exchange of QPN and GID), with
 * it it connects. Each side posts RXDEPTH receives, then sends COUNT datagrams of
 * SIZE bytes (each carrying its sequence number), signaling every SIGNAL_EVERY-th,
 * with at most TXDEPTH in flight, reposting each receive as it completes. With -c
 * a side sends only while the peer has a receive posted for the datagram (the
 * peer's reposts are reported over the TCP connection): nothing can be dropped
 * for want of a receive, so every datagram must arrive. -1 uses one CQ for sends
 * and receives (default: one each). -R (not with -c) caps the receives a side
 * posts in all, the first RXDEPTH included, at RECVS: it reposts until it has
 * posted RECVS, then none, so with COUNT > RECVS at least COUNT - RECVS of the
 * peer's datagrams find no receive and are lost, however fast either side runs.
 *
 * Every receive completion must be successful, an IBV_WC_RECV of 40 + SIZE bytes
 * with wc_flags exactly IBV_WC_GRH, from the peer's QPN, with a sequence number
 * not seen before. It prints
 *   udstream: sent N recv N dup 0 flags 0x1 OK
 * and exits 0 once it has sent COUNT and received COUNT (or, without -c, received
 * what it will: the peer is done and nothing arrived for a second); it prints
 * "udstream: STALL ..." and exits 2 if no completion comes for STALL_SECONDS
 * while it still waits for one, and "udstream: FAIL ..." and exits 1 on any
 * other error.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define QKEY 0x11111111u
#define GRH 40

struct info {
	uint32_t qpn, rxdepth;
	uint8_t gid[16];
} __attribute__((packed));

static struct {
	const char *dev, *server;
	int gidx, port, count, size, rxdepth, txdepth, every, credits, onecq, stall, recvs;
} o = {.gidx = -1, .port = 18600, .count = 5000, .size = 64, .rxdepth = 64, .txdepth = 32, .every = 8, .stall = 20};

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *scq, *rcq;
static struct ibv_qp *qp;
static struct ibv_ah *ah;
static struct ibv_mr *mr;
static uint8_t *buf; /* rxdepth receive slots, then txdepth send slots */
static int sock;
static uint32_t peer_qpn;

static void fail(const char *fmt, const char *what, long v)
{
	fprintf(stdout, "udstream: FAIL ");
	fprintf(stdout, fmt, what, v);
	fprintf(stdout, "\n");
	exit(1);
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static size_t rslot(int i) { return (size_t)i * (GRH + o.size); }
static size_t sslot(int i) { return rslot(o.rxdepth) + (size_t)i * o.size; }

static void post_recv(int i)
{
	struct ibv_sge sge = {.addr = (uintptr_t)buf + rslot(i), .length = GRH + o.size, .lkey = mr->lkey};
	struct ibv_recv_wr wr = {.wr_id = i, .sg_list = &sge, .num_sge = 1}, *bad;
	if (ibv_post_recv(qp, &wr, &bad))
		fail("%s %ld", "ibv_post_recv", errno);
}

static void post_send(uint32_t seq, int signaled)
{
	int i = seq % o.txdepth;
	memcpy(buf + sslot(i), &seq, sizeof(seq));
	struct ibv_sge sge = {.addr = (uintptr_t)buf + sslot(i), .length = o.size, .lkey = mr->lkey};
	struct ibv_send_wr wr = {.wr_id = seq, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				 .send_flags = signaled ? IBV_SEND_SIGNALED : 0}, *bad;
	wr.wr.ud.ah = ah;
	wr.wr.ud.remote_qpn = peer_qpn;
	wr.wr.ud.remote_qkey = QKEY;
	if (ibv_post_send(qp, &wr, &bad))
		fail("%s %ld", "ibv_post_send", errno);
}

static void xfer(void *b, size_t n, int out)
{
	uint8_t *p = b;
	while (n > 0) {
		ssize_t r = out ? write(sock, p, n) : read(sock, p, n);
		if (r <= 0)
			fail("%s %ld", out ? "tcp write" : "tcp read", r < 0 ? errno : 0);
		p += r;
		n -= r;
	}
}

static void connect_tcp(void)
{
	struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *res;
	char port[16];
	snprintf(port, sizeof(port), "%d", o.port);
	if (getaddrinfo(o.server, port, &hints, &res))
		fail("%s %ld", "getaddrinfo", 0);
	int s = socket(res->ai_family, res->ai_socktype, 0);
	if (o.server) {
		if (connect(s, res->ai_addr, res->ai_addrlen)) {
			/* pvt_retry retries this message until the server listens. */
			printf("udstream: couldn't connect to %s:%d\n", o.server, o.port);
			exit(1);
		}
		sock = s;
	} else {
		int one = 1;
		setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
		if (bind(s, res->ai_addr, res->ai_addrlen) || listen(s, 1))
			fail("%s %ld", "bind/listen", errno);
		sock = accept(s, NULL, NULL);
		if (sock < 0)
			fail("%s %ld", "accept", errno);
		close(s);
	}
	freeaddrinfo(res);
}

static void setup(void)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n), *dev = NULL;
	for (int i = 0; list && i < n; i++)
		if (!strcmp(ibv_get_device_name(list[i]), o.dev))
			dev = list[i];
	if (!dev)
		fail("%s %ld", "no such device", 0);
	ctx = ibv_open_device(dev);
	pd = ctx ? ibv_alloc_pd(ctx) : NULL;
	if (!pd)
		fail("%s %ld", "open device / alloc pd", errno);
	size_t len = sslot(o.txdepth);
	buf = aligned_alloc(4096, (len + 4095) & ~4095ul);
	memset(buf, 0, len);
	mr = ibv_reg_mr(pd, buf, len, IBV_ACCESS_LOCAL_WRITE);
	scq = ibv_create_cq(ctx, o.rxdepth + o.txdepth, NULL, NULL, 0);
	rcq = o.onecq ? scq : ibv_create_cq(ctx, o.rxdepth, NULL, NULL, 0);
	if (!mr || !scq || !rcq)
		fail("%s %ld", "reg mr / create cq", errno);
	struct ibv_qp_init_attr qa = {.send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_UD,
				      .cap = {.max_send_wr = o.txdepth, .max_recv_wr = o.rxdepth, .max_send_sge = 1, .max_recv_sge = 1}};
	qp = ibv_create_qp(pd, &qa);
	if (!qp)
		fail("%s %ld", "create qp", errno);
	struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = QKEY};
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))
		fail("%s %ld", "modify INIT", errno);
	a.qp_state = IBV_QPS_RTR;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE))
		fail("%s %ld", "modify RTR", errno);
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = 0;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN))
		fail("%s %ld", "modify RTS", errno);
	for (int i = 0; i < o.rxdepth; i++)
		post_recv(i);
}

int main(int argc, char **argv)
{
	int c;
	while ((c = getopt(argc, argv, "d:g:p:n:s:r:t:m:c1R:T:")) != -1) {
		switch (c) {
		case 'd': o.dev = optarg; break;
		case 'g': o.gidx = atoi(optarg); break;
		case 'p': o.port = atoi(optarg); break;
		case 'n': o.count = atoi(optarg); break;
		case 's': o.size = atoi(optarg); break;
		case 'r': o.rxdepth = atoi(optarg); break;
		case 't': o.txdepth = atoi(optarg); break;
		case 'm': o.every = atoi(optarg); break;
		case 'c': o.credits = 1; break;
		case '1': o.onecq = 1; break;
		case 'R': o.recvs = atoi(optarg); break;
		case 'T': o.stall = atoi(optarg); break;
		default: return 2;
		}
	}
	if (optind < argc)
		o.server = argv[optind];
	if (!o.dev || o.gidx < 0 || o.size < 4 || o.every < 1 || o.txdepth < o.every || o.rxdepth < 1 ||
	    o.recvs < 0 || (o.recvs && (o.credits || o.recvs < o.rxdepth)))
		fail("%s %ld", "usage", 0);
	setvbuf(stdout, NULL, _IOLBF, 0);

	setup();
	connect_tcp();
	struct info me = {.qpn = qp->qp_num, .rxdepth = o.rxdepth}, peer;
	union ibv_gid gid;
	if (ibv_query_gid(ctx, 1, o.gidx, &gid))
		fail("%s %ld", "query gid", errno);
	memcpy(me.gid, gid.raw, 16);
	xfer(&me, sizeof(me), 1);
	xfer(&peer, sizeof(peer), 0);
	peer_qpn = peer.qpn;
	struct ibv_ah_attr aa = {.is_global = 1, .port_num = 1, .grh = {.sgid_index = o.gidx, .hop_limit = 64}};
	memcpy(aa.grh.dgid.raw, peer.gid, 16);
	ah = ibv_create_ah(pd, &aa);
	if (!ah)
		fail("%s %ld", "create ah", errno);
	char go = 'g';
	xfer(&go, 1, 1); /* both sides' receives are posted */
	xfer(&go, 1, 0);
	fcntl(sock, F_SETFL, O_NONBLOCK);

	uint32_t sent = 0, sdone = 0, recvd = 0, dups = 0, badflags = 0, flags = 0;
	uint64_t granted = peer.rxdepth; /* datagrams the peer has a receive for */
	uint32_t reposted = 0, reported = 0;
	uint32_t posted = o.rxdepth; /* receives posted in all */
	uint8_t *seen = calloc(o.count, 1);
	double last = now(), quiet = 0;
	int peer_done = 0, done_sent = 0;
	struct ibv_wc wc[64];
	uint8_t gbuf[64];
	size_t gfill = 0;

	for (;;) {
		/* Sends, as the window (and with -c the peer's receives) allow. */
		while (sent < (uint32_t)o.count && sent - sdone < (uint32_t)o.txdepth &&
		       (!o.credits || sent < granted)) {
			int signaled = (sent + 1) % o.every == 0 || sent + 1 == (uint32_t)o.count;
			post_send(sent, signaled);
			sent++;
		}
		int progress = 0;
		struct ibv_cq *cqs[2] = {rcq, scq};
		for (int k = 0; k < (o.onecq ? 1 : 2); k++) {
			int ne = ibv_poll_cq(cqs[k], 64, wc);
			if (ne < 0)
				fail("%s %ld", "poll cq", ne);
			for (int i = 0; i < ne; i++) {
				progress = 1;
				if (wc[i].status != IBV_WC_SUCCESS) {
					printf("udstream: FAIL completion status %s opcode %d wr_id %lu\n",
					       ibv_wc_status_str(wc[i].status), wc[i].opcode, (unsigned long)wc[i].wr_id);
					exit(1);
				}
				if (wc[i].opcode == IBV_WC_SEND) {
					uint32_t upto = (uint32_t)wc[i].wr_id + 1;
					if (upto > sdone)
						sdone = upto;
					continue;
				}
				if (wc[i].opcode != IBV_WC_RECV)
					fail("%s %ld", "unexpected opcode", wc[i].opcode);
				int slot = (int)wc[i].wr_id;
				uint32_t seq;
				memcpy(&seq, buf + rslot(slot) + GRH, sizeof(seq));
				if (wc[i].byte_len != (uint32_t)(GRH + o.size) || wc[i].src_qp != peer_qpn || seq >= (uint32_t)o.count) {
					printf("udstream: FAIL receive byte_len %u src_qp %#x seq %u\n", wc[i].byte_len, wc[i].src_qp, seq);
					exit(1);
				}
				flags |= wc[i].wc_flags;
				if (wc[i].wc_flags != IBV_WC_GRH)
					badflags++;
				if (seen[seq])
					dups++;
				seen[seq] = 1;
				recvd++;
				if (o.recvs && posted >= (uint32_t)o.recvs)
					continue; /* -R: no more receives */
				post_recv(slot);
				posted++;
				reposted++;
			}
		}
		/* With -c, tell the peer about our reposts (a cumulative count). */
		if (o.credits && reposted - reported >= (uint32_t)(o.rxdepth + 3) / 4) {
			uint32_t v = reposted;
			if (write(sock, &v, 4) == 4)
				reported = reposted;
		}
		/* From the peer: its reposts (4 bytes each), or 'D' once it is done. */
		for (;;) {
			ssize_t r = read(sock, gbuf + gfill, sizeof(gbuf) - gfill);
			if (r <= 0)
				break;
			gfill += r;
			size_t k = 0;
			while (gfill - k >= 4) {
				uint32_t v;
				memcpy(&v, gbuf + k, 4);
				if (v == 0xffffffffu)
					peer_done = 1;
				else if ((uint64_t)v + peer.rxdepth > granted)
					granted = (uint64_t)v + peer.rxdepth, progress = 1;
				k += 4;
			}
			memmove(gbuf, gbuf + k, gfill - k);
			gfill -= k;
		}
		double t = now();
		if (progress)
			last = t, quiet = 0;
		int mine = sent == (uint32_t)o.count && sdone == sent;
		if (mine && !done_sent) {
			uint32_t v = 0xffffffffu;
			int fl = fcntl(sock, F_GETFL);
			fcntl(sock, F_SETFL, fl & ~O_NONBLOCK);
			if (o.credits && reposted != reported) {
				uint32_t r2 = reposted;
				xfer(&r2, 4, 1);
				reported = reposted;
			}
			xfer(&v, 4, 1);
			fcntl(sock, F_SETFL, fl);
			done_sent = 1;
		}
		if (mine && recvd == (uint32_t)o.count)
			break;
		if (mine && peer_done && !o.credits) {
			/* Lossy: once the peer is done, what has not come in a second will not. */
			if (quiet == 0)
				quiet = t;
			if (t - quiet > 1)
				break;
		}
		if (t - last > o.stall) {
			printf("udstream: STALL sent %u send_completed %u recv %u granted %lu peer_done %d (no completion for %d s)\n",
			       sent, sdone, recvd, (unsigned long)granted, peer_done, o.stall);
			exit(2);
		}
	}
	printf("udstream: sent %u recv %u dup %u flags %#x badflags %u %s\n", sent, recvd, dups, flags, badflags,
	       recvd == (uint32_t)o.count && !dups && !badflags ? "OK" : "LOSS");
	/* Wait for the peer's 'done' before the QP goes: it may still be sending. */
	int fl = fcntl(sock, F_GETFL);
	fcntl(sock, F_SETFL, fl & ~O_NONBLOCK);
	while (!peer_done) {
		uint32_t v;
		xfer(&v, 4, 0);
		if (v == 0xffffffffu)
			peer_done = 1;
	}
	/*
	 * Close in order: the peer may still report reposts after its 'done'.
	 * A socket closed with unread data sends a reset, which can discard
	 * what the peer has not read yet (our 'done'), so each side stops
	 * writing, then reads until the other has stopped too.
	 */
	if (shutdown(sock, SHUT_WR))
		fail("%s %ld", "tcp shutdown", errno);
	for (;;) {
		char drain[256];
		ssize_t r = read(sock, drain, sizeof(drain));
		if (r == 0)
			break;
		if (r < 0 && errno != EINTR)
			fail("%s %ld", "tcp read at close", errno);
	}
	return recvd == (uint32_t)o.count && !dups && !badflags ? 0 : 3;
}

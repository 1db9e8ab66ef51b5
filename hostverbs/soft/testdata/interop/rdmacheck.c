/*
 * rdmacheck: the guest side of the soft transport's interop test. It
 * connects an RC QP to a peer (our Go fabric) over a small TCP exchange and
 * checks RDMA WRITE, RDMA READ, ATOMIC FETCH_ADD and CMP_SWAP by content in
 * both directions:
 *
 *   phase A: this side WRITEs, READs and runs atomics on the peer's memory,
 *            then SENDs "A-DONE"; the peer checks its memory.
 *   phase B: the peer does the same on this side's memory and SENDs
 *            "B-DONE"; this side checks and SENDs "C-OK" or "C-BAD".
 *
 * Exchange (TCP, little-endian): struct info from the client, then the
 * server's. Usage: rdmacheck SERVER PORT DEVICE GIDINDEX
 */
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

struct info {
	uint32_t qpn, psn, rkey, pad;
	uint64_t addr;
	uint8_t gid[16];
} __attribute__((packed));

enum {
	BUF = 4 << 20,
	WRITE_AREA = 0,          /* the peer writes here */
	READ_AREA = 1 << 20,     /* the peer reads from here */
	COUNTER = 2 << 20,       /* the peer's atomics target */
	SCRATCH = 3 << 20,       /* our own source / sink */
	MSG = (4 << 20) - 4096,  /* SEND / RECV messages */
	LEN = 256 << 10,
};

static uint8_t pat(unsigned seed, size_t i) { return (uint8_t)(i * seed + seed / 2); }

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static struct ibv_qp *qp;
static struct ibv_mr *mr;
static uint8_t *buf;

static int die(const char *what)
{
	fprintf(stderr, "rdmacheck: FAIL %s\n", what);
	exit(1);
}

static void wait_wc(uint64_t wrid, struct ibv_wc *out)
{
	struct ibv_wc wc;
	time_t end = time(NULL) + 30;
	for (;;) {
		int n = ibv_poll_cq(cq, 1, &wc);
		if (n < 0)
			die("poll cq");
		if (n == 1) {
			if (wc.status != IBV_WC_SUCCESS) {
				fprintf(stderr, "rdmacheck: wr %llu status %s (%d) opcode %d\n",
					(unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status),
					wc.status, wc.opcode);
				die("completion");
			}
			if (wc.wr_id == wrid) {
				if (out)
					*out = wc;
				return;
			}
			continue;
		}
		if (time(NULL) > end)
			die("timeout waiting for a completion");
	}
}

static void post(enum ibv_wr_opcode op, uint64_t wrid, size_t off, uint32_t len,
		 uint64_t raddr, uint32_t rkey, uint64_t cmp_add, uint64_t swap, uint32_t imm)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf + off, .length = len, .lkey = mr->lkey };
	struct ibv_send_wr wr = { .wr_id = wrid, .sg_list = &sge, .num_sge = 1, .opcode = op,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	if (op == IBV_WR_ATOMIC_FETCH_AND_ADD || op == IBV_WR_ATOMIC_CMP_AND_SWP) {
		wr.wr.atomic.remote_addr = raddr;
		wr.wr.atomic.rkey = rkey;
		wr.wr.atomic.compare_add = cmp_add;
		wr.wr.atomic.swap = swap;
	} else {
		wr.wr.rdma.remote_addr = raddr;
		wr.wr.rdma.rkey = rkey;
	}
	wr.imm_data = htonl(imm);
	if (ibv_post_send(qp, &wr, &bad))
		die("post send");
}

static void post_recv(uint64_t wrid)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf + MSG, .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = wrid, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(qp, &wr, &bad))
		die("post recv");
}

static void send_msg(const char *m, uint64_t wrid)
{
	memset(buf + MSG + 64, 0, 16);
	strcpy((char *)buf + MSG + 64, m);
	post(IBV_WR_SEND, wrid, MSG + 64, 16, 0, 0, 0, 0, 0);
	wait_wc(wrid, NULL);
}

int main(int argc, char **argv)
{
	if (argc != 5) {
		fprintf(stderr, "usage: rdmacheck SERVER PORT DEVICE GIDINDEX\n");
		return 2;
	}
	int gidx = atoi(argv[4]);
	struct ibv_device **list = ibv_get_device_list(NULL), *dev = NULL;
	for (int i = 0; list && list[i]; i++)
		if (!strcmp(ibv_get_device_name(list[i]), argv[3]))
			dev = list[i];
	if (!dev)
		die("no such device");
	if (!(ctx = ibv_open_device(dev)) || !(pd = ibv_alloc_pd(ctx)) ||
	    !(cq = ibv_create_cq(ctx, 64, NULL, NULL, 0)))
		die("device setup");
	buf = aligned_alloc(4096, BUF);
	memset(buf, 0, BUF);
	for (size_t i = 0; i < LEN; i++)
		buf[READ_AREA + i] = pat(13, i);
	*(uint64_t *)(buf + COUNTER) = 1000;
	mr = ibv_reg_mr(pd, buf, BUF, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
			IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 } };
	if (!mr || !(qp = ibv_create_qp(pd, &ia)))
		die("mr/qp");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
		.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		die("init");
	for (int i = 0; i < 4; i++)
		post_recv(100 + i);

	struct info me = { .qpn = qp->qp_num, .psn = (uint32_t)(getpid() * 2654435761u) & 0xffffff,
			   .rkey = mr->rkey, .addr = (uintptr_t)buf }, peer;
	union ibv_gid g;
	if (ibv_query_gid(ctx, 1, gidx, &g))
		die("query gid");
	memcpy(me.gid, g.raw, 16);

	struct addrinfo *res, hints = { .ai_family = AF_INET, .ai_socktype = SOCK_STREAM };
	if (getaddrinfo(argv[1], argv[2], &hints, &res))
		die("resolve");
	int s = socket(AF_INET, SOCK_STREAM, 0);
	if (s < 0 || connect(s, res->ai_addr, res->ai_addrlen))
		die("connect");
	if (write(s, &me, sizeof me) != sizeof me || read(s, &peer, sizeof peer) != sizeof peer)
		die("exchange");
	close(s);

	struct ibv_qp_attr r = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024,
		.dest_qp_num = peer.qpn, .rq_psn = peer.psn, .max_dest_rd_atomic = 4, .min_rnr_timer = 12,
		.ah_attr = { .is_global = 1, .port_num = 1,
			     .grh = { .hop_limit = 64, .sgid_index = gidx } } };
	memcpy(r.ah_attr.grh.dgid.raw, peer.gid, 16);
	if (ibv_modify_qp(qp, &r, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
			  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		die("rtr");
	struct ibv_qp_attr t = { .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7,
		.rnr_retry = 7, .sq_psn = me.psn, .max_rd_atomic = 4 };
	if (ibv_modify_qp(qp, &t, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
			  IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		die("rts");
	printf("rdmacheck: connected qpn %#x to peer qpn %#x\n", qp->qp_num, peer.qpn);

	/* Phase A: operate on the peer's memory. */
	for (size_t i = 0; i < LEN; i++)
		buf[SCRATCH + i] = pat(7, i);
	post(IBV_WR_RDMA_WRITE, 1, SCRATCH, LEN, peer.addr + WRITE_AREA, peer.rkey, 0, 0, 0);
	wait_wc(1, NULL);
	printf("rdmacheck: A write ok\n");
	memset(buf + SCRATCH, 0, LEN);
	post(IBV_WR_RDMA_READ, 2, SCRATCH, LEN, peer.addr + READ_AREA, peer.rkey, 0, 0, 0);
	wait_wc(2, NULL);
	for (size_t i = 0; i < LEN; i++)
		if (buf[SCRATCH + i] != pat(11, i)) {
			fprintf(stderr, "rdmacheck: read byte %zu is %#x, want %#x\n", i, buf[SCRATCH + i], pat(11, i));
			die("A read content");
		}
	printf("rdmacheck: A read ok\n");
	post(IBV_WR_ATOMIC_FETCH_AND_ADD, 3, SCRATCH, 8, peer.addr + COUNTER, peer.rkey, 7, 0, 0);
	wait_wc(3, NULL);
	if (*(uint64_t *)(buf + SCRATCH) != 5000)
		die("A fetch_add old value");
	post(IBV_WR_ATOMIC_CMP_AND_SWP, 4, SCRATCH + 8, 8, peer.addr + COUNTER, peer.rkey, 5007, 42, 0);
	wait_wc(4, NULL);
	if (*(uint64_t *)(buf + SCRATCH + 8) != 5007)
		die("A cmp_swap old value");
	printf("rdmacheck: A atomics ok\n");
	post(IBV_WR_RDMA_WRITE_WITH_IMM, 5, SCRATCH, 64, peer.addr + WRITE_AREA + LEN, peer.rkey, 0, 0, 0x12345678);
	wait_wc(5, NULL);
	send_msg("A-DONE", 6);
	printf("rdmacheck: A done\n");

	/* Phase B: the peer operates on ours, then tells us. */
	struct ibv_wc wc;
	wait_wc(100, &wc);
	if (strcmp((char *)buf + MSG, "B-DONE"))
		die("B message");
	int ok = 1;
	for (size_t i = 0; i < LEN; i++)
		if (buf[WRITE_AREA + i] != pat(17, i)) {
			fprintf(stderr, "rdmacheck: written byte %zu is %#x, want %#x\n", i, buf[WRITE_AREA + i], pat(17, i));
			ok = 0;
			break;
		}
	uint64_t c = *(uint64_t *)(buf + COUNTER);
	if (c != 77) {
		fprintf(stderr, "rdmacheck: counter %llu, want 77\n", (unsigned long long)c);
		ok = 0;
	}
	send_msg(ok ? "C-OK" : "C-BAD", 7);
	if (!ok)
		die("B content");
	printf("rdmacheck: B write, read source and atomics ok\n");
	printf("rdmacheck: ALL OK\n");
	return 0;
}

/*
 * doorbells: what a doorbell costs, and whether any is lost. Built on the host
 * at test time and run in a guest (tests/e2e TestDoorbells).
 *
 *   doorbells -d DEV [-n POLLS] [-g GIDX -p PAIRS -r ROUNDS]
 *
 * First it polls an empty CQ POLLS times (each poll of the stock providers
 * rings the CQ doorbell: PVRDMA_UAR_CQ_POLL) and prints
 *   doorbells: DEV empty_poll n=POLLS ns_per_poll=NS
 * With -p it then connects PAIRS loopback RC QP pairs of one context (GID
 * index GIDX), each receive on a CQ of its own with one completion channel,
 * and runs ROUNDS rounds: post a receive on every pair, arm every receive CQ
 * back to back (so that, with doorbells in memory, the arms overwrite each
 * other), send on every pair while busy-polling the send CQs (more CQ
 * doorbells), and wait for an event of every receive CQ, polling a CQ only
 * after its event. An event that brings no CQE is counted as spurious (the
 * CQ is armed again). It prints
 *   doorbells: DEV events pairs=P rounds=R spurious=S OK
 * and exits 0, or "doorbells: FAIL ..." and exits 1 (an event that does not
 * come in 20 s is a lost arm).
 */
#include <errno.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAXP 64

static void fail(const char *what, int err)
{
	printf("doorbells: FAIL %s: %s\n", what, strerror(err));
	exit(1);
}

static double now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv)
{
	const char *dev = NULL;
	int n = 20000, gidx = -1, pairs = 0, rounds = 0, c;
	while ((c = getopt(argc, argv, "d:n:g:p:r:")) != -1) {
		switch (c) {
		case 'd': dev = optarg; break;
		case 'n': n = atoi(optarg); break;
		case 'g': gidx = atoi(optarg); break;
		case 'p': pairs = atoi(optarg); break;
		case 'r': rounds = atoi(optarg); break;
		default: return 2;
		}
	}
	if (!dev || pairs > MAXP || (pairs > 0 && (gidx < 0 || rounds <= 0)))
		return 2;
	int num;
	struct ibv_device **list = ibv_get_device_list(&num);
	struct ibv_context *ctx = NULL;
	for (int i = 0; list && i < num; i++)
		if (!strcmp(ibv_get_device_name(list[i]), dev))
			ctx = ibv_open_device(list[i]);
	if (!ctx)
		fail("open device", ENODEV);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	if (!pd || !cq)
		fail("pd/cq", errno);

	struct ibv_wc wc[4];
	for (int i = 0; i < 100; i++) /* warm up */
		ibv_poll_cq(cq, 1, wc);
	double t0 = now_ns();
	for (int i = 0; i < n; i++)
		if (ibv_poll_cq(cq, 1, wc) != 0)
			fail("empty CQ not empty", EINVAL);
	double t1 = now_ns();
	printf("doorbells: %s empty_poll n=%d ns_per_poll=%.0f\n", dev, n, (t1 - t0) / n);
	fflush(stdout);
	if (pairs == 0)
		return 0;

	union ibv_gid gid;
	if (ibv_query_gid(ctx, 1, gidx, &gid))
		fail("query gid", errno);
	static char buf[MAXP * 2 * 64];
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	if (!mr || !ch)
		fail("mr/channel", errno);
	struct ibv_cq *scq[MAXP], *rcq[MAXP];
	struct ibv_qp *qa[MAXP], *qb[MAXP];
	for (int i = 0; i < pairs; i++) {
		scq[i] = ibv_create_cq(ctx, 16, NULL, NULL, 0);
		rcq[i] = ibv_create_cq(ctx, 16, (void *)(intptr_t)i, ch, 0);
		if (!scq[i] || !rcq[i])
			fail("create cq", errno);
		struct ibv_qp_init_attr ia = {.send_cq = scq[i], .recv_cq = rcq[i], .qp_type = IBV_QPT_RC,
			.cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1}};
		qa[i] = ibv_create_qp(pd, &ia);
		qb[i] = ibv_create_qp(pd, &ia);
		if (!qa[i] || !qb[i])
			fail("create qp", errno);
	}
	for (int i = 0; i < 2 * pairs; i++) {
		struct ibv_qp *q = i < pairs ? qa[i] : qb[i - pairs];
		struct ibv_qp *peer = i < pairs ? qb[i] : qa[i - pairs];
		struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = IBV_ACCESS_LOCAL_WRITE};
		if (ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
			fail("INIT", errno);
		memset(&a, 0, sizeof(a));
		a.qp_state = IBV_QPS_RTR;
		a.path_mtu = IBV_MTU_1024;
		a.dest_qp_num = peer->qp_num;
		a.max_dest_rd_atomic = 1;
		a.min_rnr_timer = 12;
		a.ah_attr.is_global = 1;
		a.ah_attr.grh.dgid = gid;
		a.ah_attr.grh.sgid_index = gidx;
		a.ah_attr.grh.hop_limit = 1;
		a.ah_attr.port_num = 1;
		if (ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
			fail("RTR", errno);
		memset(&a, 0, sizeof(a));
		a.qp_state = IBV_QPS_RTS;
		a.timeout = 14;
		a.retry_cnt = 7;
		a.rnr_retry = 7;
		a.max_rd_atomic = 1;
		if (ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
					     IBV_QP_MAX_QP_RD_ATOMIC))
			fail("RTS", errno);
	}
	long spurious = 0;
	double e0 = now_ns();
	for (int r = 0; r < rounds; r++) {
		int done[MAXP] = {0}, left = pairs;
		for (int i = 0; i < pairs; i++) {
			struct ibv_sge s = {.addr = (uintptr_t)buf + (pairs + i) * 64, .length = 64, .lkey = mr->lkey};
			struct ibv_recv_wr wr = {.wr_id = i, .sg_list = &s, .num_sge = 1}, *bad;
			if (ibv_post_recv(qb[i], &wr, &bad))
				fail("post recv", errno);
		}
		for (int i = 0; i < pairs; i++) /* back to back: one UAR word */
			if (ibv_req_notify_cq(rcq[i], 0))
				fail("arm", errno);
		for (int i = 0; i < pairs; i++) {
			struct ibv_sge s = {.addr = (uintptr_t)buf + i * 64, .length = 64, .lkey = mr->lkey};
			struct ibv_send_wr wr = {.wr_id = i, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_SEND,
				.send_flags = IBV_SEND_SIGNALED}, *bad;
			if (ibv_post_send(qa[i], &wr, &bad))
				fail("post send", errno);
		}
		for (int i = 0; i < pairs; i++) {
			double w0 = now_ns();
			int k;
			while ((k = ibv_poll_cq(scq[i], 1, wc)) == 0)
				if (now_ns() - w0 > 20e9)
					fail("send completion", ETIMEDOUT);
			if (k < 0 || wc[0].status != IBV_WC_SUCCESS)
				fail("send completion status", EIO);
		}
		while (left > 0) {
			struct pollfd pfd = {.fd = ch->fd, .events = POLLIN};
			if (poll(&pfd, 1, 20000) != 1) {
				for (int i = 0; i < pairs; i++)
					if (!done[i])
						printf("doorbells: FAIL round %d: no event for receive CQ %d (its CQE %s)\n", r, i,
						       ibv_poll_cq(rcq[i], 1, wc) > 0 ? "arrived" : "did not arrive");
				return 1;
			}
			struct ibv_cq *ecq;
			void *ectx;
			if (ibv_get_cq_event(ch, &ecq, &ectx))
				fail("get event", errno);
			ibv_ack_cq_events(ecq, 1);
			int i = (int)(intptr_t)ectx;
			int k = ibv_poll_cq(ecq, 1, wc);
			if (k < 0)
				fail("poll", EIO);
			if (k == 0 || done[i]) {
				spurious++;
				if (!done[i]) {
					if (ibv_req_notify_cq(ecq, 0))
						fail("re-arm", errno);
					if (ibv_poll_cq(ecq, 1, wc) == 1) /* arrived before the arm */
						goto got;
				}
				continue;
			}
		got:
			if (wc[0].status != IBV_WC_SUCCESS)
				fail("recv completion status", EIO);
			done[i] = 1;
			left--;
		}
	}
	double e1 = now_ns();
	printf("doorbells: %s events pairs=%d rounds=%d spurious=%ld us_per_round=%.0f OK\n", dev, pairs, rounds, spurious,
	       (e1 - e0) / rounds / 1e3);
	return 0;
}

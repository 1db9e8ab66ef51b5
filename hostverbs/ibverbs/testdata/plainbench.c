// plainbench: the reference for the relay's benchmark. A plain libibverbs
// program on one device, two RC QPs connected to each other through the
// port's GID (the same loopback the relay benchmark uses), measuring:
//   WRITE64K <MB/s>   64 KiB RDMA WRITEs, 16 outstanding, for -n writes
//   SEND8 <usec>      mean post-to-completion time of signaled 8 B SENDs
//                     (completion channel, like the relay; the receive CQ
//                     is polled afterwards, outside the timed part)
//   SEND8EV <usec>    the same with the receive CQ on the channel too and
//                     armed once, at creation: only its first receive
//                     raises an event (an armed CQ disarms on its event)
//   SEND8ARMED <usec> the same with the send and the receive CQ both armed
//                     at every post (an event-driven program's state)
//   SEND8MEMFD <usec> SEND8 with both MRs over a shared memfd mapping, as
//                     the relay's (guest RAM) are
//   WRITE64KTHREAD <MB/s> WRITE64K in the relay's shape: a second thread
//                     blocked on the completion channel drains and re-arms
//                     the CQ after every event while the posting thread
//                     polls after each post (what that shape costs in C)
// Each WRITE line also gives the time per write in ibv_post_send (rxe does
// the transfer inside it) and the machine's context switches per write.
// Usage: plainbench DEV GID_INDEX NWRITES NSENDS
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <pthread.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what) { perror(what); exit(1); }

static long ctxt(void) {
	FILE *f = fopen("/proc/stat", "r");
	char line[512];
	long v = -1;
	while (f && fgets(line, sizeof(line), f))
		if (sscanf(line, "ctxt %ld", &v) == 1) break;
	if (f) fclose(f);
	return v;
}

static struct ibv_qp *mkqp(struct ibv_pd *pd, struct ibv_cq *cq) {
	struct ibv_qp_init_attr ia = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = {.max_send_wr = 64, .max_recv_wr = 64, .max_send_sge = 1, .max_recv_sge = 1}};
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	if (!qp) die("create qp");
	struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1,
		.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE};
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) die("init");
	return qp;
}

static void connect_qp(struct ibv_qp *qp, uint32_t dqpn, union ibv_gid *gid, int gidx) {
	struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = dqpn,
		.rq_psn = 0, .max_dest_rd_atomic = 1, .min_rnr_timer = 1,
		.ah_attr = {.is_global = 1, .grh = {.dgid = *gid, .sgid_index = gidx, .hop_limit = 64}, .port_num = 1}};
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
			IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) die("rtr");
	a.qp_state = IBV_QPS_RTS; a.timeout = 14; a.retry_cnt = 7; a.rnr_retry = 7; a.sq_psn = 0; a.max_rd_atomic = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
			IBV_QP_MAX_QP_RD_ATOMIC)) die("rts");
}

// wait takes one completion from cq through the channel (armed before).
static void wait_one(struct ibv_comp_channel *ch, struct ibv_cq *cq, struct ibv_wc *wc) {
	for (;;) {
		int n = ibv_poll_cq(cq, 1, wc);
		if (n < 0) die("poll");
		if (n == 1) {
			if (wc->status != IBV_WC_SUCCESS) { fprintf(stderr, "wc status %d\n", wc->status); exit(1); }
			return;
		}
		struct ibv_cq *ecq; void *ctx;
		if (ibv_get_cq_event(ch, &ecq, &ctx)) die("get event");
		ibv_ack_cq_events(ecq, 1);
		if (ibv_req_notify_cq(ecq, 0)) die("arm");
	}
}

// write_run posts nw 64 KiB RDMA WRITEs from sge to dst (16 slots of 64 KiB
// under rkey), 16 outstanding, and prints the rate and where the time went.
static void write_run(const char *name, struct ibv_qp *a, struct ibv_comp_channel *ch, struct ibv_cq *cq,
		struct ibv_sge *sge, uintptr_t dst, uint32_t rkey, int nw) {
	struct ibv_send_wr wr = {.sg_list = sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED}, *bad;
	struct ibv_wc wc;
	int posted = 0, done = 0;
	long c0 = ctxt();
	double t0 = now(), inpost = 0, inwait = 0;
	while (done < nw) {
		while (posted < nw && posted - done < 16) {
			wr.wr_id = posted;
			wr.wr.rdma.remote_addr = dst + (posted % 16) * (uintptr_t)sge->length;
			wr.wr.rdma.rkey = rkey;
			double s = now();
			if (ibv_post_send(a, &wr, &bad)) die("post write");
			inpost += now() - s;
			posted++;
		}
		double s = now();
		wait_one(ch, cq, &wc);
		inwait += now() - s;
		done++;
	}
	double el = now() - t0;
	printf("%s %.1f MB/s (%d writes in %.3f s; %.1f usec in ibv_post_send, %.1f usec waiting, %.2f context switches, per write)\n",
		name, nw * (double)sge->length / el / 1e6, nw, el, inpost / nw * 1e6, inwait / nw * 1e6, (double)(ctxt() - c0) / nw);
}

// The relay's shape: a completion thread blocked on the channel drains the
// CQ and re-arms it after every event, while the posting thread also polls
// after each post; both count completions under a lock.
struct evthread {
	struct ibv_comp_channel *ch;
	struct ibv_cq *cq;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int done, stop;
};

static int ev_poll(struct evthread *e) {
	struct ibv_wc wc[16];
	int n, got = 0;
	pthread_mutex_lock(&e->mu);
	while ((n = ibv_poll_cq(e->cq, 16, wc)) > 0) {
		for (int i = 0; i < n; i++)
			if (wc[i].status != IBV_WC_SUCCESS) { fprintf(stderr, "wc status %d\n", wc[i].status); exit(1); }
		e->done += n;
		got += n;
	}
	if (got) pthread_cond_broadcast(&e->cv);
	pthread_mutex_unlock(&e->mu);
	return got;
}

static void *ev_loop(void *arg) {
	struct evthread *e = arg;
	for (;;) {
		struct ibv_cq *ecq; void *ctx;
		if (ibv_get_cq_event(e->ch, &ecq, &ctx)) return NULL;
		ibv_ack_cq_events(ecq, 1);
		if (e->stop) return NULL;
		ev_poll(e);
		if (ibv_req_notify_cq(e->cq, 0)) die("arm");
		ev_poll(e);
	}
}

static void write_thread(struct ibv_context *c, struct ibv_qp *a, struct evthread *e, struct ibv_sge *sge,
		uintptr_t dst, uint32_t rkey, int nw) {
	struct ibv_send_wr wr = {.sg_list = sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED}, *bad;
	int posted = 0;
	long c0 = ctxt();
	double t0 = now(), inpost = 0;
	for (;;) {
		pthread_mutex_lock(&e->mu);
		int done = e->done;
		while (posted - done >= 16 || (posted >= nw && done < nw)) {
			pthread_cond_wait(&e->cv, &e->mu);
			done = e->done;
		}
		pthread_mutex_unlock(&e->mu);
		if (done >= nw) break;
		wr.wr_id = posted;
		wr.wr.rdma.remote_addr = dst + (posted % 16) * (uintptr_t)sge->length;
		wr.wr.rdma.rkey = rkey;
		double s = now();
		if (ibv_post_send(a, &wr, &bad)) die("post write");
		inpost += now() - s;
		posted++;
		ev_poll(e);
	}
	double el = now() - t0;
	printf("WRITE64KTHREAD %.1f MB/s (%d writes in %.3f s; %.1f usec in ibv_post_send, %.2f context switches, per write)\n",
		nw * (double)sge->length / el / 1e6, nw, el, inpost / nw * 1e6, (double)(ctxt() - c0) / nw);
}

int main(int argc, char **argv) {
	if (argc != 5) { fprintf(stderr, "usage: %s DEV GID_INDEX NWRITES NSENDS\n", argv[0]); return 2; }
	int gidx = atoi(argv[2]), nw = atoi(argv[3]), ns = atoi(argv[4]);
	struct ibv_device **l = ibv_get_device_list(NULL);
	struct ibv_context *c = NULL;
	for (int i = 0; l && l[i]; i++)
		if (!strcmp(ibv_get_device_name(l[i]), argv[1])) c = ibv_open_device(l[i]);
	if (!c) die("open device");
	union ibv_gid gid;
	if (ibv_query_gid(c, 1, gidx, &gid)) die("query gid");
	struct ibv_pd *pd = ibv_alloc_pd(c);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(c);
	struct ibv_cq *cq = ibv_create_cq(c, 256, NULL, ch, 0), *rcq = ibv_create_cq(c, 256, NULL, NULL, 0);
	if (!pd || !ch || !cq || !rcq) die("pd/cq");
	if (ibv_req_notify_cq(cq, 0)) die("arm");
	size_t sz = 64 << 10;
	char *src = aligned_alloc(4096, sz), *dst = aligned_alloc(4096, 16 * sz);
	memset(src, 0x5a, sz);
	struct ibv_mr *smr = ibv_reg_mr(pd, src, sz, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *dmr = ibv_reg_mr(pd, dst, 16 * sz, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!smr || !dmr) die("reg mr");
	struct ibv_qp *a = mkqp(pd, cq), *b = mkqp(pd, rcq);
	connect_qp(a, b->qp_num, &gid, gidx);
	connect_qp(b, a->qp_num, &gid, gidx);

	// 64 KiB WRITEs, 16 outstanding.
	struct ibv_sge sge = {.addr = (uintptr_t)src, .length = sz, .lkey = smr->lkey};
	struct ibv_send_wr wr = {.sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED}, *bad;
	struct ibv_wc wc;
	write_run("WRITE64K", a, ch, cq, &sge, (uintptr_t)dst, dmr->rkey, nw);
	if (memcmp(dst, src, sz)) { fprintf(stderr, "WRITE data differs\n"); return 1; }

	// 8 B SENDs, post to completion, one at a time.
	struct ibv_sge rsge = {.addr = (uintptr_t)dst, .length = 64, .lkey = dmr->lkey};
	struct ibv_recv_wr rwr = {.sg_list = &rsge, .num_sge = 1}, *rbad;
	sge.length = 8;
	wr.opcode = IBV_WR_SEND;
	double total = 0, inpost = 0;
	for (int i = 0; i < ns; i++) {
		if (ibv_post_recv(b, &rwr, &rbad)) die("post recv");
		double s = now();
		if (ibv_post_send(a, &wr, &bad)) die("post send");
		inpost += now() - s;
		wait_one(ch, cq, &wc);
		total += now() - s;
		struct ibv_wc rwc;
		while (ibv_poll_cq(rcq, 1, &rwc) == 0)
			;
	}
	printf("SEND8 %.1f usec (mean of %d; %.1f usec in ibv_post_send)\n", total / ns * 1e6, ns, inpost / ns * 1e6);

	struct ibv_cq *ercq = ibv_create_cq(c, 256, NULL, ch, 0);
	if (!ercq || ibv_req_notify_cq(ercq, 0)) die("event recv cq");
	struct ibv_qp *a2 = mkqp(pd, cq), *b2 = mkqp(pd, ercq);
	connect_qp(a2, b2->qp_num, &gid, gidx);
	connect_qp(b2, a2->qp_num, &gid, gidx);
	total = 0;
	for (int i = 0; i < ns; i++) {
		if (ibv_post_recv(b2, &rwr, &rbad)) die("post recv");
		double s = now();
		if (ibv_post_send(a2, &wr, &bad)) die("post send");
		wait_one(ch, cq, &wc);
		total += now() - s;
		struct ibv_wc rwc;
		while (ibv_poll_cq(ercq, 1, &rwc) == 0)
			;
	}
	printf("SEND8EV %.1f usec (mean of %d)\n", total / ns * 1e6, ns);

	// SEND8ARMED: both CQs armed when the send is posted, every time, as an
	// event-driven consumer has them (it re-arms after each event). Only the
	// first completion after an arming raises an event, so SEND8EV's CQs are
	// armed for its first send only.
	total = 0;
	double inpost4 = 0;
	for (int i = 0; i < ns; i++) {
		if (ibv_post_recv(b2, &rwr, &rbad)) die("post recv");
		if (ibv_req_notify_cq(cq, 0) || ibv_req_notify_cq(ercq, 0)) die("arm");
		double s = now();
		if (ibv_post_send(a2, &wr, &bad)) die("post send");
		inpost4 += now() - s;
		while (ibv_poll_cq(cq, 1, &wc) == 0)
			;
		total += now() - s;
		if (wc.status != IBV_WC_SUCCESS) { fprintf(stderr, "wc status %d\n", wc.status); exit(1); }
		for (int e = 0; e < 2; e++) {
			struct ibv_cq *ecq; void *ctx;
			if (ibv_get_cq_event(ch, &ecq, &ctx)) die("get event");
			ibv_ack_cq_events(ecq, 1);
		}
		struct ibv_wc rwc;
		while (ibv_poll_cq(ercq, 1, &rwc) == 0)
			;
	}
	printf("SEND8ARMED %.1f usec (mean of %d; %.1f usec in ibv_post_send)\n", total / ns * 1e6, ns, inpost4 / ns * 1e6);

	int mfd = memfd_create("plainbench", 0);
	if (mfd < 0 || ftruncate(mfd, 2 << 20)) die("memfd");
	char *shm = mmap(NULL, 2 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
	if (shm == MAP_FAILED) die("mmap");
	memset(shm, 0, 2 << 20);
	struct ibv_mr *mmr = ibv_reg_mr(pd, shm, 2 << 20, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!mmr) die("reg memfd mr");
	struct ibv_sge msge = {.addr = (uintptr_t)shm, .length = 8, .lkey = mmr->lkey};
	struct ibv_sge mrsge = {.addr = (uintptr_t)shm + (1 << 20), .length = 64, .lkey = mmr->lkey};
	struct ibv_send_wr mwr = {.sg_list = &msge, .num_sge = 1, .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
	struct ibv_recv_wr mrwr = {.sg_list = &mrsge, .num_sge = 1};
	total = 0;
	double inpost3 = 0;
	for (int i = 0; i < ns; i++) {
		if (ibv_post_recv(b, &mrwr, &rbad)) die("post recv");
		double s = now();
		if (ibv_post_send(a, &mwr, &bad)) die("post send");
		inpost3 += now() - s;
		wait_one(ch, cq, &wc);
		total += now() - s;
		struct ibv_wc rwc;
		while (ibv_poll_cq(rcq, 1, &rwc) == 0)
			;
	}
	printf("SEND8MEMFD %.1f usec (mean of %d; %.1f usec in ibv_post_send)\n", total / ns * 1e6, ns, inpost3 / ns * 1e6);

	// WRITE64KTHREAD: the relay's shape in C (see write_thread).
	struct evthread e = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
	e.ch = ibv_create_comp_channel(c);
	e.cq = e.ch ? ibv_create_cq(c, 256, NULL, e.ch, 0) : NULL;
	if (!e.cq || ibv_req_notify_cq(e.cq, 0)) die("thread cq");
	struct ibv_qp *a3 = mkqp(pd, e.cq), *b3 = mkqp(pd, rcq);
	connect_qp(a3, b3->qp_num, &gid, gidx);
	connect_qp(b3, a3->qp_num, &gid, gidx);
	pthread_t th;
	if (pthread_create(&th, NULL, ev_loop, &e)) die("thread");
	struct ibv_sge tsge = {.addr = (uintptr_t)src, .length = sz, .lkey = smr->lkey};
	write_thread(c, a3, &e, &tsge, (uintptr_t)dst, dmr->rkey, nw);
	return 0;
}

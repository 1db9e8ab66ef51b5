//go:build linux && cgo

// pv.c: libibverbs loaded at run time (the daemon links no RDMA library),
// and the calls the Go side makes, so that Go never handles a verbs
// structure that holds pointers.
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <infiniband/verbs.h>
#include "pv.h"
#include <time.h>



#define PV_SYM(field, name) do { \
	*(void **)(&l->field) = dlsym(l->h, name); \
	if (!l->field) { snprintf(err, errlen, "%s: no symbol %s", lib, name); dlclose(l->h); free(l); return NULL; } \
} while (0)

pv_lib *pv_load(const char *lib, char *err, size_t errlen) {
	pv_lib *l = calloc(1, sizeof(*l));
	if (!l) { snprintf(err, errlen, "out of memory"); return NULL; }
	l->h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	if (!l->h) { snprintf(err, errlen, "%s", dlerror()); free(l); return NULL; }
	PV_SYM(get_device_list, "ibv_get_device_list");
	PV_SYM(free_device_list, "ibv_free_device_list");
	PV_SYM(get_device_name, "ibv_get_device_name");
	PV_SYM(open_device, "ibv_open_device");
	PV_SYM(close_device, "ibv_close_device");
	PV_SYM(query_device, "ibv_query_device");
	PV_SYM(query_port, "ibv_query_port");
	PV_SYM(query_gid_ex, "_ibv_query_gid_ex");
	PV_SYM(alloc_pd, "ibv_alloc_pd");
	PV_SYM(dealloc_pd, "ibv_dealloc_pd");
	PV_SYM(reg_mr_iova2, "ibv_reg_mr_iova2");
	PV_SYM(dereg_mr, "ibv_dereg_mr");
	PV_SYM(create_comp_channel, "ibv_create_comp_channel");
	PV_SYM(destroy_comp_channel, "ibv_destroy_comp_channel");
	PV_SYM(create_cq, "ibv_create_cq");
	PV_SYM(resize_cq, "ibv_resize_cq");
	PV_SYM(destroy_cq, "ibv_destroy_cq");
	PV_SYM(get_cq_event, "ibv_get_cq_event");
	PV_SYM(ack_cq_events, "ibv_ack_cq_events");
	PV_SYM(create_qp, "ibv_create_qp");
	PV_SYM(modify_qp, "ibv_modify_qp");
	PV_SYM(query_qp, "ibv_query_qp");
	PV_SYM(destroy_qp, "ibv_destroy_qp");
	PV_SYM(create_srq, "ibv_create_srq");
	PV_SYM(modify_srq, "ibv_modify_srq");
	PV_SYM(query_srq, "ibv_query_srq");
	PV_SYM(destroy_srq, "ibv_destroy_srq");
	PV_SYM(create_ah, "ibv_create_ah");
	PV_SYM(destroy_ah, "ibv_destroy_ah");
	PV_SYM(get_async_event, "ibv_get_async_event");
	PV_SYM(ack_async_event, "ibv_ack_async_event");
	return l;
}

void pv_unload(pv_lib *l) { dlclose(l->h); free(l); }

// pv_open opens the device named name; NULL with errno ENODEV if there is none.
struct ibv_context *pv_open(pv_lib *l, const char *name) {
	int n = 0;
	struct ibv_device **list = l->get_device_list(&n);
	if (!list) return NULL;
	struct ibv_context *ctx = NULL;
	errno = ENODEV;
	for (int i = 0; i < n; i++) {
		if (strcmp(l->get_device_name(list[i]), name) == 0) {
			ctx = l->open_device(list[i]);
			break;
		}
	}
	int saved = errno;
	l->free_device_list(list);
	errno = saved;
	return ctx;
}

// pv_device_names writes the names of all devices, NUL-separated, into buf.
int pv_device_names(pv_lib *l, char *buf, size_t len) {
	int n = 0;
	struct ibv_device **list = l->get_device_list(&n);
	if (!list) return -1;
	size_t off = 0;
	for (int i = 0; i < n; i++) {
		const char *s = l->get_device_name(list[i]);
		size_t sl = strlen(s) + 1;
		if (off + sl > len) break;
		memcpy(buf + off, s, sl);
		off += sl;
	}
	l->free_device_list(list);
	return (int)off;
}

int pv_close_device(pv_lib *l, struct ibv_context *c) { return l->close_device(c); }
int pv_query_device(pv_lib *l, struct ibv_context *c, struct ibv_device_attr *a) { return l->query_device(c, a); }
int pv_query_port(pv_lib *l, struct ibv_context *c, uint8_t port, struct ibv_port_attr *a) {
	memset(a, 0, sizeof(*a));
	return l->query_port(c, port, (struct _compat_ibv_port_attr *)a);
}
int pv_query_gid(pv_lib *l, struct ibv_context *c, uint32_t port, uint32_t index, struct ibv_gid_entry *e) {
	return l->query_gid_ex(c, port, index, e, 0, sizeof(*e));
}
struct ibv_pd *pv_alloc_pd(pv_lib *l, struct ibv_context *c) { return l->alloc_pd(c); }
int pv_dealloc_pd(pv_lib *l, struct ibv_pd *pd) { return l->dealloc_pd(pd); }
struct ibv_mr *pv_reg_mr(pv_lib *l, struct ibv_pd *pd, void *addr, size_t len, uint64_t iova, unsigned int access) {
	return l->reg_mr_iova2(pd, addr, len, iova, access);
}
int pv_dereg_mr(pv_lib *l, struct ibv_mr *mr) { return l->dereg_mr(mr); }
struct ibv_comp_channel *pv_create_channel(pv_lib *l, struct ibv_context *c) { return l->create_comp_channel(c); }
int pv_destroy_channel(pv_lib *l, struct ibv_comp_channel *ch) { return l->destroy_comp_channel(ch); }
struct ibv_cq *pv_create_cq(pv_lib *l, struct ibv_context *c, int cqe, uintptr_t ctx, struct ibv_comp_channel *ch) {
	return l->create_cq(c, cqe, (void *)ctx, ch, 0);
}
int pv_resize_cq(pv_lib *l, struct ibv_cq *cq, int cqe) { return l->resize_cq(cq, cqe); }
int pv_destroy_cq(pv_lib *l, struct ibv_cq *cq) { return l->destroy_cq(cq); }
int pv_arm_cq(struct ibv_cq *cq) { return ibv_req_notify_cq(cq, 0); }
// pv_get_cq_event takes one event from a non-blocking channel: 1 and the
// CQ's context, 0 if none is pending, -1 on error.
int pv_get_cq_event(pv_lib *l, struct ibv_comp_channel *ch, uintptr_t *ctx) {
	struct ibv_cq *cq;
	void *c;
	if (l->get_cq_event(ch, &cq, &c) != 0) return errno == EAGAIN ? 0 : -1;
	l->ack_cq_events(cq, 1);
	*ctx = (uintptr_t)c;
	return 1;
}
int pv_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc) { return ibv_poll_cq(cq, n, wc); }
struct ibv_qp *pv_create_qp(pv_lib *l, struct ibv_pd *pd, struct ibv_qp_init_attr *a) { return l->create_qp(pd, a); }
int pv_modify_qp(pv_lib *l, struct ibv_qp *qp, struct ibv_qp_attr *a, int mask) { return l->modify_qp(qp, a, mask); }
int pv_query_qp(pv_lib *l, struct ibv_qp *qp, struct ibv_qp_attr *a, int mask, struct ibv_qp_init_attr *ia) {
	return l->query_qp(qp, a, mask, ia);
}
int pv_destroy_qp(pv_lib *l, struct ibv_qp *qp) { return l->destroy_qp(qp); }
struct ibv_srq *pv_create_srq(pv_lib *l, struct ibv_pd *pd, struct ibv_srq_init_attr *a) { return l->create_srq(pd, a); }
int pv_modify_srq(pv_lib *l, struct ibv_srq *s, struct ibv_srq_attr *a, int mask) { return l->modify_srq(s, a, mask); }
int pv_query_srq(pv_lib *l, struct ibv_srq *s, struct ibv_srq_attr *a) { return l->query_srq(s, a); }
int pv_destroy_srq(pv_lib *l, struct ibv_srq *s) { return l->destroy_srq(s); }
struct ibv_ah *pv_create_ah(pv_lib *l, struct ibv_pd *pd, struct ibv_ah_attr *a) { return l->create_ah(pd, a); }
int pv_destroy_ah(pv_lib *l, struct ibv_ah *ah) { return l->destroy_ah(ah); }

// pv_post_send posts one send WR whose SGL is in C memory, then, if cq is
// set, polls up to nwc of its completions into wc and stores how many in
// *polled (a negative poll result there is the poll's error): one call
// from Go for a post and the poll of what it completed at once.
int pv_post_send(struct ibv_qp *qp, uint64_t wr_id, int opcode, unsigned int flags, uint32_t imm,
		struct ibv_sge *sge, int nsge, uint64_t raddr, uint32_t rkey, uint64_t cmp_add, uint64_t swap,
		struct ibv_ah *ah, uint32_t rqpn, uint32_t rqkey, struct ibv_cq *cq, int nwc, struct ibv_wc *wc,
		int *polled) {
	struct ibv_send_wr wr, *bad;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = sge;
	wr.num_sge = nsge;
	wr.opcode = opcode;
	wr.send_flags = flags;
	wr.imm_data = imm;
	switch (opcode) {
	case IBV_WR_RDMA_WRITE:
	case IBV_WR_RDMA_WRITE_WITH_IMM:
	case IBV_WR_RDMA_READ:
		wr.wr.rdma.remote_addr = raddr;
		wr.wr.rdma.rkey = rkey;
		break;
	case IBV_WR_ATOMIC_CMP_AND_SWP:
	case IBV_WR_ATOMIC_FETCH_AND_ADD:
		wr.wr.atomic.remote_addr = raddr;
		wr.wr.atomic.rkey = rkey;
		wr.wr.atomic.compare_add = cmp_add;
		wr.wr.atomic.swap = swap;
		break;
	}
	if (ah) {
		wr.wr.ud.ah = ah;
		wr.wr.ud.remote_qpn = rqpn;
		wr.wr.ud.remote_qkey = rqkey;
	}
	*polled = 0;
	int rc = ibv_post_send(qp, &wr, &bad);
	if (rc == 0 && cq)
		*polled = ibv_poll_cq(cq, nwc, wc);
	return rc;
}

int pv_post_recv(struct ibv_qp *qp, uint64_t wr_id, struct ibv_sge *sge, int nsge) {
	struct ibv_recv_wr wr, *bad;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = sge;
	wr.num_sge = nsge;
	return ibv_post_recv(qp, &wr, &bad);
}

int pv_post_srq_recv(struct ibv_srq *srq, uint64_t wr_id, struct ibv_sge *sge, int nsge) {
	struct ibv_recv_wr wr, *bad;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = sge;
	wr.num_sge = nsge;
	return ibv_post_srq_recv(srq, &wr, &bad);
}

int pv_channel_fd(struct ibv_comp_channel *ch) { return ch->fd; }
uint32_t pv_qp_num(struct ibv_qp *qp) { return qp->qp_num; }
uint32_t pv_mr_lkey(struct ibv_mr *mr) { return mr->lkey; }
uint32_t pv_mr_rkey(struct ibv_mr *mr) { return mr->rkey; }
void pv_set_gid(struct ibv_ah_attr *a, const uint8_t *gid) { memcpy(a->grh.dgid.raw, gid, 16); }

int pv_async_fd(struct ibv_context *c) { return c->async_fd; }

// pv_get_async_event takes one asynchronous event from the context's
// (non-blocking) event descriptor into *ev without acknowledging it: 1 with
// its type, the object it concerns (QP, CQ or SRQ pointer; 0 for port and
// device events) and the port; 0 if none is pending; -1 on error. Until
// pv_ack_async_event the object cannot be destroyed (ibv_destroy_* waits
// for the acknowledgement), so its pointer names it and no other.
int pv_get_async_event(pv_lib *l, struct ibv_context *c, struct ibv_async_event *evp, int *type, uintptr_t *obj, int *port) {
	struct ibv_async_event ev;
	if (l->get_async_event(c, &ev) != 0) return errno == EAGAIN ? 0 : -1;
	*evp = ev;
	*type = ev.event_type;
	*obj = 0;
	*port = 0;
	switch (ev.event_type) {
	case IBV_EVENT_QP_FATAL: case IBV_EVENT_QP_REQ_ERR: case IBV_EVENT_QP_ACCESS_ERR:
	case IBV_EVENT_COMM_EST: case IBV_EVENT_SQ_DRAINED: case IBV_EVENT_PATH_MIG:
	case IBV_EVENT_PATH_MIG_ERR: case IBV_EVENT_QP_LAST_WQE_REACHED:
		*obj = (uintptr_t)ev.element.qp;
		break;
	case IBV_EVENT_CQ_ERR:
		*obj = (uintptr_t)ev.element.cq;
		break;
	case IBV_EVENT_SRQ_ERR: case IBV_EVENT_SRQ_LIMIT_REACHED:
		*obj = (uintptr_t)ev.element.srq;
		break;
	case IBV_EVENT_PORT_ACTIVE: case IBV_EVENT_PORT_ERR: case IBV_EVENT_LID_CHANGE:
	case IBV_EVENT_PKEY_CHANGE: case IBV_EVENT_SM_CHANGE: case IBV_EVENT_CLIENT_REREGISTER:
	case IBV_EVENT_GID_CHANGE:
		*port = ev.element.port_num;
		break;
	default:
		break;
	}
	return 1;
}

void pv_ack_async_event(pv_lib *l, struct ibv_async_event *ev) { l->ack_async_event(ev); }

// pv_spin spins for ns nanoseconds without a system call: the relay's
// benchmark compares a cgo call of a given length with the same work in Go
// (the runtime treats a long cgo call like a blocking system call).
void pv_spin(long ns) {
	struct timespec a, b;
	clock_gettime(CLOCK_MONOTONIC, &a);
	do {
		clock_gettime(CLOCK_MONOTONIC, &b);
	} while ((b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec) < ns);
}

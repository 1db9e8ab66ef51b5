// pv.h: the C side of the ibverbs provider (pv.c): libibverbs loaded with
// dlopen, and thin calls into it.
#ifndef PV_H
#define PV_H
#include <stdint.h>
#include <stddef.h>
#include <infiniband/verbs.h>

// pv_lib is libibverbs opened with dlopen: the daemon links no RDMA library,
// so it starts on hosts without rdma-core. The inline verbs of verbs.h
// (post, poll, notify) go through the context's ops and need no symbol.
typedef struct pv_lib {
	void *h;
	struct ibv_device **(*get_device_list)(int *);
	void (*free_device_list)(struct ibv_device **);
	const char *(*get_device_name)(struct ibv_device *);
	struct ibv_context *(*open_device)(struct ibv_device *);
	int (*close_device)(struct ibv_context *);
	int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
	int (*query_port)(struct ibv_context *, uint8_t, struct _compat_ibv_port_attr *);
	int (*query_gid_ex)(struct ibv_context *, uint32_t, uint32_t, struct ibv_gid_entry *, uint32_t, size_t);
	struct ibv_pd *(*alloc_pd)(struct ibv_context *);
	int (*dealloc_pd)(struct ibv_pd *);
	struct ibv_mr *(*reg_mr_iova2)(struct ibv_pd *, void *, size_t, uint64_t, unsigned int);
	int (*dereg_mr)(struct ibv_mr *);
	struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *);
	int (*destroy_comp_channel)(struct ibv_comp_channel *);
	struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
	int (*resize_cq)(struct ibv_cq *, int);
	int (*destroy_cq)(struct ibv_cq *);
	int (*get_cq_event)(struct ibv_comp_channel *, struct ibv_cq **, void **);
	void (*ack_cq_events)(struct ibv_cq *, unsigned int);
	struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
	int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
	int (*query_qp)(struct ibv_qp *, struct ibv_qp_attr *, int, struct ibv_qp_init_attr *);
	int (*destroy_qp)(struct ibv_qp *);
	struct ibv_srq *(*create_srq)(struct ibv_pd *, struct ibv_srq_init_attr *);
	int (*modify_srq)(struct ibv_srq *, struct ibv_srq_attr *, int);
	int (*query_srq)(struct ibv_srq *, struct ibv_srq_attr *);
	int (*destroy_srq)(struct ibv_srq *);
	struct ibv_ah *(*create_ah)(struct ibv_pd *, struct ibv_ah_attr *);
	int (*destroy_ah)(struct ibv_ah *);
	int (*get_async_event)(struct ibv_context *, struct ibv_async_event *);
	void (*ack_async_event)(struct ibv_async_event *);
} pv_lib;

pv_lib *pv_load(const char *lib, char *err, size_t errlen);
void pv_unload(pv_lib *l);
struct ibv_context *pv_open(pv_lib *l, const char *name);
int pv_device_names(pv_lib *l, char *buf, size_t len);
int pv_close_device(pv_lib *l, struct ibv_context *c);
int pv_query_device(pv_lib *l, struct ibv_context *c, struct ibv_device_attr *a);
int pv_query_port(pv_lib *l, struct ibv_context *c, uint8_t port, struct ibv_port_attr *a);
int pv_query_gid(pv_lib *l, struct ibv_context *c, uint32_t port, uint32_t index, struct ibv_gid_entry *e);
struct ibv_pd *pv_alloc_pd(pv_lib *l, struct ibv_context *c);
int pv_dealloc_pd(pv_lib *l, struct ibv_pd *pd);
struct ibv_mr *pv_reg_mr(pv_lib *l, struct ibv_pd *pd, void *addr, size_t len, uint64_t iova, unsigned int access);
int pv_dereg_mr(pv_lib *l, struct ibv_mr *mr);
struct ibv_comp_channel *pv_create_channel(pv_lib *l, struct ibv_context *c);
int pv_destroy_channel(pv_lib *l, struct ibv_comp_channel *ch);
struct ibv_cq *pv_create_cq(pv_lib *l, struct ibv_context *c, int cqe, uintptr_t ctx, struct ibv_comp_channel *ch);
int pv_resize_cq(pv_lib *l, struct ibv_cq *cq, int cqe);
int pv_destroy_cq(pv_lib *l, struct ibv_cq *cq);
int pv_arm_cq(struct ibv_cq *cq);
int pv_get_cq_event(pv_lib *l, struct ibv_comp_channel *ch, uintptr_t *ctx);
int pv_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc);
struct ibv_qp *pv_create_qp(pv_lib *l, struct ibv_pd *pd, struct ibv_qp_init_attr *a);
int pv_modify_qp(pv_lib *l, struct ibv_qp *qp, struct ibv_qp_attr *a, int mask);
int pv_query_qp(pv_lib *l, struct ibv_qp *qp, struct ibv_qp_attr *a, int mask, struct ibv_qp_init_attr *ia);
int pv_destroy_qp(pv_lib *l, struct ibv_qp *qp);
struct ibv_srq *pv_create_srq(pv_lib *l, struct ibv_pd *pd, struct ibv_srq_init_attr *a);
int pv_modify_srq(pv_lib *l, struct ibv_srq *s, struct ibv_srq_attr *a, int mask);
int pv_query_srq(pv_lib *l, struct ibv_srq *s, struct ibv_srq_attr *a);
int pv_destroy_srq(pv_lib *l, struct ibv_srq *s);
struct ibv_ah *pv_create_ah(pv_lib *l, struct ibv_pd *pd, struct ibv_ah_attr *a);
int pv_destroy_ah(pv_lib *l, struct ibv_ah *ah);
int pv_post_send(struct ibv_qp *qp, uint64_t wr_id, int opcode, unsigned int flags, uint32_t imm, struct ibv_sge *sge, int nsge, uint64_t raddr, uint32_t rkey, uint64_t cmp_add, uint64_t swap, struct ibv_ah *ah, uint32_t rqpn, uint32_t rqkey, struct ibv_cq *cq, int nwc, struct ibv_wc *wc, int *polled);
int pv_post_recv(struct ibv_qp *qp, uint64_t wr_id, struct ibv_sge *sge, int nsge);
int pv_post_srq_recv(struct ibv_srq *srq, uint64_t wr_id, struct ibv_sge *sge, int nsge);
int pv_channel_fd(struct ibv_comp_channel *ch);
uint32_t pv_qp_num(struct ibv_qp *qp);
uint32_t pv_mr_lkey(struct ibv_mr *mr);
uint32_t pv_mr_rkey(struct ibv_mr *mr);
void pv_set_gid(struct ibv_ah_attr *a, const uint8_t *gid);
int pv_async_fd(struct ibv_context *c);
int pv_get_async_event(pv_lib *l, struct ibv_context *c, struct ibv_async_event *ev, int *type, uintptr_t *obj, int *port);
void pv_ack_async_event(pv_lib *l, struct ibv_async_event *ev);
void pv_spin(long ns);

#endif

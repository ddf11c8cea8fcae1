/* C side of cpgbroker's libvotequorum binding.
 *
 * The same pattern as cpg_binding.c: the three votequorum callbacks are plain C, run inside
 * vqb_dispatch() with the GIL held (votequorum_dispatch never blocks for CS_DISPATCH_ALL), and
 * each appends one raw record (a bytes object) to the Python list whose address the dispatch
 * was given. Python parses the records after votequorum_dispatch() returns. So a callback can
 * neither raise into libvotequorum nor drop a notification silently: if memory runs out,
 * queue->error is set and the Python side raises after returning what was stored.
 *
 * Records (native byte order, 16-byte header):
 *   QUORUM:   u32 type, u32 quorate, u32 n_nodes, u32 0, then n_nodes x {u32 nodeid, u32 state}
 *   NODELIST: u32 type, u32 ring nodeid, u64 ring seq, then u32 n_nodes, u32 0,
 *             then n_nodes x u32 nodeid
 *   EXPECTED: u32 type, u32 expected votes, u64 0
 */
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <corosync/corotypes.h>
#include <corosync/votequorum.h>

/* Bump together with EXPECTED_BINDING_VERSION in src/cpgbroker/quorum.py whenever this file or
 * the cdef changes, so that a stale compiled module is refused at import. */
#define VQB_BINDING_VERSION 1

#define VQB_EV_QUORUM 1
#define VQB_EV_NODELIST 2
#define VQB_EV_EXPECTED 3

typedef struct {
    int error;        /* CS_OK, or CS_ERR_NO_MEMORY when a callback could not store a record */
    PyObject *sink;   /* the current dispatch's record list (borrowed) */
} vqb_queue;

static vqb_queue *vqb_queue_of(votequorum_handle_t handle)
{
    void *ctx = NULL;
    if (votequorum_context_get(handle, &ctx) != CS_OK || ctx == NULL) {
        return NULL;
    }
    vqb_queue *q = ctx;
    return q->sink != NULL && q->error == CS_OK ? q : NULL;
}

static char *vqb_record(vqb_queue *q, size_t size, PyObject **out)
{
    PyObject *rec = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (rec == NULL) {
        PyErr_Clear(); /* nothing may stay raised across the return into C */
        q->error = CS_ERR_NO_MEMORY;
        return NULL;
    }
    *out = rec;
    char *p = PyBytes_AsString(rec);
    memset(p, 0, size);
    return p;
}

static void vqb_commit(vqb_queue *q, PyObject *rec)
{
    if (PyList_Append(q->sink, rec) < 0) {
        PyErr_Clear();
        q->error = CS_ERR_NO_MEMORY;
    }
    Py_DECREF(rec);
}

static void vqb_put_u32(char *p, uint32_t v) { memcpy(p, &v, 4); }
static void vqb_put_u64(char *p, uint64_t v) { memcpy(p, &v, 8); }

static void vqb_quorum(votequorum_handle_t handle, uint64_t context, uint32_t quorate,
                       uint32_t n_nodes, votequorum_node_t nodes[])
{
    (void)context;
    vqb_queue *q = vqb_queue_of(handle);
    if (q == NULL) {
        return;
    }
    PyObject *rec;
    char *r = vqb_record(q, 16 + (size_t)n_nodes * 8, &rec);
    if (r == NULL) {
        return;
    }
    vqb_put_u32(r, VQB_EV_QUORUM);
    vqb_put_u32(r + 4, quorate);
    vqb_put_u32(r + 8, n_nodes);
    for (uint32_t i = 0; i < n_nodes; i++) {
        vqb_put_u32(r + 16 + i * 8, nodes[i].nodeid);
        vqb_put_u32(r + 20 + i * 8, nodes[i].state);
    }
    vqb_commit(q, rec);
}

static void vqb_nodelist(votequorum_handle_t handle, uint64_t context,
                         votequorum_ring_id_t ring_id, uint32_t n_nodes, uint32_t nodes[])
{
    (void)context;
    vqb_queue *q = vqb_queue_of(handle);
    if (q == NULL) {
        return;
    }
    PyObject *rec;
    char *r = vqb_record(q, 24 + (size_t)n_nodes * 4, &rec);
    if (r == NULL) {
        return;
    }
    vqb_put_u32(r, VQB_EV_NODELIST);
    vqb_put_u32(r + 4, ring_id.nodeid);
    vqb_put_u64(r + 8, ring_id.seq);
    vqb_put_u32(r + 16, n_nodes);
    memcpy(r + 24, nodes, (size_t)n_nodes * 4);
    vqb_commit(q, rec);
}

static void vqb_expected(votequorum_handle_t handle, uint64_t context, uint32_t expected)
{
    (void)context;
    vqb_queue *q = vqb_queue_of(handle);
    if (q == NULL) {
        return;
    }
    PyObject *rec;
    char *r = vqb_record(q, 16, &rec);
    if (r == NULL) {
        return;
    }
    vqb_put_u32(r, VQB_EV_EXPECTED);
    vqb_put_u32(r + 4, expected);
    vqb_commit(q, rec);
}

int vqb_initialize(votequorum_handle_t *handle, vqb_queue *queue)
{
    votequorum_callbacks_t callbacks = {
        .votequorum_quorum_notify_fn = vqb_quorum,
        .votequorum_expectedvotes_notify_fn = vqb_expected,
        .votequorum_nodelist_notify_fn = vqb_nodelist,
    };
    queue->error = CS_OK; /* CS_OK is 1, not 0: a zeroed queue would look failed */
    queue->sink = NULL;
    cs_error_t rc = votequorum_initialize(handle, &callbacks);
    if (rc != CS_OK) {
        return rc;
    }
    rc = votequorum_context_set(*handle, queue);
    if (rc != CS_OK) {
        votequorum_finalize(*handle);
    }
    return rc;
}

/* votequorum_dispatch(CS_DISPATCH_ALL) with the GIL held, so the callbacks can build Python
 * objects; records are appended to the list at address sink. */
int vqb_dispatch(votequorum_handle_t handle, vqb_queue *q, void *sink)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    q->sink = sink;
    cs_error_t rc = votequorum_dispatch(handle, CS_DISPATCH_ALL);
    q->sink = NULL;
    PyGILState_Release(gil);
    return rc;
}

/* C side of cpgbroker's libcpg binding.
 *
 * The three CPG callbacks are plain C. cpgb_dispatch() holds the GIL for the whole (never
 * blocking) dispatch, so the deliver callback can build the final Python event object itself:
 * one copy of the message, straight from libcpg's buffer into a bytes object, no Python frame
 * and no C-to-Python callback per message (that transition, plus a second copy, dominated the
 * cost of a binding with Python callbacks). Configuration callbacks append their raw record as
 * a bytes object; Python parses those rare records after cpg_dispatch() returns. Either way
 * every event goes into one list in delivery order, and a callback can neither raise into
 * libcpg nor drop an event silently: if memory runs out, queue->error is set and the Python
 * side turns it into an exception after returning what was stored.
 *
 * Python objects are passed in as void * holding their address (CPython's id()).
 *
 * Configuration records (native byte order, header is 24 bytes):
 *   CONFCHG: u32 type, u32 name length, u32 n_members, u32 n_left, u32 n_joined, u32 0,
 *            then the group name padded to 4 bytes,
 *            then (n_members + n_left + n_joined) x {u32 nodeid, u32 pid, u32 reason}
 *   TOTEM:   u32 type, u32 ring nodeid, u64 ring seq, u32 n_members, u32 0,
 *            then n_members x u32 nodeid
 */
#define _GNU_SOURCE
#include <Python.h>
#include <malloc.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <corosync/corotypes.h>
#include <corosync/cpg.h>

/* Bump together with EXPECTED_BINDING_VERSION in src/cpgbroker/cpg.py whenever this file or the
 * cdef changes, so that a stale compiled module is refused at import instead of misbehaving. */
#define CPGB_BINDING_VERSION 2

#define CPGB_EV_CONFCHG 2
#define CPGB_EV_TOTEM 3
#define CPGB_HEADER 24
/* cpg_mcast_joined() copies the caller's iovec into a 64-entry array after its own header. */
#define CPGB_MAX_IOV 63
#define CPGB_CLONE_NEWNET CLONE_NEWNET

typedef struct {
    cs_error_t error;         /* set when a callback could not store an event */
    uint32_t specials;        /* configuration records in the current dispatch's list */
    PyObject *sink;           /* the current dispatch's event list (borrowed) */
    PyObject *deliver_type;   /* cpgbroker.cpg.Deliver (borrowed; the module keeps it) */
    PyObject **group_objs;    /* bytes object per group seen (owned) */
    struct cpg_name *groups;
    uint32_t ngroups;
    uint32_t gcap;
    uint32_t last_group;
} cpgb_queue;

static PyObject *cpgb_s_group, *cpgb_s_nodeid, *cpgb_s_pid, *cpgb_s_data;

static void cpgb_fail(cpgb_queue *q)
{
    /* Nothing may stay raised across the return into cffi: record it instead. */
    PyErr_Clear();
    q->error = CS_ERR_NO_MEMORY;
}

/* Index of a group name in the queue's table, adding it on first sight. */
static int64_t cpgb_group_index(cpgb_queue *q, const struct cpg_name *g)
{
    uint32_t i = q->last_group;
    if (i < q->ngroups && q->groups[i].length == g->length &&
        memcmp(q->groups[i].value, g->value, g->length) == 0) {
        return i;
    }
    for (i = 0; i < q->ngroups; i++) {
        if (q->groups[i].length == g->length &&
            memcmp(q->groups[i].value, g->value, g->length) == 0) {
            q->last_group = i;
            return i;
        }
    }
    if (q->ngroups == q->gcap) {
        uint32_t gcap = q->gcap ? q->gcap * 2 : 4;
        struct cpg_name *names = realloc(q->groups, gcap * sizeof(*names));
        if (names == NULL) {
            return -1;
        }
        q->groups = names;
        PyObject **objs = realloc(q->group_objs, gcap * sizeof(*objs));
        if (objs == NULL) {
            return -1;
        }
        q->group_objs = objs;
        q->gcap = gcap;
    }
    PyObject *name = PyBytes_FromStringAndSize(g->value, g->length);
    if (name == NULL) {
        return -1;
    }
    q->groups[q->ngroups] = *g;
    q->group_objs[q->ngroups] = name;
    q->last_group = q->ngroups;
    return q->ngroups++;
}

static cpgb_queue *cpgb_queue_of(cpg_handle_t handle)
{
    void *ctx = NULL;
    if (cpg_context_get(handle, &ctx) != CS_OK || ctx == NULL) {
        return NULL;
    }
    cpgb_queue *q = ctx;
    return q->sink != NULL && q->error == CS_OK ? q : NULL;
}

static int cpgb_set(PyObject *obj, PyObject *name, PyObject *value)
{
    /* Generic setattr writes the slot directly, bypassing the frozen class's __setattr__
     * exactly as attrs' own __init__ does. It takes its own reference to value. */
    int rc = value == NULL ? -1 : PyObject_GenericSetAttr(obj, name, value);
    Py_XDECREF(value);
    return rc;
}

static void cpgb_deliver(cpg_handle_t handle, const struct cpg_name *group, uint32_t nodeid,
                         uint32_t pid, void *msg, size_t len)
{
    cpgb_queue *q = cpgb_queue_of(handle);
    if (q == NULL) {
        return;
    }
    int64_t gi = cpgb_group_index(q, group);
    if (gi < 0) {
        cpgb_fail(q);
        return;
    }
    PyObject *ev = PyType_GenericAlloc((PyTypeObject *)q->deliver_type, 0);
    if (ev == NULL) {
        cpgb_fail(q);
        return;
    }
    PyObject *g = q->group_objs[gi];
    Py_INCREF(g);
    if (cpgb_set(ev, cpgb_s_group, g) < 0 ||
        cpgb_set(ev, cpgb_s_nodeid, PyLong_FromUnsignedLong(nodeid)) < 0 ||
        cpgb_set(ev, cpgb_s_pid, PyLong_FromUnsignedLong(pid)) < 0 ||
        cpgb_set(ev, cpgb_s_data, PyBytes_FromStringAndSize(msg, (Py_ssize_t)len)) < 0 ||
        PyList_Append(q->sink, ev) < 0) {
        Py_DECREF(ev);
        cpgb_fail(q);
        return;
    }
    Py_DECREF(ev);
}

/* Append a configuration record, as a bytes object of `size` bytes, to the event list. */
static char *cpgb_record(cpgb_queue *q, size_t size, PyObject **out)
{
    PyObject *rec = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (rec == NULL) {
        cpgb_fail(q);
        return NULL;
    }
    *out = rec;
    return PyBytes_AsString(rec);
}

static void cpgb_commit(cpgb_queue *q, PyObject *rec)
{
    if (PyList_Append(q->sink, rec) < 0) {
        cpgb_fail(q);
    } else {
        q->specials++;
    }
    Py_DECREF(rec);
}

static void cpgb_put_u32(char *p, uint32_t v) { memcpy(p, &v, 4); }
static void cpgb_put_u64(char *p, uint64_t v) { memcpy(p, &v, 8); }

static void cpgb_confchg(cpg_handle_t handle, const struct cpg_name *group,
                         const struct cpg_address *members, size_t n_members,
                         const struct cpg_address *left, size_t n_left,
                         const struct cpg_address *joined, size_t n_joined)
{
    cpgb_queue *q = cpgb_queue_of(handle);
    if (q == NULL) {
        return;
    }
    size_t n = n_members + n_left + n_joined;
    size_t name_len = group->length <= CPG_MAX_NAME_LENGTH ? group->length : CPG_MAX_NAME_LENGTH;
    size_t name_space = (name_len + 3) & ~(size_t)3;
    PyObject *rec;
    char *r = cpgb_record(q, CPGB_HEADER + name_space + n * 12, &rec);
    if (r == NULL) {
        return;
    }
    cpgb_put_u32(r, CPGB_EV_CONFCHG);
    cpgb_put_u32(r + 4, (uint32_t)name_len);
    cpgb_put_u32(r + 8, (uint32_t)n_members);
    cpgb_put_u32(r + 12, (uint32_t)n_left);
    cpgb_put_u32(r + 16, (uint32_t)n_joined);
    cpgb_put_u32(r + 20, 0);
    memset(r + CPGB_HEADER, 0, name_space);
    memcpy(r + CPGB_HEADER, group->value, name_len);
    char *p = r + CPGB_HEADER + name_space;
    const struct cpg_address *lists[3] = {members, left, joined};
    size_t counts[3] = {n_members, n_left, n_joined};
    for (int l = 0; l < 3; l++) {
        for (size_t i = 0; i < counts[l]; i++) {
            cpgb_put_u32(p, lists[l][i].nodeid);
            cpgb_put_u32(p + 4, lists[l][i].pid);
            cpgb_put_u32(p + 8, lists[l][i].reason);
            p += 12;
        }
    }
    cpgb_commit(q, rec);
}

static void cpgb_totem(cpg_handle_t handle, struct cpg_ring_id ring_id, uint32_t n_members,
                       const uint32_t *members)
{
    cpgb_queue *q = cpgb_queue_of(handle);
    if (q == NULL) {
        return;
    }
    PyObject *rec;
    char *r = cpgb_record(q, CPGB_HEADER + (size_t)n_members * 4, &rec);
    if (r == NULL) {
        return;
    }
    cpgb_put_u32(r, CPGB_EV_TOTEM);
    cpgb_put_u32(r + 4, ring_id.nodeid);
    cpgb_put_u64(r + 8, ring_id.seq);
    cpgb_put_u32(r + 16, n_members);
    cpgb_put_u32(r + 20, 0);
    memcpy(r + CPGB_HEADER, members, (size_t)n_members * 4);
    cpgb_commit(q, rec);
}

/* Prepare a queue; deliver_type is the address of cpgbroker.cpg.Deliver. 0 on success. */
int cpgb_queue_init(cpgb_queue *q, void *deliver_type)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int rc = 0;
    if (cpgb_s_data == NULL) {
        cpgb_s_group = PyUnicode_InternFromString("group");
        cpgb_s_nodeid = PyUnicode_InternFromString("nodeid");
        cpgb_s_pid = PyUnicode_InternFromString("pid");
        cpgb_s_data = PyUnicode_InternFromString("data");
        if (!cpgb_s_group || !cpgb_s_nodeid || !cpgb_s_pid || !cpgb_s_data) {
            PyErr_Clear();
            cpgb_s_data = NULL;
            rc = -1;
        }
    }
    q->deliver_type = deliver_type;
    q->error = CS_OK; /* CS_OK is 1, not 0: a zeroed queue would look failed */
    PyGILState_Release(gil);
    return rc;
}

cs_error_t cpgb_initialize(cpg_handle_t *handle, cpgb_queue *queue)
{
    cpg_model_v1_data_t model = {
        .model = CPG_MODEL_V1,
        .cpg_deliver_fn = cpgb_deliver,
        .cpg_confchg_fn = cpgb_confchg,
        .cpg_totem_confchg_fn = cpgb_totem,
        /* The first totem confchg gives the ring id we start in: without it a ring change right
         * after joining could not be told apart from the initial configuration. */
        .flags = CPG_MODEL_V1_DELIVER_INITIAL_TOTEM_CONF,
    };
    return cpg_model_initialize(handle, CPG_MODEL_V1, (cpg_model_data_t *)&model, queue);
}

/* cpg_dispatch() with the GIL held (it never blocks for CS_DISPATCH_ALL/ONE_NONBLOCKING), so
 * the callbacks can build Python objects; events are appended to the list at address sink. */
cs_error_t cpgb_dispatch(cpg_handle_t handle, cs_dispatch_flags_t flags, cpgb_queue *q,
                         void *sink)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    q->sink = sink;
    q->specials = 0;
    cs_error_t rc = cpg_dispatch(handle, flags);
    q->sink = NULL;
    PyGILState_Release(gil);
    return rc;
}

void cpgb_queue_free(cpgb_queue *q)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    for (uint32_t i = 0; i < q->ngroups; i++) {
        Py_DECREF(q->group_objs[i]);
    }
    PyGILState_Release(gil);
    free(q->group_objs);
    free(q->groups);
    q->group_objs = NULL;
    q->groups = NULL;
    q->ngroups = q->gcap = 0;
}

/* One-buffer multicast without building an iovec in Python (the common, hot case). */
cs_error_t cpgb_mcast1(cpg_handle_t handle, const char *data, size_t len)
{
    struct iovec iov = {.iov_base = (void *)data, .iov_len = len};
    return cpg_mcast_joined(handle, CPG_TYPE_AGREED, &iov, 1);
}

/* Several messages in one call, one iovec entry per message: corosync is woken once for a
 * burst instead of once per message. Stops at the first error; *sent counts what went out. */
cs_error_t cpgb_mcast_many(cpg_handle_t handle, char *const *bufs, const size_t *lens,
                           unsigned int n, unsigned int *sent)
{
    cs_error_t rc = CS_OK;
    unsigned int i;
    for (i = 0; i < n; i++) {
        struct iovec iov = {.iov_base = bufs[i], .iov_len = lens[i]};
        rc = cpg_mcast_joined(handle, CPG_TYPE_AGREED, &iov, 1);
        if (rc != CS_OK) {
            break;
        }
    }
    *sent = i;
    return rc;
}

/* glibc gives freed memory back to the kernel eagerly (heap top above 128 KiB, and every
 * block of 128 KiB or more is its own mmap), so a stream of large messages page-faults its
 * way through fresh memory on every dispatch. Raising both thresholds keeps the memory warm. */
int cpgb_tune_malloc(int trim_threshold, int mmap_threshold)
{
    return mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1 &&
           mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1;
}

/* Python 3.11 has no os.setns(); a handle's IPC connection binds to the namespace of the thread
 * that created it, which lets one test process hold a handle on each node. */
int cpgb_setns_net(int fd)
{
    return setns(fd, CLONE_NEWNET);
}

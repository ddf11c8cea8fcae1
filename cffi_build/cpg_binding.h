/* The parts of <corosync/cpg.h> and <corosync/corotypes.h> that cpgbroker uses, as cffi cdef text.
 *
 * Values are written as "..." so the C compiler supplies them from the installed headers: nothing
 * here can drift from the corosync version the module is built against.
 */

typedef uint64_t cpg_handle_t;

typedef enum {
    CS_OK,
    CS_ERR_LIBRARY,
    CS_ERR_VERSION,
    CS_ERR_INIT,
    CS_ERR_TIMEOUT,
    CS_ERR_TRY_AGAIN,
    CS_ERR_INVALID_PARAM,
    CS_ERR_NO_MEMORY,
    CS_ERR_BAD_HANDLE,
    CS_ERR_BUSY,
    CS_ERR_ACCESS,
    CS_ERR_NOT_EXIST,
    CS_ERR_NAME_TOO_LONG,
    CS_ERR_EXIST,
    CS_ERR_NO_SPACE,
    CS_ERR_INTERRUPT,
    CS_ERR_NAME_NOT_FOUND,
    CS_ERR_NO_RESOURCES,
    CS_ERR_NOT_SUPPORTED,
    CS_ERR_BAD_OPERATION,
    CS_ERR_FAILED_OPERATION,
    CS_ERR_MESSAGE_ERROR,
    CS_ERR_QUEUE_FULL,
    CS_ERR_QUEUE_NOT_AVAILABLE,
    CS_ERR_BAD_FLAGS,
    CS_ERR_TOO_BIG,
    CS_ERR_NO_SECTIONS,
    CS_ERR_CONTEXT_NOT_FOUND,
    CS_ERR_TOO_MANY_GROUPS,
    CS_ERR_SECURITY,
    ...
} cs_error_t;

typedef enum {
    CS_DISPATCH_ONE,
    CS_DISPATCH_ALL,
    CS_DISPATCH_BLOCKING,
    CS_DISPATCH_ONE_NONBLOCKING,
    ...
} cs_dispatch_flags_t;

typedef enum {
    CPG_FLOW_CONTROL_DISABLED,
    CPG_FLOW_CONTROL_ENABLED,
    ...
} cpg_flow_control_state_t;

typedef enum {
    CPG_TYPE_AGREED,
    ...
} cpg_guarantee_t;

#define CPG_MAX_NAME_LENGTH ...
#define CPG_MEMBERS_MAX ...

struct cpg_name {
    uint32_t length;
    char value[...];
};

struct cpg_address {
    uint32_t nodeid;
    uint32_t pid;
    uint32_t reason;
};

struct iovec {
    void *iov_base;
    size_t iov_len;
};

cs_error_t cpg_finalize(cpg_handle_t handle);
cs_error_t cpg_fd_get(cpg_handle_t handle, int *fd);
cs_error_t cpg_max_atomic_msgsize_get(cpg_handle_t handle, uint32_t *size);
cs_error_t cpg_dispatch(cpg_handle_t handle, cs_dispatch_flags_t dispatch_types);
cs_error_t cpg_join(cpg_handle_t handle, const struct cpg_name *group);
cs_error_t cpg_leave(cpg_handle_t handle, const struct cpg_name *group);
cs_error_t cpg_mcast_joined(cpg_handle_t handle, cpg_guarantee_t guarantee,
                            const struct iovec *iovec, unsigned int iov_len);
cs_error_t cpg_membership_get(cpg_handle_t handle, struct cpg_name *groupName,
                              struct cpg_address *member_list, int *member_list_entries);
cs_error_t cpg_local_get(cpg_handle_t handle, unsigned int *local_nodeid);
cs_error_t cpg_flow_control_state_get(cpg_handle_t handle,
                                      cpg_flow_control_state_t *flow_control_enabled);
const char *cs_strerror(cs_error_t err);

/* Our helpers, defined in cpg_binding.c. Python objects travel as void * (their address). */

#define CPGB_BINDING_VERSION ...
#define CPGB_EV_CONFCHG ...
#define CPGB_EV_TOTEM ...
#define CPGB_MAX_IOV ...
#define CPGB_CLONE_NEWNET ...

typedef struct {
    cs_error_t error;
    uint32_t specials;
    ...;
} cpgb_queue;

int cpgb_queue_init(cpgb_queue *queue, void *deliver_type);
cs_error_t cpgb_initialize(cpg_handle_t *handle, cpgb_queue *queue);
cs_error_t cpgb_dispatch(cpg_handle_t handle, cs_dispatch_flags_t flags, cpgb_queue *queue,
                         void *sink);
void cpgb_queue_free(cpgb_queue *queue);
cs_error_t cpgb_mcast1(cpg_handle_t handle, const char *data, size_t len);
cs_error_t cpgb_mcast_many(cpg_handle_t handle, char *const *bufs, const size_t *lens,
                           unsigned int n, unsigned int *sent);
int cpgb_tune_malloc(int trim_threshold, int mmap_threshold);
int cpgb_setns_net(int fd);

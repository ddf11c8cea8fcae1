/* C reference client for bench/cpg_bench.py: the same algorithm as the Python worker, so the
 * two can be compared in one run. Compiled by cpg_bench.py with gcc at bench time.
 *
 *   cpg_ref throughput GROUP MEMBERS SENDERS IS_SENDER SIZE SECONDS WINDOW WINDOW_BYTES
 *   cpg_ref latency    GROUP MEMBERS IS_SENDER SIZE COUNT
 *
 * Prints one JSON object on stdout. Message format: byte 0 is 'D' (data) or 'E' (end marker).
 */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <corosync/cpg.h>

static cpg_handle_t handle;
static unsigned int local_nodeid;
static uint32_t local_pid;
static size_t members;
static long delivered, delivered_bytes, ends, in_flight, own_seen, try_again;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double cpu_seconds(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

static void on_deliver(cpg_handle_t h, const struct cpg_name *g, uint32_t nodeid, uint32_t pid,
                       void *msg, size_t len)
{
    (void)h;
    (void)g;
    const char *m = msg;
    if (len > 0 && m[0] == 'D') {
        delivered++;
        delivered_bytes += len;
    } else if (len > 0 && m[0] == 'E') {
        ends++;
    }
    if (nodeid == local_nodeid && pid == local_pid) {
        in_flight--;
        own_seen++;
    }
}

static void on_confchg(cpg_handle_t h, const struct cpg_name *g, const struct cpg_address *m,
                       size_t n, const struct cpg_address *l, size_t nl,
                       const struct cpg_address *j, size_t nj)
{
    (void)h; (void)g; (void)m; (void)l; (void)nl; (void)j; (void)nj;
    members = n;
}

static void die(const char *what, cs_error_t rc)
{
    fprintf(stderr, "cpg_ref: %s failed: %d\n", what, rc);
    exit(1);
}

static int fd;

static void pump(int timeout_ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (timeout_ms != 0 && poll(&p, 1, timeout_ms) <= 0) {
        return;
    }
    cs_error_t rc = cpg_dispatch(handle, CS_DISPATCH_ALL);
    if (rc != CS_OK) {
        die("cpg_dispatch", rc);
    }
}

static void send_one(char *buf, size_t size)
{
    struct iovec iov = {.iov_base = buf, .iov_len = size};
    for (;;) {
        cs_error_t rc = cpg_mcast_joined(handle, CPG_TYPE_AGREED, &iov, 1);
        if (rc == CS_OK) {
            in_flight++;
            return;
        }
        if (rc != CS_ERR_TRY_AGAIN) {
            die("cpg_mcast_joined", rc);
        }
        try_again++;
        pump(1);
    }
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: see the comment at the top of cpg_ref.c\n");
        return 2;
    }
    int latency = strcmp(argv[1], "latency") == 0;
    if ((!latency && argc != 10) || (latency && argc != 7)) {
        fprintf(stderr, "cpg_ref: wrong number of arguments\n");
        return 2;
    }
    const char *group = argv[2];
    size_t want = strtoul(argv[3], NULL, 10);
    long senders = latency ? 1 : strtol(argv[4], NULL, 10);
    int sender = atoi(argv[latency ? 4 : 5]);
    size_t size = strtoul(argv[latency ? 5 : 6], NULL, 10);
    double seconds = latency ? 0 : atof(argv[7]);
    long count = latency ? strtol(argv[6], NULL, 10) : 0;
    long window = latency ? 1 : strtol(argv[8], NULL, 10);
    /* The byte window only limits how many messages may be in flight at this size. */
    long window_bytes = latency ? 1 : strtol(argv[9], NULL, 10);
    if (!latency && window_bytes / (long)size < window) {
        window = window_bytes / (long)size > 0 ? window_bytes / (long)size : 1;
    }

    cpg_model_v1_data_t model = {
        .model = CPG_MODEL_V1, .cpg_deliver_fn = on_deliver, .cpg_confchg_fn = on_confchg};
    cs_error_t rc = cpg_model_initialize(&handle, CPG_MODEL_V1, (cpg_model_data_t *)&model, NULL);
    if (rc != CS_OK) die("cpg_model_initialize", rc);
    struct cpg_name name;
    name.length = strlen(group);
    memcpy(name.value, group, name.length);
    if ((rc = cpg_join(handle, &name)) != CS_OK) die("cpg_join", rc);
    if ((rc = cpg_local_get(handle, &local_nodeid)) != CS_OK) die("cpg_local_get", rc);
    if ((rc = cpg_fd_get(handle, &fd)) != CS_OK) die("cpg_fd_get", rc);
    local_pid = getpid();

    while (members < want) pump(1000);
    double start = now();
    double cpu0 = cpu_seconds();
    char *buf = malloc(size);
    memset(buf, 'x', size);
    double *lat = NULL;

    if (latency) {
        lat = calloc(count ? count : 1, sizeof(double));
        if (sender) {
            buf[0] = 'D';
            for (long i = 0; i < count; i++) {
                long target = own_seen + 1;
                double t0 = now();
                send_one(buf, size);
                while (own_seen < target) pump(-1);
                lat[i] = now() - t0;
            }
            buf[0] = 'E';
            send_one(buf, size);
        }
        while (ends < 1) pump(100);
        printf("{\"samples\": [");
        for (long i = 0; sender && i < count; i++) printf("%s%.9f", i ? "," : "", lat[i]);
        printf("]}\n");
        return 0;
    }

    if (sender) {
        buf[0] = 'D';
        double deadline = start + seconds;
        long sent = 0;
        while (1) {
            if ((sent & 63) == 0 && now() >= deadline) break;
            if (in_flight >= window) {
                pump(1);
                continue;
            }
            send_one(buf, size);
            sent++;
            if ((sent & 7) == 0) pump(0);
        }
        buf[0] = 'E';
        send_one(buf, size);
    }
    while (ends < senders) pump(100);
    double elapsed = now() - start;
    double cpu = cpu_seconds() - cpu0;
    printf("{\"delivered\": %ld, \"bytes\": %ld, \"elapsed\": %.6f, \"try_again\": %ld, "
           "\"cpu\": %.6f}\n",
           delivered, delivered_bytes, elapsed, try_again, cpu);
    cpg_finalize(handle);
    return 0;
}

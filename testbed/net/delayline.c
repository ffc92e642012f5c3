/* tb-delayline: the userspace delay line of the WAN link (testbed/net/shaping.py).
 *
 * Packets leaving a router interface are queued to NFQUEUE QUEUE_NUM by an iptables rule; this
 * program holds each packet's verdict (the packet itself stays in the kernel) until
 * arrival + delay + jitter, then accepts it. Times come from CLOCK_MONOTONIC and the wait is a
 * ppoll() with a nanosecond timeout and a 1 ns timer slack, so releases are microsecond-accurate
 * when a core is free.
 *
 *   - Order: FIFO unless REORDER=1: a packet is never released before the one queued ahead of it
 *     (due = max(own due, previous due)), so jitter does not reorder a TCP flow.
 *   - Bounded: at most LIMIT packets are held (and the kernel queue is capped at LIMIT); beyond
 *     that a packet is dropped and counted.
 *   - Burst loss (optional): a Gilbert-Elliott chain drops packets before they are held. Per
 *     packet the chain first moves (good -> bad with P_GB, bad -> good with P_BG), then drops
 *     with LOSS_GOOD or LOSS_BAD of the new state; P_GB = 0 turns it off. Stationary loss is
 *     pi_bad LOSS_BAD + (1 - pi_bad) LOSS_GOOD with pi_bad = P_GB / (P_GB + P_BG); with
 *     LOSS_GOOD 0 and LOSS_BAD 1 (Gilbert) a loss burst lasts 1 / P_BG packets on average.
 *     With the GSO flag a 64 KiB TSO burst is one packet here, as it is for iptables.
 *   - Control on stdin, one line each, answered on stdout:
 *       set DELAY_US JITTER_US DIST REORDER P_GB P_BG LOSS_GOOD LOSS_BAD  -> ok
 *       stats                              -> held=N passed=N dropped=N lost=N
 *     End of stdin (the parent died or closed it) stops the program; held packets are accepted.
 *
 * usage: tb-delayline QUEUE_NUM LIMIT DELAY_US JITTER_US normal|pareto|uniform REORDER
 *                     P_GB P_BG LOSS_GOOD LOSS_BAD SEED
 *        tb-delayline --simulate N P_GB P_BG LOSS_GOOD LOSS_BAD SEED
 *            runs the loss chain alone over N packets (no NFQUEUE, no root) and prints
 *            "packets=N lost=L bursts=B" (a burst is a run of consecutive losses): for tests.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <linux/netfilter.h>
#include <linux/netlink.h>
#include <libnetfilter_queue/libnetfilter_queue.h>

#ifndef NETLINK_NO_ENOBUFS
#define NETLINK_NO_ENOBUFS 5
#endif

struct held { uint64_t due_ns; uint64_t seq; uint32_t id; };

static struct held *heap;          /* min-heap on (due_ns, seq) */
static size_t heap_n, limit;
static uint64_t seq, passed, dropped, lost, last_due_ns;
static double ge_p_gb, ge_p_bg, ge_loss_good, ge_loss_bad;   /* Gilbert-Elliott loss chain */
static int ge_bad;
static int64_t delay_ns, jitter_ns;
static int reorder, dist;          /* dist: 0 normal, 1 pareto, 2 uniform */
static uint64_t rng_state;
static struct nfq_q_handle *qh;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static double uniform01(void)      /* xorshift64*, (0, 1) */
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return ((rng_state * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0) + 1e-17;
}

/* A zero-mean sample with standard deviation jitter_ns. */
static double jitter_sample(void)
{
    double s = (double)jitter_ns;
    if (s <= 0)
        return 0;
    if (dist == 2)                  /* uniform on +-sqrt(3) s */
        return (2 * uniform01() - 1) * 1.7320508075688772 * s;
    if (dist == 1) {                /* Pareto, shape 3: mean 1.5 xm, sd 0.866 xm */
        double xm = s / 0.8660254037844386;
        return xm / cbrt(uniform01()) - 1.5 * xm;
    }
    return sqrt(-2 * log(uniform01())) * cos(2 * M_PI * uniform01()) * s;   /* Box-Muller */
}

/* One step of the Gilbert-Elliott chain: 1 = drop this packet. */
static int ge_drop(void)
{
    if (ge_p_gb <= 0 && !ge_bad)
        return 0;
    ge_bad = ge_bad ? (uniform01() >= ge_p_bg) : (uniform01() < ge_p_gb);
    return uniform01() < (ge_bad ? ge_loss_bad : ge_loss_good);
}

static int set_ge(double p_gb, double p_bg, double loss_good, double loss_bad)
{
    if (!(p_gb >= 0 && p_gb <= 1 && p_bg > 0 && p_bg <= 1 && loss_good >= 0 && loss_good <= 1
          && loss_bad >= 0 && loss_bad <= 1))
        return -1;
    ge_p_gb = p_gb;
    ge_p_bg = p_bg;
    ge_loss_good = loss_good;
    ge_loss_bad = loss_bad;
    if (p_gb <= 0)
        ge_bad = 0;
    return 0;
}

static int before(const struct held *a, const struct held *b)
{
    return a->due_ns < b->due_ns || (a->due_ns == b->due_ns && a->seq < b->seq);
}

static void heap_push(struct held h)
{
    size_t i = heap_n++;
    heap[i] = h;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!before(&heap[i], &heap[p]))
            break;
        struct held t = heap[p]; heap[p] = heap[i]; heap[i] = t;
        i = p;
    }
}

static struct held heap_pop(void)
{
    struct held top = heap[0];
    heap[0] = heap[--heap_n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < heap_n && before(&heap[l], &heap[m])) m = l;
        if (r < heap_n && before(&heap[r], &heap[m])) m = r;
        if (m == i)
            break;
        struct held t = heap[m]; heap[m] = heap[i]; heap[i] = t;
        i = m;
    }
    return top;
}

static int on_packet(struct nfq_q_handle *q, struct nfgenmsg *msg, struct nfq_data *nfa,
                     void *data)
{
    struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
    uint32_t id = ntohl(ph->packet_id);
    if (ge_drop()) {
        nfq_set_verdict(q, id, NF_DROP, 0, NULL);
        lost++;
        return 0;
    }
    if (heap_n >= limit) {
        nfq_set_verdict(q, id, NF_DROP, 0, NULL);
        dropped++;
        return 0;
    }
    int64_t d = delay_ns + (int64_t)jitter_sample();
    uint64_t due = now_ns() + (d > 0 ? (uint64_t)d : 0);
    if (!reorder && due < last_due_ns)
        due = last_due_ns;          /* FIFO: never overtake the packet ahead */
    last_due_ns = due;
    heap_push((struct held){due, seq++, id});
    return 0;
}

/* Accept every held packet that is due. In FIFO mode ids leave in increasing order, so one
 * batch verdict (all ids <= the last) replaces one message per packet. */
static void release_due(uint64_t t)
{
    uint32_t last = 0;
    int any = 0;
    while (heap_n > 0 && heap[0].due_ns <= t) {
        struct held h = heap_pop();
        if (reorder) {
            nfq_set_verdict(qh, h.id, NF_ACCEPT, 0, NULL);
        } else {
            last = h.id;
            any = 1;
        }
        passed++;
    }
    if (any)
        nfq_set_verdict_batch(qh, last, NF_ACCEPT);
}

static int parse_dist(const char *s)
{
    if (!strcmp(s, "normal")) return 0;
    if (!strcmp(s, "pareto")) return 1;
    if (!strcmp(s, "uniform")) return 2;
    return -1;
}

static void control(char *line)
{
    long long d, j;
    char ds[16];
    int r;
    double gb, bg, lg, lb;
    if (sscanf(line, "set %lld %lld %15s %d %lf %lf %lf %lf", &d, &j, ds, &r, &gb, &bg, &lg,
               &lb) == 8 && d >= 0 && j >= 0 && parse_dist(ds) >= 0
        && set_ge(gb, bg, lg, lb) == 0) {
        delay_ns = d * 1000;
        jitter_ns = j * 1000;
        dist = parse_dist(ds);
        reorder = r != 0;
        printf("ok\n");
    } else if (!strncmp(line, "stats", 5)) {
        printf("held=%zu passed=%llu dropped=%llu lost=%llu\n", heap_n,
               (unsigned long long)passed, (unsigned long long)dropped, (unsigned long long)lost);
    } else {
        printf("error unknown command\n");
    }
    fflush(stdout);
}

static void seed_rng(const char *s)
{
    rng_state = strtoull(s, NULL, 10) * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
}

/* --simulate N P_GB P_BG LOSS_GOOD LOSS_BAD SEED: the loss chain alone, for tests. */
static int simulate(char **argv)
{
    unsigned long long n = strtoull(argv[2], NULL, 10), drops = 0, bursts = 0;
    if (set_ge(atof(argv[3]), atof(argv[4]), atof(argv[5]), atof(argv[6])) < 0) {
        fprintf(stderr, "simulate: probabilities out of range\n");
        return 2;
    }
    seed_rng(argv[7]);
    int prev = 0;
    for (unsigned long long i = 0; i < n; i++) {
        int d = ge_drop();
        drops += d;
        bursts += d && !prev;
        prev = d;
    }
    printf("packets=%llu lost=%llu bursts=%llu\n", n, drops, bursts);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 8 && !strcmp(argv[1], "--simulate"))
        return simulate(argv);
    if (argc != 12 || parse_dist(argv[5]) < 0
        || set_ge(atof(argv[7]), atof(argv[8]), atof(argv[9]), atof(argv[10])) < 0) {
        fprintf(stderr, "usage: %s QUEUE_NUM LIMIT DELAY_US JITTER_US normal|pareto|uniform "
                "REORDER P_GB P_BG LOSS_GOOD LOSS_BAD SEED\n", argv[0]);
        return 2;
    }
    int qnum = atoi(argv[1]);
    limit = strtoul(argv[2], NULL, 10);
    delay_ns = atoll(argv[3]) * 1000;
    jitter_ns = atoll(argv[4]) * 1000;
    dist = parse_dist(argv[5]);
    reorder = atoi(argv[6]) != 0;
    seed_rng(argv[11]);
    if (limit < 1)
        limit = 1;
    heap = calloc(limit, sizeof *heap);
    prctl(PR_SET_TIMERSLACK, 1UL);   /* ppoll wakes within ~1 us of the due time, not 50 us */
    signal(SIGPIPE, SIG_IGN);

    struct nfq_handle *h = nfq_open();
    if (!h || !heap) {
        fprintf(stderr, "nfq_open: %s\n", strerror(errno));
        return 1;
    }
    qh = nfq_create_queue(h, qnum, on_packet, NULL);
    if (!qh) {
        fprintf(stderr, "binding NFQUEUE %d: %s\n", qnum, strerror(errno));
        return 1;
    }
    /* metadata only: the verdict needs the id, not the payload */
    if (nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0 || nfq_set_queue_maxlen(qh, limit) < 0) {
        fprintf(stderr, "configuring NFQUEUE %d: %s\n", qnum, strerror(errno));
        return 1;
    }
    /* GSO: take a sender's 64 KiB TSO burst as one packet instead of having the kernel cut it
     * into 43 frames first; one verdict instead of 43 is what lets 1 Gbit/s through on a
     * shared core. HTB and the drop-tail queue still account every frame's bytes. */
    if (nfq_set_queue_flags(qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO) < 0)
        fprintf(stderr, "NFQUEUE %d: no GSO flag (%s); frames are queued one by one\n", qnum,
                strerror(errno));
    int fd = nfq_fd(h);
    nfnl_rcvbufsiz(nfq_nfnlh(h), 16 << 20);
    int one = 1;
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    printf("ready\n");
    fflush(stdout);

    static char buf[65536];
    char line[256];
    size_t line_n = 0;
    struct pollfd pfd[2] = {{.fd = fd, .events = POLLIN}, {.fd = 0, .events = POLLIN}};
    for (;;) {
        uint64_t t = now_ns();
        release_due(t);
        struct timespec ts, *tsp = NULL;
        if (heap_n > 0) {
            uint64_t wait = heap[0].due_ns > t ? heap[0].due_ns - t : 0;
            ts.tv_sec = wait / 1000000000ull;
            ts.tv_nsec = wait % 1000000000ull;
            tsp = &ts;
        }
        if (ppoll(pfd, 2, tsp, NULL) < 0 && errno != EINTR)
            break;
        if (pfd[0].revents & POLLIN) {
            for (;;) {   /* drain what the kernel has queued */
                ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
                if (n <= 0)
                    break;
                nfq_handle_packet(h, buf, (int)n);
            }
        }
        if (pfd[1].revents & (POLLIN | POLLHUP)) {
            ssize_t n = read(0, line + line_n, sizeof line - 1 - line_n);
            if (n <= 0)
                break;                          /* parent gone: stop */
            line_n += (size_t)n;
            line[line_n] = 0;
            char *nl;
            while ((nl = strchr(line, '\n')) != NULL) {
                *nl = 0;
                control(line);
                line_n -= (size_t)(nl + 1 - line);
                memmove(line, nl + 1, line_n + 1);
            }
            if (line_n >= sizeof line - 1)
                line_n = 0;                     /* an over-long line is discarded */
        }
    }
    release_due(UINT64_MAX);   /* let what is held go on rather than silently dropping it */
    nfq_destroy_queue(qh);
    nfq_close(h);
    return 0;
}

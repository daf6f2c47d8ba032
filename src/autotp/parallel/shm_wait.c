/* The one thing the shared-memory collectives (shm.py) need from C: a barrier across processes that waits
 * without the Python GIL. Python calls it through ctypes, which releases the GIL for the call, so rank 0's
 * HTTP threads keep answering while the ranks wait here; the copies and sums stay in torch.
 *
 * The barrier is one counter in shared memory that only grows (mod 2^32): collective k of a group of tp
 * ranks is complete once the counter reaches (k + 1) * tp. A rank adds one, then spins for spin_ns (its
 * peers are usually microseconds behind: a futex round trip costs more), then sleeps on a futex that the last
 * rank to arrive wakes. With more ranks than cores (`polite`), the spinning yields the core at every turn, or
 * it would take the core of the very peer it waits for.
 * Every CHECK_NS asleep it looks whether each peer process still exists, so a rank that died makes the others
 * fail within a fraction of a second instead of waiting out the timeout.
 *
 * Built at first use by shm.py with the system's C compiler (no torch headers, well under a second).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SPIN_NS 1000000LL         /* a peer is usually this close behind: spinning beats a futex round trip */
#define CHECK_NS 20000000LL      /* asleep, look at the peers' processes this often */

static long long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int reached(uint32_t *counter, uint32_t target)
{
    return (int32_t)(__atomic_load_n(counter, __ATOMIC_SEQ_CST) - target) >= 0;
}

/* Whether process `pid` is gone: no such process, or a zombie nobody has reaped yet. */
static int gone(int32_t pid)
{
    if (kill(pid, 0) == -1 && errno == ESRCH)
        return 1;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    for (size_t i = n; i > 0; i--)  /* "pid (comm) S ...": the state follows the last ')' */
        if (buf[i - 1] == ')')
            return i + 1 < n && (buf[i + 1] == 'Z' || buf[i + 1] == 'X');
    return 0;
}

/* Arrive at the barrier whose counter is `counter` (sleepers: how many ranks sleep on it) and wait until
 * it reaches `target`. Returns 0 when every rank arrived, -1 after timeout_ns, or r + 1 when the process of
 * rank r (pids[r]) is gone. */
int autotp_shm_arrive(uint32_t *counter, uint32_t *sleepers, const int32_t *pids, int tp, uint32_t target,
                      long long spin_ns, int polite, long long timeout_ns)
{
    __atomic_add_fetch(counter, 1, __ATOMIC_SEQ_CST);
    if (reached(counter, target)) {
        if (__atomic_load_n(sleepers, __ATOMIC_SEQ_CST))
            syscall(SYS_futex, counter, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
        return 0;
    }
    long long start = now_ns();
    while (now_ns() - start < spin_ns) {
        for (int i = 0; i < 64; i++) {
            if (reached(counter, target))
                return 0;
            relax();
        }
        if (polite)
            sched_yield();
    }
    long long checked = start;
    for (;;) {
        /* sleepers before the counter's read, and the last arriver's counter before its sleepers' read
         * (both sequentially consistent): either it sees us and wakes us, or we see its arrival */
        __atomic_add_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
        uint32_t seen = __atomic_load_n(counter, __ATOMIC_SEQ_CST);
        if ((int32_t)(seen - target) < 0) {
            struct timespec wait = {0, CHECK_NS};
            syscall(SYS_futex, counter, FUTEX_WAIT, seen, &wait, NULL, 0);
        }
        __atomic_sub_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
        if (reached(counter, target))
            return 0;
        long long t = now_ns();
        if (t - checked >= CHECK_NS) {
            checked = t;
            for (int r = 0; r < tp; r++)
                if (gone(pids[r]))
                    return r + 1;
        }
        if (t - start > timeout_ns)
            return -1;
    }
}

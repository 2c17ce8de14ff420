/* Private header of the compiled shm blocking fast path (procgroup.transport.shm._p2pwait): what its sources
 * share.  The extension is one Python module built from several C files (setup.py lists them):
 *   _p2pwait.c        module init (the interned attribute names, the module's constants and types)
 *   _p2pwait_ring.c   the module functions: wait_head, put, take, put_stream, stream
 *   _p2pwait_core.c   the Core type: one ShmTransport's send_fast/recv_fast in one call each
 *   _p2pwait_front.c  the Front type: procgroup.p2p.send/recv's common case in one call
 * The small hot helpers (now_ns, spin_end, spin_over, ring_bell, ring_copy_in/out) are static inline here, so
 * every caller inlines them as when the extension was one file; what is shared across files is hidden (never
 * exported from the .so). */
#ifndef PROCGROUP_SHM_P2PWAIT_H
#define PROCGROUP_SHM_P2PWAIT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

/* the doorbell and its sleep flag in a segment (layout.OFF_BELL / OFF_SLEEP; the transport checks they agree) */
#define OFF_BELL 64
#define OFF_SLEEP 72

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define PG_HIDDEN __attribute__((visibility("hidden")))

#define FAST_MAX_C (64 << 10) /* the largest payload of Core.send/recv (the module's FAST_MAX) */

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* the end of a spin of spin_ns from now (a negative spin: none) */
static inline uint64_t spin_end(long long spin_ns) {
    return now_ns() + (uint64_t)(spin_ns > 0 ? spin_ns : 0);
}

/* One idle poll of a spin that ends at `end`: every 16th poll reads the clock (1: the spin is over) and yields
 * the CPU when asked (an oversubscribed host: let the peer run); the others pause. */
static inline int spin_over(unsigned *polls, uint64_t end, int yield_cpu) {
    if ((++*polls & 15) == 0) {
        if (now_ns() >= end)
            return 1;
        if (yield_cpu)
            sched_yield();
    } else {
        CPU_RELAX();
    }
    return 0;
}
/* the doorbell handshake of a producer that just published a head into segment q (see put) */
static inline void ring_bell(char *qbuf, uint32_t bell) {
    uint32_t *b = (uint32_t *)(qbuf + OFF_BELL);
    __atomic_store_n(b, bell, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the doorbell write before the flag read (Dekker) */
    if (__atomic_load_n((const uint32_t *)(qbuf + OFF_SLEEP), __ATOMIC_RELAXED))
        syscall(SYS_futex, b, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* copy k bytes of src into the ring at stream position pos (wrapping) */
static inline void ring_copy_in(char *data, uint64_t mask, uint64_t pos, const char *src, uint64_t k) {
    uint64_t p = pos & mask, first = mask + 1 - p;
    if (k <= first) {
        memcpy(data + p, src, k);
    } else {
        memcpy(data + p, src, first);
        memcpy(data, src + first, k - first);
    }
}

/* copy k bytes out of the ring from stream position pos (wrapping) */
static inline void ring_copy_out(char *dst, const char *data, uint64_t mask, uint64_t pos, uint64_t k) {
    uint64_t p = pos & mask, first = mask + 1 - p;
    if (k <= first) {
        memcpy(dst, data + p, k);
    } else {
        memcpy(dst, data + p, first);
        memcpy(dst + first, data, k - first);
    }
}

/* ---- shared across files */
PG_HIDDEN extern PyMethodDef pg_p2pwait_methods[]; /* the module functions (_p2pwait_ring.c) */
PG_HIDDEN extern PyTypeObject CoreType;            /* _p2pwait_core.c */
PG_HIDDEN extern PyTypeObject FrontType;           /* _p2pwait_front.c */
/* attribute names, interned by the module init (_p2pwait.c): Core's, then Front's */
PG_HIDDEN extern PyObject *s_closed, *s_aborted, *s_cur, *s_head, *s_tail, *s_last, *s_sleepers, *s_moved,
    *s_fast_spun;
PG_HIDDEN extern PyObject *s_default, *s_halt, *s_rank, *s_routes, *s_dtype, *s_nbytes;

#endif /* PROCGROUP_SHM_P2PWAIT_H */

/* Private header of the compiled arena fast path (procgroup.transport.shm._native): what its sources share.
 *
 * The extension is one Python module built from several C files (setup.py lists them):
 *   _native.c         module init, the Slots type (lifecycle, method and member tables)
 *   _native_slots.c   the arena exchange: publish, fence, poll, spin; exchange/exchange_copy/copy, arrived/missing
 *   _native_reduce.c  the reductions (reduce_ptrs) and Slots' reducing exchanges
 *   _native_queue.c   the one-way queue (queue.py): queue_init, q_post/q_read/q_gather/q_ack
 *   _native_big.c     the big slots (bigarena.py): the Big type
 *   _native_a2a.c     all_to_all's exchange (exchange_a2a, a2a_finish)
 *   _native_read.c    one-copy reads out of the other members' buffers (exchange_read, read_finish, set_pids)
 *   _native_rr.c      reductions by one-copy reads (exchange_rr: all_reduce, reduce_scatter)
 * Small hot helpers (copy_bytes, now_ns, check_live, parse_op, publish_and_poll) are static inline here, so every
 * caller inlines them as when the extension was one file; the few functions called across files are hidden
 * (never exported from the .so). */
#ifndef PROCGROUP_SHM_NATIVE_H
#define PROCGROUP_SHM_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <limits.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define PG_HIDDEN __attribute__((visibility("hidden")))

#define SLOT_HDR 64 /* ARENA_HDR: count (u32), check (u32), padding, then the payload */

enum { OP_SUM = 0, OP_PROD = 1, OP_MIN = 2, OP_MAX = 3, N_OPS = 4 };
enum { T_F32 = 0, T_F64 = 1, T_I32 = 2, T_I64 = 3, N_TYPES = 4 };
static const int type_size[N_TYPES] = {4, 8, 4, 8};

/* exchange results */
#define R_MISALIGNED (-3)
#define R_TOO_LARGE (-2)
#define R_WAIT (-1)
#define R_DONE 0
#define R_RING 1
#define RD_FAILED (-9) /* a one-copy read failed: Slots.rd_errno, rd_peer say which; the closing exchange was not published */
/* folded into the check word of the exchange that ends a call of one-copy reads: algorithms.onecopy.END_SALT */
#define PG_END_SALT 0x5A5A0000u

/* memcpy, except where glibc's is slow: measured on AMD EPYC (glibc 2.36), a copy whose destination lies 1-31
 * bytes past its source modulo 4096 runs 6-12x slower (32 KiB: 11.3 us against 1.2 us; its `rep movsb` path);
 * two numpy arrays malloc'd one after the other are exactly 16 bytes apart modulo 4096 when their sizes are
 * multiples of 4096, so an all_to_all's own piece (send -> recv) hits it.  There: destination-aligned 16-byte
 * stores (SSE2, every x86-64), as fast as memcpy's good case at every size measured (4 KiB - 256 KiB).  The
 * same skew hits every copy between a page-aligned slot and a numpy array (16 bytes past a page when mmap'd:
 * 64 KiB 23 us instead of 2, 256 KiB 90 instead of 9), so every payload copy below goes through here.  From
 * COPY_SKEW_MAX up, glibc copies another way and the skew costs nothing. */
#define COPY_SKEW_MAX (512 << 10)
static inline void copy_bytes(char *dst, const char *src, size_t n) {
#if defined(__x86_64__)
    size_t skew = (size_t)((uintptr_t)dst - (uintptr_t)src) & 4095;
    if (n >= 512 && n < COPY_SKEW_MAX && skew && skew < 64) {
        size_t head = (size_t)(-(uintptr_t)dst) & 15;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_store_si128((__m128i *)(dst + i), a);
            _mm_store_si128((__m128i *)(dst + i + 16), b);
            _mm_store_si128((__m128i *)(dst + i + 32), c);
            _mm_store_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, n - i);
        return;
    }
#endif
    memcpy(dst, src, n);
}
/* Copies *into* shared memory that other processes read next (an arena slot, a big buffer, a queue entry) of at
 * least pg_stream_min[kind] bytes (set_stream_min; SIZE_MAX: never) use streaming (non-temporal) stores.  A plain
 * store must first take the line from every cache that holds it -- the readers' of the last call through the same
 * buffer -- and on this 2-vCPU VM that costs ~4x more in some periods than in others (64 KiB written where the
 * other CPU had read it: 7.6-11 us in one kind of period, 28-41 in the other; streamed 4-5.7 in either).  The
 * readers then fetch the data from memory instead of the writer's cache: a gain where every member reads the
 * buffer whole (WHOLE), a loss where each reads its own piece of it (PIECES: all_to_all's streams, the inputs of a
 * reduction; see arena.STREAM_MIN).  An sfence orders the streamed bytes before the caller's publishing store. */
PG_HIDDEN extern size_t pg_stream_min[2];
enum { STREAM_WHOLE = 0, STREAM_PIECES = 1 }; /* a buffer every reader reads whole / each its own piece of */
/* a buffer every member of a group of n reads whole: with a single reader (n = 2) it counts as pieces, the reader's
 * fetch from memory then costing what the stores save (3 netns hosts x 2 ranks, all_reduce 4 MiB, whole jobs: 1.11x
 * the time streamed, 4 of 4 rounds; one host, N=2, all_reduce 1 MiB up to 1.35x in the fast periods) */
#define STREAM_WHOLE_OF(n) ((n) > 2 ? STREAM_WHOLE : STREAM_PIECES)

static inline void stream_bytes(char *dst, const char *src, size_t n) {
#if defined(__x86_64__)
    size_t head = (size_t)(-(uintptr_t)dst) & 63;
    if (head > n) head = n;
    copy_bytes(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence();
    memcpy(dst + i, src + i, n - i);
#else
    copy_bytes(dst, src, n);
#endif
}

static inline void copy_to_shared(char *dst, const char *src, size_t n, int kind) {
    if (n >= pg_stream_min[kind])
        stream_bytes(dst, src, n);
    else
        copy_bytes(dst, src, n);
}

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;         /* members */
    Py_ssize_t me;        /* this member's index */
    Py_ssize_t max_bytes; /* payload bytes of a slot */
    Py_ssize_t sleep_off; /* offset of the sleep flag in a segment */
    Py_buffer *bufs;      /* one export of every member's mapping: keeps it mapped while we hold it */
    Py_ssize_t nbufs;
    char **slot[2];       /* per parity, every member's slot */
    char **seg;           /* every member's segment base */
    long long spin_ns;
    int yield;
    int busy;             /* calls running with the GIL released */
    int released;
    unsigned long long count;
    unsigned long long a2a_own; /* the all_to_all call (count) whose own piece was copied while others arrived */
    int k;                /* the last call: parity, count value, check word */
    uint32_t val, check;
    /* the one-way queue of the group (queue.py), NULL until queue_init: every member's queue region */
    char **qreg;
    char **qptr;          /* scratch: the payloads a reduce root reduces, in member order */
    char *qscratch;       /* the root's own buffer, copied (its data must stay as it was while reduced into) */
    Py_ssize_t qk, qentry, qmax, bell_off;
    unsigned long long qn; /* one-way calls this member completed (a held gather: taken, not yet acknowledged) */
    uint32_t chain;       /* fold of the check words of those calls; xor'ed into every exchange's check word */
    int qheld;            /* a gather without reduction: the done word waits for q_ack */
    int qwkind;           /* the wait a call left to Python: 1 flow, 2 member qwsrc's entry, 3 every other's */
    Py_ssize_t qwsrc;
    uint32_t qwval, qwcheck;
    unsigned long long qwn;
    /* one-copy reads (_native_read.c): every member's process id, NULL until set_pids; the last failed read */
    pid_t *pids;
    int rd_errno;
    Py_ssize_t rd_peer;
    unsigned long long rd_calls; /* calls that read (exchange_read, all_to_all's reads): for the tests */
    char *rr_tmp;                /* exchange_rr's scratch: one chunk a member, NULL until its first call */
} Slots;

/* Big: the big slots of one group (see _native_big.c) */
typedef struct {
    PyObject_HEAD
    Py_ssize_t n, me, bytes, sleep_off;
    Py_buffer *bufs;
    Py_ssize_t nbufs;
    char **hdr;    /* every member's header */
    char **buf[2]; /* every member's buffers 0 and 1 */
    char **seg;
    long long spin_ns;
    int yield, busy, released;
    unsigned long long val; /* the last sync or settle: its count, whom it waits for (BIG_ALL, BIG_NONE), check */
    long long wait;
    uint32_t check;
    int synced;
} Big;

#define BIG_NOGIL (64 << 10) /* copies and reductions from this many bytes on run with the GIL released */

#define PURE_SPIN_NS 20000LL /* a spin's first polls without a syscall (see spin in _native_slots.c) */
#define LONG_YIELD_NS 50000LL /* a yield that kept the spinner off its CPU this long ends the spin (ibid.) */

static inline long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* a spin's yield: sched_yield, and whether it kept us off the CPU past LONG_YIELD_NS (the spin then ends) */
static inline int yield_was_long(void) {
    long long y0 = now_ns();
    sched_yield();
    return now_ns() - y0 > LONG_YIELD_NS;
}

static inline int check_live(Slots *s) {
    if (s->released || !s->bufs) {
        PyErr_SetString(PyExc_ValueError, "arena slots were released");
        return -1;
    }
    return 0;
}

static inline int parse_op(PyObject *o, PyObject *t, int *op, int *type) {
    long a = PyLong_AsLong(o), b = PyLong_AsLong(t);
    if (PyErr_Occurred()) return -1;
    if (a < 0 || a >= N_OPS || b < 0 || b >= N_TYPES) {
        PyErr_SetString(PyExc_ValueError, "arena slots: unknown reduction");
        return -1;
    }
    *op = (int)a;
    *type = (int)b;
    return 0;
}

/* ---- called across files */
PG_HIDDEN void free_bufs(Slots *s);                                                        /* _native.c */
PG_HIDDEN int publish_only(Slots *s, const char *data, Py_ssize_t nbytes, uint32_t check); /* _native_slots.c */
PG_HIDDEN int spin_wait(Slots *s);                                                         /* _native_slots.c */
PG_HIDDEN void reduce_ptrs(char *const *src, Py_ssize_t n, Py_ssize_t off, char *out, Py_ssize_t cnt, int op,
                           int type); /* _native_reduce.c */
PG_HIDDEN void big_free(Big *b);       /* _native_big.c */
PG_HIDDEN int cma_read(pid_t pid, char *dst, uint64_t addr, size_t n); /* _native_read.c: 0 or an errno */
PG_HIDDEN extern PyTypeObject BigType; /* _native_big.c */

/* publish, fence, check; spin (GIL released) when not complete */
static inline int publish_and_poll(Slots *s, const char *data, Py_ssize_t nbytes, uint32_t check) {
    int r = publish_only(s, data, nbytes, check);
    return r == R_WAIT ? spin_wait(s) : r;
}

/* ---- the methods of Slots (the table is in _native.c) */
#define PG_SLOTS_METHOD(name) PG_HIDDEN PyObject *name(Slots *s, PyObject *const *args, Py_ssize_t nargs)
#define PG_SLOTS_NOARGS(name) PG_HIDDEN PyObject *name(Slots *s, PyObject *unused)
PG_SLOTS_METHOD(Slots_exchange); /* _native_slots.c */
PG_SLOTS_METHOD(Slots_exchange_copy); /* _native_slots.c */
PG_SLOTS_METHOD(Slots_copy); /* _native_slots.c */
PG_SLOTS_NOARGS(Slots_arrived); /* _native_slots.c */
PG_SLOTS_NOARGS(Slots_missing); /* _native_slots.c */
PG_SLOTS_NOARGS(Slots_release); /* _native_slots.c */
PG_SLOTS_METHOD(Slots_exchange_reduce); /* _native_reduce.c */
PG_SLOTS_METHOD(Slots_reduce); /* _native_reduce.c */
PG_SLOTS_METHOD(Slots_exchange_reduce_block); /* _native_reduce.c */
PG_SLOTS_METHOD(Slots_queue_init); /* _native_queue.c */
PG_SLOTS_METHOD(Slots_q_post); /* _native_queue.c */
PG_SLOTS_METHOD(Slots_q_read); /* _native_queue.c */
PG_SLOTS_METHOD(Slots_q_gather); /* _native_queue.c */
PG_SLOTS_NOARGS(Slots_q_ack); /* _native_queue.c */
PG_SLOTS_NOARGS(Slots_q_ready); /* _native_queue.c */
PG_SLOTS_NOARGS(Slots_q_missing); /* _native_queue.c */
PG_SLOTS_METHOD(Slots_exchange_a2a); /* _native_a2a.c */
PG_SLOTS_METHOD(Slots_a2a_finish); /* _native_a2a.c */
PG_SLOTS_METHOD(Slots_exchange_read); /* _native_read.c */
PG_SLOTS_METHOD(Slots_read_finish); /* _native_read.c */
PG_SLOTS_METHOD(Slots_set_pids); /* _native_read.c */
PG_SLOTS_METHOD(Slots_exchange_rr); /* _native_rr.c */

#endif /* PROCGROUP_SHM_NATIVE_H */

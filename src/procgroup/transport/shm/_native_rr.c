/* Reductions by one-copy reads between the members of one host, compiled (see _native.c): algorithms.onecopy's
 * allreduce_onecopy / reduce_scatter_onecopy in one C call, for a group without big slots (algorithms.limits says
 * why only there: on this VM the big slots win wherever a group has them).
 *
 *   1. the opening exchange: every member offers whether it can read the others and its buffer's address;
 *   2. every member reduces its own slice: it reads that slice of every other member's buffer (process_vm_readv,
 *      RR_CHUNK bytes at a time, into private scratch) and reduces the members' pieces in member order
 *      (reduce_ptrs: numpy's element-wise results, bit for bit, as every other path);
 *   3. all_reduce only: the middle exchange (every slice reduced), then every member reads every other member's
 *      reduced slice into its own buffer;
 *   4. the closing exchange, after which every owner may change its buffer again.
 *
 * Modes (p members, me this one; n the bytes of `send`):
 *   RR_ALLREDUCE  in place in `send` (`recv` ignored): member j's slice is rr_bounds(n, p, j), whole 64-byte lines
 *                 (the last one short); a member only ever writes its own buffer, and only the slice nobody reads
 *                 in that step
 *   RR_REDSCAT    `recv` (m bytes) = block me of every member's `send` (p*m bytes) reduced in member order; `recv`
 *                 may be that block of `send` itself, and must not overlap the rest of it (-3)
 * The exchanges are those of onecopy.read_directly (two u64 words offered; check words: the call's, ^ RR_MID_SALT,
 * ^ PG_END_SALT), so a member on this path and one on the pure-Python path take part in the same call. */

#include "_native.h"

#include <errno.h>
#include <sys/uio.h>

enum { RR_ALLREDUCE = 0, RR_REDSCAT = 1 };
#define RR_MID_SALT 0x3D3D0000u /* algorithms.onecopy.MID_SALT */
#define RR_CHUNK (32 << 10)     /* bytes read from one member per step: one member's piece stays in L1 / L2 */
#define RD_PENDING (-1)         /* as _native_read.c */
#define RD_CLOSING (-5)
#define RD_FALLBACK (-6)
#define RD_RING_FIRST (-8)
#define RR_MID_PENDING (-7) /* the middle exchange is not complete: the caller sleeps on it, then stage 2 */
#define RR_MID_RING (-10)   /* the middle exchange completed with a member asleep: the caller rings, then stage 2 */

/* [lo, hi) of member j's slice of an n-byte buffer among p: whole 64-byte lines */
static void rr_bounds(Py_ssize_t n, Py_ssize_t p, Py_ssize_t j, Py_ssize_t *lo, Py_ssize_t *hi) {
    Py_ssize_t lines = (n + 63) / 64;
    *lo = lines * j / p * 64;
    *hi = lines * (j + 1) / p * 64;
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

typedef struct {
    Py_buffer sb, rb;
    int have_r, mode, op, type;
    uint32_t check;
    Py_ssize_t lo, hi; /* this member's slice of send */
    char *out;         /* where the reduced slice goes */
} rr_args;

/* this member's slice: out = the members' [lo, hi) of their buffers reduced in member order; 0 or RD_FAILED */
static int rr_reduce(Slots *s, rr_args *a, char *const *sl) {
    Py_ssize_t p = s->n, me = s->me, sz = type_size[a->type];
    char *own = a->sb.buf;
    int alias = a->out == own + a->lo && me >= 2; /* reduce_ptrs writes out before it reads member me's piece */
    char *src[64];
    int err = 0;
    Py_ssize_t bad = -1;
    for (Py_ssize_t off = a->lo; off < a->hi && !err; off += RR_CHUNK) {
        Py_ssize_t len = a->hi - off < RR_CHUNK ? a->hi - off : RR_CHUNK;
        for (Py_ssize_t t = 1; t < p && !err; t++) {
            Py_ssize_t j = (me + t) % p; /* each member starts at its right neighbour: the reads spread out */
            uint64_t addr = ((const uint64_t *)(sl[j] + SLOT_HDR))[1];
            src[j] = s->rr_tmp + j * RR_CHUNK;
            err = cma_read(s->pids[j], src[j], addr + (uint64_t)off, (size_t)len);
            if (err) bad = j;
        }
        if (err) break;
        src[me] = own + off;
        if (alias) {
            src[me] = s->rr_tmp + me * RR_CHUNK;
            memcpy(src[me], own + off, (size_t)len);
        }
        reduce_ptrs(src, p, 0, a->out + (off - a->lo), len / sz, a->op, a->type);
    }
    if (err) {
        s->rd_errno = err;
        s->rd_peer = bad;
        return RD_FAILED;
    }
    return 0;
}

/* all_reduce's step 3: every other member's reduced slice into our buffer; 0 or RD_FAILED */
static int rr_gather(Slots *s, rr_args *a, char *const *sl) {
    Py_ssize_t p = s->n, me = s->me, n = a->sb.len;
    for (Py_ssize_t t = 1; t < p; t++) {
        Py_ssize_t j = (me + t) % p, lo, hi;
        rr_bounds(n, p, j, &lo, &hi);
        uint64_t addr = ((const uint64_t *)(sl[j] + SLOT_HDR))[1];
        int err = hi > lo ? cma_read(s->pids[j], (char *)a->sb.buf + lo, addr + (uint64_t)lo, (size_t)(hi - lo)) : 0;
        if (err) {
            s->rd_errno = err;
            s->rd_peer = j;
            return RD_FAILED;
        }
    }
    return 0;
}

/* steps 2 (stage 1) or 3 (stage 2) with the GIL released where large; 0 or RD_FAILED */
static int rr_step(Slots *s, rr_args *a, int stage) {
    char *const *sl = s->slot[s->k];
    int nogil = a->sb.len >= BIG_NOGIL;
    s->busy++;
    PyThreadState *ts = nogil ? PyEval_SaveThread() : NULL;
    int r = stage == 1 ? rr_reduce(s, a, sl) : rr_gather(s, a, sl);
    if (ts) PyEval_RestoreThread(ts);
    s->busy--;
    if (s->released && !s->busy) free_bufs(s);
    return r;
}

/* from `stage` on (0: the opening exchange, 1: it completed, 2: the middle one completed) to the end or a wait */
static int rr_run(Slots *s, rr_args *a, int stage) {
    int r;
    if (stage == 0) {
        uint64_t offer[2] = {s->pids != NULL, (uint64_t)(uintptr_t)a->sb.buf};
        r = publish_and_poll(s, (const char *)offer, (Py_ssize_t)sizeof offer, a->check);
        if (r == R_WAIT) return RD_PENDING;
        if (r == R_RING) return RD_RING_FIRST;
        stage = 1;
    }
    if (stage == 1) {
        char *const *sl = s->slot[s->k];
        for (Py_ssize_t i = 0; i < s->n; i++)
            if (!((const uint64_t *)(sl[i] + SLOT_HDR))[0]) return RD_FALLBACK;
        if (!s->rr_tmp) {
            s->rr_tmp = PyMem_Malloc((size_t)s->n * RR_CHUNK);
            if (!s->rr_tmp) {
                s->rd_errno = ENOMEM;
                s->rd_peer = s->me;
                return RD_FAILED;
            }
        }
        if ((r = rr_step(s, a, 1))) return r;
        if (s->released) return RD_CLOSING; /* the caller's sleep sees the release and raises */
        if (a->mode == RR_ALLREDUCE) {
            r = publish_and_poll(s, NULL, 0, a->check ^ RR_MID_SALT);
            if (r == R_WAIT) return RR_MID_PENDING;
            if (r == R_RING) return RR_MID_RING;
            stage = 2;
        } else {
            stage = 3;
        }
    }
    if (stage == 2) {
        /* the opening exchange's offers are two calls back: the middle one took the other parity */
        s->k ^= 1;
        r = rr_step(s, a, 2);
        s->k ^= 1;
        if (r) return r;
        if (s->released) return RD_CLOSING;
    }
    s->rd_calls++;
    r = publish_and_poll(s, NULL, 0, a->check ^ PG_END_SALT);
    return r == R_WAIT ? RD_CLOSING : r;
}

/* exchange_rr(send, recv, check, op, type, mode, stage): see the top of this file */
PyObject *Slots_exchange_rr(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "exchange_rr(send, recv, check, op, type, mode, stage)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    rr_args a;
    unsigned long check = PyLong_AsUnsignedLongMask(args[2]);
    if (check == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    if (parse_op(args[3], args[4], &a.op, &a.type)) return NULL;
    long mode = PyLong_AsLong(args[5]), stage = PyLong_AsLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (mode < RR_ALLREDUCE || mode > RR_REDSCAT || stage < 0 || stage > 2 || s->n > 64) {
        PyErr_SetString(PyExc_ValueError, "exchange_rr: bad mode or stage, or more than 64 members");
        return NULL;
    }
    a.mode = (int)mode;
    a.check = (uint32_t)check;
    if (PyObject_GetBuffer(args[0], &a.sb, mode == RR_ALLREDUCE ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return NULL;
    a.have_r = mode == RR_REDSCAT;
    if (a.have_r && PyObject_GetBuffer(args[1], &a.rb, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&a.sb);
        return NULL;
    }
    Py_ssize_t sz = type_size[a.type], n = a.sb.len;
    int ok = n % sz == 0 && (uintptr_t)a.sb.buf % (uintptr_t)sz == 0;
    if (mode == RR_ALLREDUCE) {
        rr_bounds(n, s->n, s->me, &a.lo, &a.hi);
        a.out = (char *)a.sb.buf + a.lo;
    } else {
        Py_ssize_t m = a.rb.len;
        char *sb = a.sb.buf, *rb = a.rb.buf;
        a.lo = s->me * m;
        a.hi = a.lo + m;
        a.out = rb;
        int overlaps = rb < sb + n && sb < rb + m;
        ok = ok && m % sz == 0 && (uintptr_t)rb % (uintptr_t)sz == 0 && m * s->n <= n &&
             (!overlaps || rb == sb + a.lo);
    }
    int r = ok ? rr_run(s, &a, (int)stage) : R_MISALIGNED;
    PyBuffer_Release(&a.sb);
    if (a.have_r) PyBuffer_Release(&a.rb);
    return PyLong_FromLong(r);
}

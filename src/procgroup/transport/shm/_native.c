/* Optional compiled fast path of the shared-memory arena (procgroup.transport.shm.arena).
 *
 * One call publishes this member's payload, check word and count into its slot, fences, and polls every
 * member's count and check word -- spinning with the GIL released, yielding the CPU at every poll on an
 * oversubscribed host -- and, for the common reductions, reduces every member's payload in member order
 * into the caller's buffer.  It never sleeps: when the spin ends without every member, it returns to Python,
 * which runs the sleep loop (doorbell futex, deadline, peer failure, abort and close checks) exactly as the
 * pure-Python path does, asking this object whether the call completed.
 *
 * The slot layout and the protocol are those of arena.py / layout.py, so a rank on this path and a rank on
 * the pure-Python path exchange with each other.  Memory ordering: the payload and the check word are
 * stored before the count with release semantics, and a sequentially consistent fence (mfence or a locked
 * instruction on x86-64) follows, before the members' counts and sleep flags are read (Dekker with the
 * sleepers, see doorbell.py); counts are loaded with acquire semantics before checks and payloads.
 *
 * Plain C and the CPython C API only (no build dependency beyond a C compiler); setup.py builds it as an
 * optional extension.
 */
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

/* memcpy, except where glibc's is slow: measured on AMD EPYC (glibc 2.36), a copy whose destination lies 1-31
 * bytes past its source modulo 4096 runs 6-12x slower (32 KiB: 11.3 us against 1.2 us; its `rep movsb` path);
 * two numpy arrays malloc'd one after the other are exactly 16 bytes apart modulo 4096 when their sizes are
 * multiples of 4096, so an all_to_all's own piece (send -> recv) hits it.  There: destination-aligned 16-byte
 * stores (SSE2, every x86-64), as fast as memcpy's good case at every size measured (4 KiB - 256 KiB).  The
 * same skew hits every copy between a page-aligned slot and a numpy array (16 bytes past a page when mmap'd:
 * 64 KiB 23 us instead of 2, 256 KiB 90 instead of 9), so every payload copy below goes through here.  From
 * COPY_SKEW_MAX up, glibc copies another way and the skew costs nothing. */
#define COPY_SKEW_MAX (512 << 10)
static void copy_bytes(char *dst, const char *src, size_t n) {
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
} Slots;

static void free_bufs(Slots *s) {
    for (Py_ssize_t i = 0; i < s->nbufs; i++) PyBuffer_Release(&s->bufs[i]);
    s->nbufs = 0;
    PyMem_Free(s->bufs);
    s->bufs = NULL;
    PyMem_Free(s->slot[0]);
    PyMem_Free(s->slot[1]);
    PyMem_Free(s->seg);
    s->slot[0] = s->slot[1] = s->seg = NULL;
    PyMem_Free(s->qreg);
    PyMem_Free(s->qptr);
    PyMem_Free(s->qscratch);
    s->qreg = s->qptr = NULL;
    s->qscratch = NULL;
}

static void Slots_dealloc(Slots *s) {
    free_bufs(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int Slots_init(Slots *s, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"mappings", "offsets0", "offsets1", "me", "max_bytes", "sleep_off", "spin_ns", "yield_cpu",
                             NULL};
    PyObject *mms, *o0, *o1;
    Py_ssize_t me, max_bytes, sleep_off;
    long long spin_ns;
    int yld;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOnnnLp", kwlist, &mms, &o0, &o1, &me, &max_bytes, &sleep_off,
                                     &spin_ns, &yld))
        return -1;
    free_bufs(s);
    PyObject *m = PySequence_Fast(mms, "mappings must be a sequence");
    if (!m) return -1;
    PyObject *f0 = PySequence_Fast(o0, "offsets0 must be a sequence");
    PyObject *f1 = f0 ? PySequence_Fast(o1, "offsets1 must be a sequence") : NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(m);
    int rc = -1;
    if (!f1) goto out;
    if (PySequence_Fast_GET_SIZE(f0) != n || PySequence_Fast_GET_SIZE(f1) != n || n < 1 || me < 0 || me >= n ||
        max_bytes < 0 || sleep_off < 0 || sleep_off % 4) {
        PyErr_SetString(PyExc_ValueError, "arena slots: inconsistent members, offsets or sizes");
        goto out;
    }
    s->bufs = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    s->slot[0] = PyMem_Calloc((size_t)n, sizeof(char *));
    s->slot[1] = PyMem_Calloc((size_t)n, sizeof(char *));
    s->seg = PyMem_Calloc((size_t)n, sizeof(char *));
    if (!s->bufs || !s->slot[0] || !s->slot[1] || !s->seg) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(m, i), &s->bufs[i], PyBUF_WRITABLE) < 0) goto out;
        s->nbufs = i + 1;
        char *base = s->bufs[i].buf;
        Py_ssize_t len = s->bufs[i].len;
        for (int k = 0; k < 2; k++) {
            Py_ssize_t off = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(k ? f1 : f0, i));
            if (off == -1 && PyErr_Occurred()) goto out;
            if (off < 0 || off % 64 || off + SLOT_HDR + max_bytes > len) {
                PyErr_SetString(PyExc_ValueError, "arena slots: a slot lies outside its mapping");
                goto out;
            }
            s->slot[k][i] = base + off;
        }
        if (sleep_off + 4 > len) {
            PyErr_SetString(PyExc_ValueError, "arena slots: the sleep flag lies outside its mapping");
            goto out;
        }
        s->seg[i] = base;
    }
    s->n = n;
    s->me = me;
    s->max_bytes = max_bytes;
    s->sleep_off = sleep_off;
    s->spin_ns = spin_ns;
    s->yield = yld;
    s->count = 0;
    s->a2a_own = 0;
    s->released = 0;
    s->busy = 0;
    rc = 0;
out:
    if (rc) free_bufs(s);
    Py_DECREF(m);
    Py_XDECREF(f0);
    Py_XDECREF(f1);
    return rc;
}

static inline int all_arrived(const Slots *s, int k, uint32_t val, uint32_t check) {
    char *const *sl = s->slot[k];
    for (Py_ssize_t i = 0; i < s->n; i++) {
        uint32_t *w = (uint32_t *)sl[i];
        if (__atomic_load_n(&w[0], __ATOMIC_ACQUIRE) != val) return 0;
        if (__atomic_load_n(&w[1], __ATOMIC_RELAXED) != check) return 0;
    }
    return 1;
}

static inline int sleepers_up(const Slots *s) {
    for (Py_ssize_t i = 0; i < s->n; i++)
        if (i != s->me && __atomic_load_n((uint32_t *)(s->seg[i] + s->sleep_off), __ATOMIC_RELAXED)) return 1;
    return 0;
}

/* poll until every member arrived (1) or the spin ended or the slots were released (0); GIL released.
 * On an oversubscribed host every poll yields the CPU (the member we wait for may be queued behind us); else the
 * first PURE_SPIN_NS poll without a syscall, and then each poll yields too: a host busy with other work
 * behaves as an oversubscribed one, and an idle CPU returns from sched_yield at once. */
#define PURE_SPIN_NS 20000LL
static int spin(Slots *s, int k, uint32_t val, uint32_t check) {
    long long start = now_ns(), end = start + s->spin_ns, pure = s->yield ? start : start + PURE_SPIN_NS;
    for (;;) {
        long long now = now_ns();
        int yld = now >= pure;
        for (int j = 0; j < (yld ? 1 : 64); j++) {
            if (all_arrived(s, k, val, check)) return 1;
            if (yld)
                sched_yield();
            else
                CPU_RELAX();
        }
        if (__atomic_load_n(&s->released, __ATOMIC_RELAXED) || now >= end) return 0;
    }
}

/* publish, fence, check: R_RING (we completed the call and a member's sleep flag is up: the caller rings its
 * doorbell), R_DONE (complete, nobody to wake), R_WAIT (not complete) */
static int publish_only(Slots *s, const char *data, Py_ssize_t nbytes, uint32_t check) {
    check ^= s->chain; /* the one-way calls since the group began (queue.py): members that disagree never meet */
    int k = (int)(s->count & 1);
    s->count++;
    uint32_t val = (uint32_t)((s->count - 1) % 0xFFFFFFFFULL + 1); /* never 0 (0: never published) */
    char *mine = s->slot[k][s->me];
    if (nbytes) copy_bytes(mine + SLOT_HDR, data, (size_t)nbytes);
    uint32_t *w = (uint32_t *)mine;
    __atomic_store_n(&w[1], check, __ATOMIC_RELAXED);
    __atomic_store_n(&w[0], val, __ATOMIC_RELEASE); /* payload and check before the count */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);         /* our count before their counts and sleep flags */
    s->k = k;
    s->val = val;
    s->check = check;
    if (all_arrived(s, k, val, check)) return sleepers_up(s) ? R_RING : R_DONE;
    return R_WAIT;
}

/* the last call not complete at its publish: spin (GIL released) until it is (R_DONE) or the spin ends (R_WAIT) */
static int spin_wait(Slots *s) {
    if (s->spin_ns <= 0) return R_WAIT;
    int ok;
    s->busy++;
    Py_BEGIN_ALLOW_THREADS ok = spin(s, s->k, s->val, s->check);
    Py_END_ALLOW_THREADS s->busy--;
    if (s->released && !s->busy) free_bufs(s);
    return ok && !s->released ? R_DONE : R_WAIT;
}

/* publish, fence, check; spin (GIL released) when not complete */
static int publish_and_poll(Slots *s, const char *data, Py_ssize_t nbytes, uint32_t check) {
    int r = publish_only(s, data, nbytes, check);
    return r == R_WAIT ? spin_wait(s) : r;
}

/* ---- reductions: out = slot[0] op slot[1] op ... in member order (numpy's element-wise results, bit for bit) */
#define MIN_F(a, b) (((a) != (a) || (a) < (b)) ? (a) : (b)) /* np.minimum: NaN wins, a tie gives b */
#define MAX_F(a, b) (((a) != (a) || (a) > (b)) ? (a) : (b))
#define MIN_I(a, b) ((a) < (b) ? (a) : (b))
#define MAX_I(a, b) ((a) > (b) ? (a) : (b))
#define ADD(a, b) ((a) + (b))
#define MUL(a, b) ((a) * (b))

#define REDUCE_LOOP(T, EXPR)                                                  \
    do {                                                                      \
        T *o = (T *)out;                                                      \
        const T *x = (const T *)(src[0] + off);                               \
        const T *y = (const T *)(src[1] + off);                               \
        for (Py_ssize_t i = 0; i < cnt; i++) o[i] = EXPR(x[i], y[i]);         \
        for (Py_ssize_t m = 2; m < n; m++) {                                  \
            const T *z = (const T *)(src[m] + off);                           \
            for (Py_ssize_t i = 0; i < cnt; i++) o[i] = EXPR(o[i], z[i]);     \
        }                                                                     \
    } while (0)

#define REDUCE_TYPE(T, UT, MINX, MAXX)                 \
    switch (op) {                                      \
    case OP_SUM: REDUCE_LOOP(UT, ADD); break;          \
    case OP_PROD: REDUCE_LOOP(UT, MUL); break;         \
    case OP_MIN: REDUCE_LOOP(T, MINX); break;          \
    default: REDUCE_LOOP(T, MAXX); break;              \
    }

/* out = (src[0] + off) op (src[1] + off) op ... over n members, cnt elements, in member order */
static void reduce_ptrs(char *const *src, Py_ssize_t n, Py_ssize_t off, char *out, Py_ssize_t cnt, int op, int type) {
    if (n == 1) {
        copy_bytes(out, src[0] + off, (size_t)(cnt * type_size[type]));
        return;
    }
    switch (type) {
    case T_F32: REDUCE_TYPE(float, float, MIN_F, MAX_F); break;
    case T_F64: REDUCE_TYPE(double, double, MIN_F, MAX_F); break;
    case T_I32: REDUCE_TYPE(int32_t, uint32_t, MIN_I, MAX_I); break; /* sums and products wrap, as numpy's */
    default: REDUCE_TYPE(int64_t, uint64_t, MIN_I, MAX_I); break;
    }
}

static void reduce_slots(const Slots *s, int k, char *out, Py_ssize_t cnt, int op, int type) {
    reduce_ptrs(s->slot[k], s->n, SLOT_HDR, out, cnt, op, type);
}

static int check_live(Slots *s) {
    if (s->released || !s->bufs) {
        PyErr_SetString(PyExc_ValueError, "arena slots were released");
        return -1;
    }
    return 0;
}

static PyObject *Slots_exchange(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "exchange(data, check)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    unsigned long check = PyLong_AsUnsignedLongMask(args[1]);
    if (check == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    int r;
    if (args[0] == Py_None) {
        r = publish_and_poll(s, NULL, 0, (uint32_t)check);
    } else {
        Py_buffer b;
        if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
        if (b.len > s->max_bytes)
            r = R_TOO_LARGE;
        else
            r = publish_and_poll(s, b.buf, b.len, (uint32_t)check);
        PyBuffer_Release(&b);
    }
    return PyLong_FromLong(r);
}

static int parse_op(PyObject *o, PyObject *t, int *op, int *type) {
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

/* exchange_reduce(buf, check, op, type, reduce): publish buf; when complete and `reduce`, buf = the reduction */
static PyObject *Slots_exchange_reduce(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "exchange_reduce(buf, check, op, type, reduce)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    int op, type;
    if (parse_op(args[2], args[3], &op, &type)) return NULL;
    unsigned long check = PyLong_AsUnsignedLongMask(args[1]);
    if (check == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    int red = PyObject_IsTrue(args[4]);
    if (red < 0) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, red ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return NULL;
    int sz = type_size[type];
    int r;
    if (b.len > s->max_bytes)
        r = R_TOO_LARGE;
    else if (b.len % sz || (uintptr_t)b.buf % (uintptr_t)sz)
        r = R_MISALIGNED;
    else {
        r = publish_and_poll(s, b.buf, b.len, (uint32_t)check);
        if (r >= 0 && red) reduce_slots(s, s->k, b.buf, b.len / sz, op, type);
    }
    PyBuffer_Release(&b);
    return PyLong_FromLong(r);
}

/* reduce(buf, op, type[, off]): buf = the reduction of the last call's slots from payload byte `off` (after the
 * caller saw it complete) */
static PyObject *Slots_reduce(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "reduce(buf, op, type[, off])");
        return NULL;
    }
    if (check_live(s)) return NULL;
    int op, type;
    if (parse_op(args[1], args[2], &op, &type)) return NULL;
    Py_ssize_t off = nargs == 4 ? PyLong_AsSsize_t(args[3]) : 0;
    if (off == -1 && PyErr_Occurred()) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_WRITABLE) < 0) return NULL;
    int sz = type_size[type];
    if (off < 0 || off + b.len > s->max_bytes || b.len % sz || (uintptr_t)b.buf % (uintptr_t)sz) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "arena slots: bad reduction buffer");
        return NULL;
    }
    reduce_ptrs(s->slot[s->k], s->n, SLOT_HDR + off, b.buf, b.len / sz, op, type);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

/* exchange_reduce_block(data, out, check, op, type, off): publish data; when complete, out = every member's slot
 * from payload byte `off` (len(out) bytes), reduced in member order (reduce_scatter's block) */
static PyObject *Slots_exchange_reduce_block(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "exchange_reduce_block(data, out, check, op, type, off)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    int op, type;
    if (parse_op(args[3], args[4], &op, &type)) return NULL;
    unsigned long check = PyLong_AsUnsignedLongMask(args[2]);
    Py_ssize_t off = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer d, o;
    if (PyObject_GetBuffer(args[0], &d, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &o, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    int sz = type_size[type], r;
    if (d.len > s->max_bytes)
        r = R_TOO_LARGE;
    else if (off < 0 || off + o.len > d.len || o.len % sz || (uintptr_t)o.buf % (uintptr_t)sz)
        r = R_MISALIGNED;
    else {
        r = publish_and_poll(s, d.buf, d.len, (uint32_t)check);
        if (r >= 0) reduce_ptrs(s->slot[s->k], s->n, SLOT_HDR + off, o.buf, o.len / sz, op, type);
    }
    PyBuffer_Release(&o);
    PyBuffer_Release(&d);
    return PyLong_FromLong(r);
}

static void copy_slots(const Slots *s, int k, char *out, Py_ssize_t nbytes, Py_ssize_t src) {
    char *const *sl = s->slot[k];
    if (src >= 0) {
        copy_bytes(out, sl[src] + SLOT_HDR, (size_t)nbytes);
        return;
    }
    Py_ssize_t each = nbytes / s->n;
    for (Py_ssize_t m = 0; m < s->n; m++) copy_bytes(out + m * each, sl[m] + SLOT_HDR, (size_t)each);
}

/* exchange_copy(data, check, out, src): publish data (None: no bytes); when complete, out = member src's slot
 * (its first len(out) bytes), or with src -1 every member's first len(out)/n bytes, in member order */
static PyObject *Slots_exchange_copy(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "exchange_copy(data, check, out, src)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    unsigned long check = PyLong_AsUnsignedLongMask(args[1]);
    if (check == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    Py_ssize_t src = PyLong_AsSsize_t(args[3]);
    if (src == -1 && PyErr_Occurred()) return NULL;
    if (src < -1 || src >= s->n) {
        PyErr_SetString(PyExc_ValueError, "exchange_copy: no such member");
        return NULL;
    }
    Py_buffer o, b;
    if (PyObject_GetBuffer(args[2], &o, PyBUF_WRITABLE) < 0) return NULL;
    b.buf = NULL;
    b.len = 0;
    if (args[0] != Py_None && PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&o);
        return NULL;
    }
    int r;
    if (b.len > s->max_bytes || (src >= 0 ? o.len : o.len / s->n) > s->max_bytes)
        r = R_TOO_LARGE;
    else if (src < 0 && o.len % s->n) {
        r = R_MISALIGNED; /* not n equal parts: the caller copies */
    } else {
        r = publish_and_poll(s, b.buf, b.len, (uint32_t)check);
        if (r >= 0) copy_slots(s, s->k, o.buf, o.len, src);
    }
    if (args[0] != Py_None) PyBuffer_Release(&b);
    PyBuffer_Release(&o);
    return PyLong_FromLong(r);
}

/* copy(out, src): as exchange_copy's copy, for the last call (after the caller saw it complete) */
static PyObject *Slots_copy(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy(out, src)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    Py_ssize_t src = PyLong_AsSsize_t(args[1]);
    if (src == -1 && PyErr_Occurred()) return NULL;
    Py_buffer o;
    if (PyObject_GetBuffer(args[0], &o, PyBUF_WRITABLE) < 0) return NULL;
    if (src < -1 || src >= s->n || (src >= 0 ? o.len : o.len / s->n) > s->max_bytes || (src < 0 && o.len % s->n)) {
        PyBuffer_Release(&o);
        PyErr_SetString(PyExc_ValueError, "copy: bad member or buffer");
        return NULL;
    }
    copy_slots(s, s->k, o.buf, o.len, src);
    PyBuffer_Release(&o);
    Py_RETURN_NONE;
}

static PyObject *Slots_arrived(Slots *s, PyObject *unused) {
    if (s->released || !s->bufs || !s->count) Py_RETURN_FALSE;
    return PyBool_FromLong(all_arrived(s, s->k, s->val, s->check));
}

/* missing(): indices of the members that have not published the last call (with its check word) */
static PyObject *Slots_missing(Slots *s, PyObject *unused) {
    PyObject *l = PyList_New(0);
    if (!l || s->released || !s->bufs || !s->count) return l;
    for (Py_ssize_t i = 0; i < s->n; i++) {
        uint32_t *w = (uint32_t *)s->slot[s->k][i];
        if (__atomic_load_n(&w[0], __ATOMIC_ACQUIRE) != s->val || __atomic_load_n(&w[1], __ATOMIC_RELAXED) != s->check) {
            PyObject *v = PyLong_FromSsize_t(i);
            if (!v || PyList_Append(l, v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(l);
                return NULL;
            }
            Py_DECREF(v);
        }
    }
    return l;
}

static PyObject *Slots_release(Slots *s, PyObject *unused) {
    s->released = 1;
    if (!s->busy) free_bufs(s);
    Py_RETURN_NONE;
}

/* ---- the one-way queue (queue.py): K entries per member and group for small broadcasts and reduces that do not
 * synchronise every member.  Region of member j: a control line (+0 u64 done: the one-way calls j completed,
 * +8 u64 want: nonzero while j waits for the others' done words), then K entries of qentry bytes (+0 u32 seq of
 * the call, never 0; +4 u32 check word: the fold of the caller's chain with this call's check word; payload at
 * +64).  Call n of the group's one-way calls uses entry n % K.  A member writes its entry of call n only once
 * every member's done word is >= n - K (flow control): nobody still reads what it overwrites.  Every wait spins
 * here (GIL released) and returns R_WAIT to Python, which sleeps on the doorbell and calls again. */
#define Q_CTL 64
#define Q_HDR 64
#define Q_WAKE_WANT (-2) /* ring only the members waiting for done words */
#define Q_WAKE_ALL (-1)

static inline uint32_t q_mix(uint32_t chain, uint32_t check) { return (chain ^ check) * 16777619u; }
static inline uint32_t q_seq(unsigned long long n) { return (uint32_t)((n - 1) % 0xFFFFFFFFULL + 1); }
static inline char *q_entry(const Slots *s, Py_ssize_t j, unsigned long long n) {
    return s->qreg[j] + Q_CTL + (Py_ssize_t)(n % (unsigned long long)s->qk) * s->qentry;
}
static inline uint64_t *q_done(const Slots *s, Py_ssize_t j) { return (uint64_t *)s->qreg[j]; }
static inline uint64_t *q_want(const Slots *s, Py_ssize_t j) { return (uint64_t *)(s->qreg[j] + 8); }

static inline int q_flow_ok(const Slots *s, unsigned long long n) {
    if (n <= (unsigned long long)s->qk) return 1;
    unsigned long long need = n - (unsigned long long)s->qk;
    for (Py_ssize_t j = 0; j < s->n; j++)
        if (__atomic_load_n(q_done(s, j), __ATOMIC_ACQUIRE) < need) return 0;
    return 1;
}

static inline int q_has(const Slots *s, Py_ssize_t j) {
    uint32_t *w = (uint32_t *)q_entry(s, j, s->qwn);
    return __atomic_load_n(&w[0], __ATOMIC_ACQUIRE) == s->qwval && __atomic_load_n(&w[1], __ATOMIC_RELAXED) == s->qwcheck;
}

/* is the pending wait over (qwkind); 0 for none */
static int q_poll(const Slots *s) {
    switch (s->qwkind) {
    case 1: return q_flow_ok(s, s->qwn);
    case 2: return q_has(s, s->qwsrc);
    case 3:
        for (Py_ssize_t j = 0; j < s->n; j++)
            if (j != s->me && !q_has(s, j)) return 0;
        return 1;
    default: return 0;
    }
}

static int q_spin_nogil(Slots *s) {
    long long start = now_ns(), end = start + s->spin_ns, pure = s->yield ? start : start + PURE_SPIN_NS;
    for (;;) {
        long long now = now_ns();
        int yld = now >= pure;
        for (int j = 0; j < (yld ? 1 : 64); j++) {
            if (q_poll(s)) return 1;
            if (yld)
                sched_yield();
            else
                CPU_RELAX();
        }
        if (__atomic_load_n(&s->released, __ATOMIC_RELAXED) || now >= end) return 0;
    }
}

/* spin (GIL released) until the pending wait is over (1) or the spin ends (0) */
static int q_spin(Slots *s) {
    if (q_poll(s)) return 1;
    if (s->spin_ns <= 0) return 0;
    int ok;
    s->busy++;
    Py_BEGIN_ALLOW_THREADS ok = q_spin_nogil(s);
    Py_END_ALLOW_THREADS s->busy--;
    if (s->released) {
        if (!s->busy) free_bufs(s);
        return 0;
    }
    return ok;
}

/* member j's doorbell: a new value (an atomic add: never the value a sleeper compares), then FUTEX_WAKE */
static void q_ring(Slots *s, Py_ssize_t j) {
    uint32_t *bell = (uint32_t *)(s->seg[j] + s->bell_off);
    __atomic_add_fetch(bell, 0x10000001u, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* after this member's publish and a full fence: ring the members asleep (sleep flag up) that may wait for it:
 * `target` (Q_WAKE_ALL: every member) and every member waiting for done words (Dekker: the sleeper raises its
 * flag, fences and re-checks) */
static void q_wake(Slots *s, Py_ssize_t target) {
    for (Py_ssize_t j = 0; j < s->n; j++) {
        if (j == s->me || !__atomic_load_n((uint32_t *)(s->seg[j] + s->sleep_off), __ATOMIC_RELAXED)) continue;
        if (target == Q_WAKE_ALL || j == target || __atomic_load_n(q_want(s, j), __ATOMIC_RELAXED)) q_ring(s, j);
    }
}

/* this member completed call qn: publish it (done word), fence, wake who waits for done words */
static void q_complete(Slots *s) {
    __atomic_store_n(q_done(s, s->me), (uint64_t)s->qn, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    q_wake(s, Q_WAKE_WANT);
}

static int q_live(Slots *s) {
    if (check_live(s)) return -1;
    if (!s->qreg) {
        PyErr_SetString(PyExc_ValueError, "arena slots: no queue (queue_init)");
        return -1;
    }
    if (s->qheld) {
        PyErr_SetString(PyExc_ValueError, "arena queue: the last gather was not acknowledged (q_ack)");
        return -1;
    }
    return 0;
}

/* queue_init(regions, depth, entry, max_bytes, bell_off): every member's queue region of this group */
static PyObject *Slots_queue_init(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "queue_init(regions, depth, entry, max_bytes, bell_off)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    Py_ssize_t k = PyLong_AsSsize_t(args[1]), entry = PyLong_AsSsize_t(args[2]), mx = PyLong_AsSsize_t(args[3]),
               bell = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    PyObject *f = PySequence_Fast(args[0], "regions must be a sequence");
    if (!f) return NULL;
    int ok = PySequence_Fast_GET_SIZE(f) == s->n && k > 0 && mx >= 0 && entry >= Q_HDR + mx && entry % 64 == 0 &&
             bell >= 0 && bell % 4 == 0 && !s->qreg;
    char **reg = ok ? PyMem_Calloc((size_t)s->n, sizeof(char *)) : NULL;
    char **ptr = ok ? PyMem_Calloc((size_t)s->n, sizeof(char *)) : NULL;
    char *scratch = ok ? PyMem_Malloc((size_t)mx + 64) : NULL;
    for (Py_ssize_t j = 0; ok && reg && ptr && scratch && j < s->n; j++) {
        Py_ssize_t off = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(f, j));
        if (off == -1 && PyErr_Occurred()) ok = 0;
        else if (off < 0 || off % 64 || off + Q_CTL + k * entry > s->bufs[j].len || bell + 4 > s->bufs[j].len) ok = 0;
        else reg[j] = s->seg[j] + off;
    }
    Py_DECREF(f);
    if (!ok || !reg || !ptr || !scratch) {
        PyMem_Free(reg);
        PyMem_Free(ptr);
        PyMem_Free(scratch);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "arena queue: inconsistent regions or sizes");
        return NULL;
    }
    s->qreg = reg;
    s->qptr = ptr;
    s->qscratch = scratch;
    s->qk = k;
    s->qentry = entry;
    s->qmax = mx;
    s->bell_off = bell;
    s->qn = 0;
    s->chain = 0;
    s->qheld = 0;
    s->qwkind = 0;
    Py_RETURN_NONE;
}

/* q_post(data, check, target) -> 0 posted, -1 not yet (the others' done words are behind: nothing done, Python
 * sleeps and calls again), -2 too large.  Writes data as this member's entry of the next one-way call and
 * completes it; rings the sleeping `target` (this member: every member, a broadcast's root; else a reduce's
 * root) and the members waiting for done words. */
static PyObject *Slots_q_post(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "q_post(data, check, target)");
        return NULL;
    }
    if (q_live(s)) return NULL;
    unsigned long check = PyLong_AsUnsignedLongMask(args[1]);
    Py_ssize_t target = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    int r = R_DONE;
    unsigned long long n = s->qn + 1;
    if (b.len > s->qmax || target < 0 || target >= s->n) {
        r = R_TOO_LARGE;
    } else {
        if (!q_flow_ok(s, n)) {
            s->qwkind = 1;
            s->qwn = n;
            __atomic_store_n(q_want(s, s->me), (uint64_t)(n - (unsigned long long)s->qk), __ATOMIC_RELAXED);
            if (!q_spin(s)) r = R_WAIT;
        }
        if (r == R_DONE && s->qreg) {
            if (s->qwkind == 1) __atomic_store_n(q_want(s, s->me), 0, __ATOMIC_RELAXED); /* no longer waiting */
            s->qwkind = 0;
            char *e = q_entry(s, s->me, n);
            uint32_t c2 = q_mix(s->chain, (uint32_t)check);
            if (b.len) copy_bytes(e + Q_HDR, b.buf, (size_t)b.len);
            uint32_t *w = (uint32_t *)e;
            __atomic_store_n(&w[1], c2, __ATOMIC_RELAXED);
            __atomic_store_n(&w[0], q_seq(n), __ATOMIC_RELEASE); /* payload and check before the seq */
            s->chain = c2;
            s->qn = n;
            __atomic_store_n(q_done(s, s->me), (uint64_t)n, __ATOMIC_RELEASE);
            __atomic_thread_fence(__ATOMIC_SEQ_CST); /* our entry and done word before their sleep flags */
            q_wake(s, target == s->me ? Q_WAKE_ALL : target);
        } else if (r == R_DONE) {
            r = R_WAIT; /* released during the spin (Python raises ClosedError) */
        }
    }
    PyBuffer_Release(&b);
    return PyLong_FromLong(r);
}

/* set up the wait for call qn + 1 with `check`: kind 2 (member src's entry) or 3 (every other member's) */
static void q_expect(Slots *s, int kind, Py_ssize_t src, uint32_t check) {
    unsigned long long n = s->qn + 1;
    s->qwkind = kind;
    s->qwn = n;
    s->qwsrc = src;
    s->qwval = q_seq(n);
    s->qwcheck = q_mix(s->chain, check);
}

/* q_read(out, check, src) -> 0 copied, -1 not yet (Python sleeps and calls again), -2 too large: out = member
 * src's entry of the next one-way call (its first len(out) bytes), once it shows that call and our check word */
static PyObject *Slots_q_read(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "q_read(out, check, src)");
        return NULL;
    }
    if (q_live(s)) return NULL;
    unsigned long check = PyLong_AsUnsignedLongMask(args[1]);
    Py_ssize_t src = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (src < 0 || src >= s->n || src == s->me) {
        PyErr_SetString(PyExc_ValueError, "q_read: no such member");
        return NULL;
    }
    Py_buffer o;
    if (PyObject_GetBuffer(args[0], &o, PyBUF_WRITABLE) < 0) return NULL;
    int r = R_DONE;
    if (o.len > s->qmax) {
        r = R_TOO_LARGE;
    } else {
        q_expect(s, 2, src, (uint32_t)check);
        if (!q_spin(s) || !s->qreg) {
            r = R_WAIT;
        } else {
            s->qwkind = 0;
            if (o.len) copy_bytes(o.buf, q_entry(s, src, s->qwn) + Q_HDR, (size_t)o.len);
            s->chain = s->qwcheck;
            s->qn = s->qwn;
            q_complete(s);
        }
    }
    PyBuffer_Release(&o);
    return PyLong_FromLong(r);
}

/* q_gather(buf, check, op, type, reduce) -> 0 done, -1 not yet (Python sleeps and calls again), -2 too large,
 * -3 misaligned (nothing done).  A reduce's root: waits for every other member's entry of the next one-way call
 * (with our check word); with `reduce`, buf = every member's data reduced in member order (ours: buf), and the
 * call completes; without, the entries stay ours until q_ack (Python reduces them). */
static PyObject *Slots_q_gather(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "q_gather(buf, check, op, type, reduce)");
        return NULL;
    }
    if (q_live(s)) return NULL;
    int op, type;
    if (parse_op(args[2], args[3], &op, &type)) return NULL;
    unsigned long check = PyLong_AsUnsignedLongMask(args[1]);
    if (PyErr_Occurred()) return NULL;
    int red = PyObject_IsTrue(args[4]);
    if (red < 0) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, red ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return NULL;
    int sz = type_size[type], r = R_DONE;
    if (b.len > s->qmax)
        r = R_TOO_LARGE;
    else if (red && (b.len % sz || (uintptr_t)b.buf % (uintptr_t)sz))
        r = R_MISALIGNED;
    else {
        q_expect(s, 3, -1, (uint32_t)check);
        if (!q_spin(s) || !s->qreg) {
            r = R_WAIT;
        } else {
            s->qwkind = 0;
            s->chain = s->qwcheck;
            s->qn = s->qwn;
            if (red) {
                if (b.len) {
                    memcpy(s->qscratch, b.buf, (size_t)b.len);
                    for (Py_ssize_t j = 0; j < s->n; j++)
                        s->qptr[j] = j == s->me ? s->qscratch : q_entry(s, j, s->qn) + Q_HDR;
                    reduce_ptrs(s->qptr, s->n, 0, b.buf, b.len / sz, op, type);
                }
                q_complete(s);
            } else {
                s->qheld = 1;
            }
        }
    }
    PyBuffer_Release(&b);
    return PyLong_FromLong(r);
}

/* q_ack(): a held gather (q_gather without reduce) is done with the entries: complete the call */
static PyObject *Slots_q_ack(Slots *s, PyObject *unused) {
    if (check_live(s)) return NULL;
    if (s->qheld) {
        s->qheld = 0;
        q_complete(s);
    }
    Py_RETURN_NONE;
}

static PyObject *Slots_q_ready(Slots *s, PyObject *unused) {
    if (s->released || !s->bufs || !s->qreg) Py_RETURN_FALSE;
    return PyBool_FromLong(q_poll(s));
}

/* q_missing(): indices of the members the pending wait still waits for */
static PyObject *Slots_q_missing(Slots *s, PyObject *unused) {
    PyObject *l = PyList_New(0);
    if (!l || s->released || !s->bufs || !s->qreg) return l;
    for (Py_ssize_t j = 0; j < s->n; j++) {
        int miss = 0;
        if (s->qwkind == 1)
            miss = s->qwn > (unsigned long long)s->qk &&
                   __atomic_load_n(q_done(s, j), __ATOMIC_ACQUIRE) < s->qwn - (unsigned long long)s->qk;
        else if (s->qwkind == 2)
            miss = j == s->qwsrc && !q_has(s, j);
        else if (s->qwkind == 3)
            miss = j != s->me && !q_has(s, j);
        if (miss) {
            PyObject *v = PyLong_FromSsize_t(j);
            if (!v || PyList_Append(l, v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(l);
                return NULL;
            }
            Py_DECREF(v);
        }
    }
    return l;
}

/* all_to_all (defined after the big slots, whose buffers it reads) */
static PyObject *Slots_exchange_a2a(Slots *s, PyObject *const *args, Py_ssize_t nargs);
static PyObject *Slots_a2a_finish(Slots *s, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef Slots_methods[] = {
    {"exchange", (PyCFunction)(void (*)(void))Slots_exchange, METH_FASTCALL,
     "exchange(data, check) -> -2 too large, -1 not complete, 0 complete, 1 complete and a member sleeps"},
    {"exchange_reduce", (PyCFunction)(void (*)(void))Slots_exchange_reduce, METH_FASTCALL,
     "exchange_reduce(buf, check, op, type, reduce) -> as exchange, or -3 for a buffer not aligned to its "
     "element size (nothing done); reduces into buf when complete"},
    {"reduce", (PyCFunction)(void (*)(void))Slots_reduce, METH_FASTCALL,
     "reduce(buf, op, type[, off]): reduce the last call's slots (from payload byte off) into buf"},
    {"exchange_reduce_block", (PyCFunction)(void (*)(void))Slots_exchange_reduce_block, METH_FASTCALL,
     "exchange_reduce_block(data, out, check, op, type, off) -> as exchange, or -3 (nothing done); reduces every "
     "member's slot from payload byte off into out when complete"},
    {"exchange_copy", (PyCFunction)(void (*)(void))Slots_exchange_copy, METH_FASTCALL,
     "exchange_copy(data, check, out, src) -> as exchange (-3: out is not n equal parts, nothing done); copies "
     "member src's slot (src -1: every member's, in order) into out when complete"},
    {"copy", (PyCFunction)(void (*)(void))Slots_copy, METH_FASTCALL, "copy(out, src): exchange_copy's copy"},
    {"exchange_a2a", (PyCFunction)(void (*)(void))Slots_exchange_a2a, METH_FASTCALL,
     "exchange_a2a(spec, head, send, recv, check, big, bk, lim) -> -3 (nothing done), -1 not complete, else "
     "bit 0: a member sleeps, bit 1: big buffer bk used, bit 2: Python finishes (nothing copied)"},
    {"a2a_finish", (PyCFunction)(void (*)(void))Slots_a2a_finish, METH_FASTCALL,
     "a2a_finish(spec, send, recv, big, bk, lim) -> exchange_a2a's bits 1 and 2, after the caller saw it complete"},
    {"arrived", (PyCFunction)Slots_arrived, METH_NOARGS, "True when every member published the last call"},
    {"missing", (PyCFunction)Slots_missing, METH_NOARGS, "indices of the members missing from the last call"},
    {"release", (PyCFunction)Slots_release, METH_NOARGS, "drop the exports of the mappings"},
    {"queue_init", (PyCFunction)(void (*)(void))Slots_queue_init, METH_FASTCALL,
     "queue_init(regions, depth, entry, max_bytes, bell_off): the group's one-way queue (queue.py)"},
    {"q_post", (PyCFunction)(void (*)(void))Slots_q_post, METH_FASTCALL,
     "q_post(data, check, target) -> 0 posted, -1 not yet (nothing done), -2 too large"},
    {"q_read", (PyCFunction)(void (*)(void))Slots_q_read, METH_FASTCALL,
     "q_read(out, check, src) -> 0 copied, -1 not yet, -2 too large"},
    {"q_gather", (PyCFunction)(void (*)(void))Slots_q_gather, METH_FASTCALL,
     "q_gather(buf, check, op, type, reduce) -> 0 done (held until q_ack without reduce), -1 not yet, -2, -3"},
    {"q_ack", (PyCFunction)Slots_q_ack, METH_NOARGS, "complete a held gather"},
    {"q_ready", (PyCFunction)Slots_q_ready, METH_NOARGS, "True when the pending queue wait is over"},
    {"q_missing", (PyCFunction)Slots_q_missing, METH_NOARGS, "indices of the members the pending wait waits for"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Slots_members[] = {
    {"count", T_ULONGLONG, offsetof(Slots, count), 0, "calls published so far"},
    {"qn", T_ULONGLONG, offsetof(Slots, qn), READONLY, "one-way calls completed (queue.py)"},
    {"chain", T_UINT, offsetof(Slots, chain), READONLY, "fold of the one-way calls' check words (queue.py)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SlotsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "procgroup.transport.shm._native.Slots",
    .tp_basicsize = sizeof(Slots),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Every member's arena slots of one group and parity (see arena.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Slots_init,
    .tp_dealloc = (destructor)Slots_dealloc,
    .tp_methods = Slots_methods,
    .tp_members = Slots_members,
};

/* ---- big slots (procgroup.transport.shm.bigarena): a header (u64 count, u32 check word) and two buffers per
 * member.  sync(val, end, check) publishes the check word and then the count `val` (release), fences, and polls
 * until every member's count is in [val, end] with this call's check word, or past `end` (that member finished
 * this call); sync_reduce also copies the caller's buffer in first and reduces every member's buffer into it
 * after.  The counts are kept by the Python object (ShmBigArena), which passes them in; the sleep loop stays
 * in Python as for Slots. */
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
    unsigned long long val, end; /* the last sync */
    uint32_t check;
    int synced;
} Big;

static void big_free(Big *b) {
    for (Py_ssize_t i = 0; i < b->nbufs; i++) PyBuffer_Release(&b->bufs[i]);
    b->nbufs = 0;
    PyMem_Free(b->bufs);
    PyMem_Free(b->hdr);
    PyMem_Free(b->buf[0]);
    PyMem_Free(b->buf[1]);
    PyMem_Free(b->seg);
    b->bufs = NULL;
    b->hdr = b->buf[0] = b->buf[1] = b->seg = NULL;
}

static void Big_dealloc(Big *b) {
    big_free(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static int Big_init(Big *b, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"mappings", "headers", "buffers0", "buffers1", "me", "nbytes", "sleep_off", "spin_ns",
                             "yield_cpu", NULL};
    PyObject *mms, *oh, *o0, *o1;
    Py_ssize_t me, nbytes, sleep_off;
    long long spin_ns;
    int yld;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOnnnLp", kwlist, &mms, &oh, &o0, &o1, &me, &nbytes, &sleep_off,
                                     &spin_ns, &yld))
        return -1;
    big_free(b);
    PyObject *f[4] = {NULL, NULL, NULL, NULL};
    PyObject *src[4] = {mms, oh, o0, o1};
    int rc = -1;
    for (int j = 0; j < 4; j++)
        if (!(f[j] = PySequence_Fast(src[j], "big slots: sequences expected"))) goto out;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f[0]);
    for (int j = 1; j < 4; j++)
        if (PySequence_Fast_GET_SIZE(f[j]) != n) n = -1;
    if (n < 1 || me < 0 || me >= n || nbytes < 0 || sleep_off < 0 || sleep_off % 4) {
        PyErr_SetString(PyExc_ValueError, "big slots: inconsistent members, offsets or sizes");
        goto out;
    }
    b->bufs = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    b->hdr = PyMem_Calloc((size_t)n, sizeof(char *));
    b->buf[0] = PyMem_Calloc((size_t)n, sizeof(char *));
    b->buf[1] = PyMem_Calloc((size_t)n, sizeof(char *));
    b->seg = PyMem_Calloc((size_t)n, sizeof(char *));
    if (!b->bufs || !b->hdr || !b->buf[0] || !b->buf[1] || !b->seg) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(f[0], i), &b->bufs[i], PyBUF_WRITABLE) < 0) goto out;
        b->nbufs = i + 1;
        char *base = b->bufs[i].buf;
        Py_ssize_t len = b->bufs[i].len, off[3];
        for (int j = 0; j < 3; j++) {
            off[j] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(f[j + 1], i));
            if (off[j] == -1 && PyErr_Occurred()) goto out;
        }
        if (off[0] < 0 || off[0] % 8 || off[0] + 16 > len || off[1] < 0 || off[1] + nbytes > len || off[2] < 0 ||
            off[2] + nbytes > len || sleep_off + 4 > len) {
            PyErr_SetString(PyExc_ValueError, "big slots: a header or buffer lies outside its mapping");
            goto out;
        }
        b->hdr[i] = base + off[0];
        b->buf[0][i] = base + off[1];
        b->buf[1][i] = base + off[2];
        b->seg[i] = base;
    }
    b->n = n;
    b->me = me;
    b->bytes = nbytes;
    b->sleep_off = sleep_off;
    b->spin_ns = spin_ns;
    b->yield = yld;
    b->released = b->busy = b->synced = 0;
    rc = 0;
out:
    if (rc) big_free(b);
    for (int j = 0; j < 4; j++) Py_XDECREF(f[j]);
    return rc;
}

static inline int big_arrived(const Big *b) {
    for (Py_ssize_t i = 0; i < b->n; i++) {
        unsigned long long c = __atomic_load_n((unsigned long long *)b->hdr[i], __ATOMIC_ACQUIRE);
        if (c > b->end) continue;
        if (c < b->val || __atomic_load_n((uint32_t *)(b->hdr[i] + 8), __ATOMIC_RELAXED) != b->check) return 0;
    }
    return 1;
}

static inline int big_sleepers_up(const Big *b) {
    for (Py_ssize_t i = 0; i < b->n; i++)
        if (i != b->me && __atomic_load_n((uint32_t *)(b->seg[i] + b->sleep_off), __ATOMIC_RELAXED)) return 1;
    return 0;
}

static int big_spin(Big *b) {
    long long start = now_ns(), end = start + b->spin_ns, pure = b->yield ? start : start + PURE_SPIN_NS;
    for (;;) {
        long long now = now_ns();
        int yld = now >= pure;
        for (int j = 0; j < (yld ? 1 : 64); j++) {
            if (big_arrived(b)) return 1;
            if (yld)
                sched_yield();
            else
                CPU_RELAX();
        }
        if (__atomic_load_n(&b->released, __ATOMIC_RELAXED) || now >= end) return 0;
    }
}

/* publish (check word, then the count), fence, check; spin with the GIL released: R_RING / R_DONE / R_WAIT */
static int big_sync(Big *b, unsigned long long val, unsigned long long end, uint32_t check) {
    char *h = b->hdr[b->me];
    __atomic_store_n((uint32_t *)(h + 8), check, __ATOMIC_RELAXED);
    __atomic_store_n((unsigned long long *)h, val, __ATOMIC_RELEASE); /* our buffer and check before the count */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);                           /* before their counts and sleep flags */
    b->val = val;
    b->end = end;
    b->check = check;
    b->synced = 1;
    if (big_arrived(b)) return big_sleepers_up(b) ? R_RING : R_DONE;
    if (b->spin_ns <= 0) return R_WAIT;
    int ok;
    b->busy++;
    Py_BEGIN_ALLOW_THREADS ok = big_spin(b);
    Py_END_ALLOW_THREADS b->busy--;
    if (b->released && !b->busy) big_free(b);
    return ok && !b->released ? R_DONE : R_WAIT;
}

static int big_live(Big *b) {
    if (b->released || !b->bufs) {
        PyErr_SetString(PyExc_ValueError, "big slots were released");
        return -1;
    }
    return 0;
}

static int big_counts(PyObject *const *args, unsigned long long *val, unsigned long long *end, uint32_t *check) {
    *val = PyLong_AsUnsignedLongLong(args[0]);
    *end = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long c = PyLong_AsUnsignedLongMask(args[2]);
    if (PyErr_Occurred()) return -1;
    *check = (uint32_t)c;
    return 0;
}

/* sync(val, end, check) -> R_RING / R_DONE / R_WAIT */
static PyObject *Big_sync(Big *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sync(val, end, check)");
        return NULL;
    }
    unsigned long long val, end;
    uint32_t check;
    if (big_live(b) || big_counts(args, &val, &end, &check)) return NULL;
    return PyLong_FromLong(big_sync(b, val, end, check));
}

#define BIG_NOGIL (64 << 10) /* copies and reductions from this many bytes on run with the GIL released */

/* out = every member's buffer k from byte off on (this member's from `own` instead, where not NULL; it may be
 * out itself: each element is read before it is written), reduced in member order */
/* out = every member's buffer k from byte off on (this member's from `own` instead, where not NULL; it may be
 * out itself: each element is read before it is written), reduced in member order; -1: out of memory */
static int big_reduce(Big *b, int k, Py_ssize_t off, char *out, Py_ssize_t nbytes, int op, int type, char *own) {
    char *stack[64], **src = b->n <= 64 ? stack : PyMem_Malloc((size_t)b->n * sizeof(char *));
    if (!src) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t m = 0; m < b->n; m++) src[m] = b->buf[k][m] + off;
    if (own) src[b->me] = own;
    if (nbytes >= BIG_NOGIL) {
        b->busy++;
        Py_BEGIN_ALLOW_THREADS reduce_ptrs(src, b->n, 0, out, nbytes / type_size[type], op, type);
        Py_END_ALLOW_THREADS b->busy--;
    } else {
        reduce_ptrs(src, b->n, 0, out, nbytes / type_size[type], op, type);
    }
    if (src != stack) PyMem_Free(src);
    return 0;
}

/* sync_reduce(buf, k, val, end, check, op, type, reduce) -> -3 (buf not aligned to its element size, or larger
 * than a buffer: nothing done), else as sync; copies buf into this member's buffer k first and, when the sync
 * completed and `reduce`, reduces every member's buffer k into buf (member order) */
static PyObject *Big_sync_reduce(Big *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "sync_reduce(buf, k, val, end, check, op, type, reduce)");
        return NULL;
    }
    unsigned long long val, end;
    uint32_t check;
    int op, type;
    if (big_live(b) || big_counts(args + 2, &val, &end, &check) || parse_op(args[5], args[6], &op, &type))
        return NULL;
    long k = PyLong_AsLong(args[1]);
    int red = PyObject_IsTrue(args[7]);
    if ((k == -1 && PyErr_Occurred()) || red < 0) return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(args[0], &v, red ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return NULL;
    int sz = type_size[type], r;
    if ((k != 0 && k != 1) || v.len > b->bytes || v.len % sz || (uintptr_t)v.buf % (uintptr_t)sz) {
        r = R_MISALIGNED;
    } else {
        char *mine = b->buf[k][b->me];
        if (v.len >= BIG_NOGIL) {
            b->busy++;
            Py_BEGIN_ALLOW_THREADS copy_bytes(mine, v.buf, (size_t)v.len);
            Py_END_ALLOW_THREADS b->busy--;
        } else {
            copy_bytes(mine, v.buf, (size_t)v.len);
        }
        r = b->released ? R_WAIT : big_sync(b, val, end, check);
        if (r >= 0 && red && !b->released && big_reduce(b, (int)k, 0, v.buf, v.len, op, type, NULL) < 0) r = -4;
        if (b->released && !b->busy) big_free(b);
    }
    PyBuffer_Release(&v);
    if (r == -4) return NULL; /* out of memory, raised */
    return PyLong_FromLong(r);
}

/* reduce(out, k, off, op, type[, own]): out = every member's buffer k from byte `off` on, reduced in member order
 * (this member's part read from `own`, of out's size, where given) */
static PyObject *Big_reduce(Big *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "reduce(out, k, off, op, type[, own])");
        return NULL;
    }
    int op, type;
    if (big_live(b) || parse_op(args[3], args[4], &op, &type)) return NULL;
    long k = PyLong_AsLong(args[1]);
    Py_ssize_t off = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer v, w;
    int hw = nargs == 6 && args[5] != Py_None;
    if (PyObject_GetBuffer(args[0], &v, PyBUF_WRITABLE) < 0) return NULL;
    if (hw && PyObject_GetBuffer(args[5], &w, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&v);
        return NULL;
    }
    int sz = type_size[type];
    if ((k != 0 && k != 1) || off < 0 || off + v.len > b->bytes || v.len % sz || (uintptr_t)v.buf % (uintptr_t)sz ||
        (hw && (w.len != v.len || (uintptr_t)w.buf % (uintptr_t)sz))) {
        PyErr_SetString(PyExc_ValueError, "big slots: bad reduction buffer");
    } else {
        (void)big_reduce(b, (int)k, off, v.buf, v.len, op, type, hw ? w.buf : NULL); /* sets the error */
        if (b->released && !b->busy) big_free(b);
    }
    if (hw) PyBuffer_Release(&w);
    PyBuffer_Release(&v);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static void big_copy_out(Big *b, int k, char *out, Py_ssize_t src, Py_ssize_t off, Py_ssize_t stride,
                         Py_ssize_t chunk) {
    int nogil = chunk * (src >= 0 ? 1 : b->n) >= BIG_NOGIL;
    PyThreadState *ts = NULL;
    if (nogil) {
        b->busy++;
        ts = PyEval_SaveThread();
    }
    if (src >= 0)
        copy_bytes(out + off, b->buf[k][src], (size_t)chunk);
    else
        for (Py_ssize_t m = 0; m < b->n; m++) copy_bytes(out + m * stride + off, b->buf[k][m], (size_t)chunk);
    if (nogil) {
        PyEval_RestoreThread(ts);
        b->busy--;
    }
}

/* the copy-out arguments (out, src, off, stride, chunk) of sync_copy / copy; 0 valid, 1 invalid */
static int big_copy_args(Big *b, PyObject *const *args, Py_buffer *o, Py_ssize_t *src, Py_ssize_t *off,
                         Py_ssize_t *stride, Py_ssize_t *chunk) {
    *src = PyLong_AsSsize_t(args[1]);
    *off = PyLong_AsSsize_t(args[2]);
    *stride = PyLong_AsSsize_t(args[3]);
    *chunk = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return -1;
    if (*src < -1 || *src >= b->n || *off < 0 || *stride < 0 || *chunk < 0 || *chunk > b->bytes) return 1;
    Py_ssize_t last = *src >= 0 ? *off + *chunk : (b->n - 1) * *stride + *off + *chunk;
    return last > o->len ? 1 : 0;
}

/* sync_copy(data, k, val, end, check, out, src, off, stride, chunk) -> -3 (bad sizes: nothing done), else as sync.
 * Copies data (None: nothing) into this member's buffer k, syncs, and when complete copies into out (None:
 * nothing) the first `chunk` bytes of member src's buffer k at byte `off`, or with src -1 every member m's at
 * `off + m * stride` */
static PyObject *Big_sync_copy(Big *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "sync_copy(data, k, val, end, check, out, src, off, stride, chunk)");
        return NULL;
    }
    unsigned long long val, end;
    uint32_t check;
    if (big_live(b) || big_counts(args + 2, &val, &end, &check)) return NULL;
    long k = PyLong_AsLong(args[1]);
    if (k == -1 && PyErr_Occurred()) return NULL;
    Py_buffer d, o;
    d.buf = o.buf = NULL;
    d.len = o.len = 0;
    int hd = args[0] != Py_None, ho = args[5] != Py_None, r = R_MISALIGNED, bad = 0;
    Py_ssize_t src = 0, off = 0, stride = 0, chunk = 0;
    if (hd && PyObject_GetBuffer(args[0], &d, PyBUF_SIMPLE) < 0) return NULL;
    if (ho && PyObject_GetBuffer(args[5], &o, PyBUF_WRITABLE) < 0) {
        if (hd) PyBuffer_Release(&d);
        return NULL;
    }
    if (ho) {
        bad = big_copy_args(b, args + 5, &o, &src, &off, &stride, &chunk);
        if (bad < 0) goto out;
    }
    if (!bad && (k == 0 || k == 1) && d.len <= b->bytes) {
        if (d.len) {
            char *mine = b->buf[k][b->me];
            if (d.len >= BIG_NOGIL) {
                b->busy++;
                Py_BEGIN_ALLOW_THREADS copy_bytes(mine, d.buf, (size_t)d.len);
                Py_END_ALLOW_THREADS b->busy--;
            } else {
                copy_bytes(mine, d.buf, (size_t)d.len);
            }
        }
        r = b->released ? R_WAIT : big_sync(b, val, end, check);
        if (r >= 0 && ho && !b->released) big_copy_out(b, (int)k, o.buf, src, off, stride, chunk);
        if (b->released && !b->busy) big_free(b);
    }
out:
    if (hd) PyBuffer_Release(&d);
    if (ho) PyBuffer_Release(&o);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLong(r);
}

/* copy(out, k, src, off, stride, chunk): sync_copy's copy out of buffer k (after the caller saw the sync end) */
static PyObject *Big_copy(Big *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "copy(out, k, src, off, stride, chunk)");
        return NULL;
    }
    if (big_live(b)) return NULL;
    long k = PyLong_AsLong(args[1]);
    if (k == -1 && PyErr_Occurred()) return NULL;
    Py_buffer o;
    if (PyObject_GetBuffer(args[0], &o, PyBUF_WRITABLE) < 0) return NULL;
    PyObject *a5[5] = {args[0], args[2], args[3], args[4], args[5]};
    Py_ssize_t src, off, stride, chunk;
    int bad = big_copy_args(b, a5, &o, &src, &off, &stride, &chunk);
    if (!bad && (k == 0 || k == 1)) {
        big_copy_out(b, (int)k, o.buf, src, off, stride, chunk);
        if (b->released && !b->busy) big_free(b);
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "big slots: bad copy");
    }
    PyBuffer_Release(&o);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Big_arrived(Big *b, PyObject *unused) {
    if (b->released || !b->bufs || !b->synced) Py_RETURN_FALSE;
    return PyBool_FromLong(big_arrived(b));
}

static PyObject *Big_release(Big *b, PyObject *unused) {
    b->released = 1;
    if (!b->busy) big_free(b);
    Py_RETURN_NONE;
}

static PyMethodDef Big_methods[] = {
    {"sync", (PyCFunction)(void (*)(void))Big_sync, METH_FASTCALL,
     "sync(val, end, check) -> -1 not complete, 0 complete, 1 complete and a member sleeps"},
    {"sync_reduce", (PyCFunction)(void (*)(void))Big_sync_reduce, METH_FASTCALL,
     "sync_reduce(buf, k, val, end, check, op, type, reduce) -> as sync, or -3 (nothing done); copies buf into "
     "buffer k first, reduces every member's buffer k into buf when complete and reduce"},
    {"reduce", (PyCFunction)(void (*)(void))Big_reduce, METH_FASTCALL,
     "reduce(out, k, off, op, type): every member's buffer k from byte off, reduced into out"},
    {"sync_copy", (PyCFunction)(void (*)(void))Big_sync_copy, METH_FASTCALL,
     "sync_copy(data, k, val, end, check, out, src, off, stride, chunk) -> as sync, or -3 (nothing done); copies "
     "data into buffer k first, and member src's buffer k (src -1: every member's) into out when complete"},
    {"copy", (PyCFunction)(void (*)(void))Big_copy, METH_FASTCALL,
     "copy(out, k, src, off, stride, chunk): sync_copy's copy out"},
    {"arrived", (PyCFunction)Big_arrived, METH_NOARGS, "True when every member passed the last sync"},
    {"release", (PyCFunction)Big_release, METH_NOARGS, "drop the exports of the mappings"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BigType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "procgroup.transport.shm._native.Big",
    .tp_basicsize = sizeof(Big),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Every member's big slots of one group (see bigarena.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Big_init,
    .tp_dealloc = (destructor)Big_dealloc,
    .tp_methods = Big_methods,
};

/* ---- all_to_all (procgroup.algorithms.alltoall_shm): one call writes this rank's header and stream (its pieces
 * for the other ranks, in rank order) into its arena slot -- or, for a stream beyond the slot, the stream into
 * its big buffer `bk` (one window: at most `lim` bytes) -- publishes, polls, and copies out its own piece and
 * every other rank's piece for it, from that rank's slot or big buffer (every rank reads every header, so all
 * agree which).  `send` and `recv` are one buffer each (all_to_all_single) or tuples of buffers (the list form);
 * the layout comes from the caller in `spec` (int64 words):
 *   [p, me, hb, stream, nseg, noth, own_sbi (-1: no own piece), own_src, own_rbi, own_lo, own_hi,
 *    then nseg x (pos, sbi, a, b): stream bytes [pos, pos + b - a) are send[sbi][a:b],
 *    then noth x (rank, rbi, dst, want): that rank's piece (want bytes) lands at recv[rbi][dst:]]
 * Anything else (a stream of several big-slot windows, one beyond `lim`, counts that disagree) returns
 * A2A_PYTHON having copied nothing: Python then reads the slots itself (algorithms.alltoall_shm), as on the
 * pure-Python path, so the protocol (and every error) is the same on both. */
#define A2A_BIG 2
#define A2A_PYTHON 4
#define A2A_FIXED 11
#define A2A_MAXBUF 4096


typedef struct {
    Py_buffer spec, *bufs; /* bufs: the send buffers, then the recv buffers */
    Py_ssize_t ns, nr, held;
    int hs;
    const int64_t *q;
    Big *big;
    int bk;
    Py_ssize_t lim;
} A2A;

static void a2a_release(A2A *x) {
    if (x->hs) PyBuffer_Release(&x->spec);
    for (Py_ssize_t i = 0; i < x->held; i++) PyBuffer_Release(&x->bufs[i]);
    PyMem_Free(x->bufs);
    x->bufs = NULL;
    x->hs = 0;
    x->held = 0;
}

/* one buffer, or a tuple of them: how many */
static Py_ssize_t a2a_count(PyObject *o) { return PyTuple_Check(o) ? PyTuple_GET_SIZE(o) : 1; }

static int a2a_get(A2A *x, PyObject *o, Py_ssize_t n, int flags) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyTuple_Check(o) ? PyTuple_GET_ITEM(o, i) : o;
        if (PyObject_GetBuffer(b, &x->bufs[x->held], flags) < 0) return -1;
        x->held++;
    }
    return 0;
}

/* the buffers and the big slots; -1 with an exception, 1 when the spec does not fit these buffers (-3) */
static int a2a_args(Slots *s, A2A *x, PyObject *spec, PyObject *send, PyObject *recv, PyObject *big, PyObject *bk,
                    PyObject *lim) {
    memset(x, 0, sizeof(*x));
    if (big != Py_None && !PyObject_TypeCheck(big, &BigType)) {
        PyErr_SetString(PyExc_TypeError, "exchange_a2a: big must be the group's big slots or None");
        return -1;
    }
    x->big = big == Py_None ? NULL : (Big *)big;
    long k = PyLong_AsLong(bk);
    x->lim = PyLong_AsSsize_t(lim);
    if (PyErr_Occurred()) return -1;
    x->bk = (int)(k & 1);
    x->ns = a2a_count(send);
    x->nr = a2a_count(recv);
    if (x->ns < 1 || x->nr < 1 || x->ns > A2A_MAXBUF || x->nr > A2A_MAXBUF) return 1;
    if (!(x->bufs = PyMem_Malloc(sizeof(Py_buffer) * (size_t)(x->ns + x->nr)))) {
        PyErr_NoMemory();
        return -1;
    }
    /* a buffer that is not one contiguous block (or a read-only recv): nothing done, Python's path says what */
    if (PyObject_GetBuffer(spec, &x->spec, PyBUF_SIMPLE) < 0) goto nobuf;
    x->hs = 1;
    if (a2a_get(x, send, x->ns, PyBUF_SIMPLE) < 0 || a2a_get(x, recv, x->nr, PyBUF_WRITABLE) < 0) goto nobuf;
    if (x->big && (x->big->released || !x->big->bufs)) x->big = NULL;
    if (!x->big || x->lim < 0) x->lim = 0;
    if (x->big && x->lim > x->big->bytes) x->lim = x->big->bytes;
    const int64_t *q = x->spec.buf;
    Py_ssize_t nq = x->spec.len / 8;
    if (x->spec.len % 8 || (uintptr_t)q % 8 || nq < A2A_FIXED) return 1;
    x->q = q;
    int64_t p = q[0], me = q[1], hb = q[2], mine = q[3], nseg = q[4], noth = q[5], ns = x->ns, nr = x->nr;
    if (p != s->n || me != s->me || hb < 16 * (p + 1) || hb % 64 || hb > s->max_bytes || mine < 0 || nseg < 0 ||
        noth < 0 || nq != A2A_FIXED + 4 * (nseg + noth))
        return 1;
    const Py_buffer *sb = x->bufs, *rb = x->bufs + ns;
    if (q[6] >= 0 && (q[6] >= ns || q[7] < 0 || q[8] < 0 || q[8] >= nr || q[9] < 0 || q[10] < q[9] ||
                      q[10] > rb[q[8]].len || q[7] + (q[10] - q[9]) > sb[q[6]].len))
        return 1;
    const int64_t *g = q + A2A_FIXED;
    for (int64_t i = 0; i < nseg; i++, g += 4)
        if (g[0] < 0 || g[1] < 0 || g[1] >= ns || g[2] < 0 || g[3] < g[2] || g[3] > sb[g[1]].len ||
            g[0] + (g[3] - g[2]) > mine)
            return 1;
    for (int64_t i = 0; i < noth; i++, g += 4)
        if (g[0] < 0 || g[0] >= p || g[0] == me || g[1] < 0 || g[1] >= nr || g[2] < 0 || g[3] < 0 ||
            g[2] + g[3] > rb[g[1]].len)
            return 1;
    return 0;
nobuf:
    PyErr_Clear();
    return 1;
}

/* every stream's pieces for this rank into recv (the last exchange complete): 0 or A2A_BIG, or A2A_PYTHON (nothing
 * copied) */
static int a2a_finish(Slots *s, A2A *x) {
    const int64_t *q = x->q;
    int64_t p = q[0], me = q[1], hb = q[2], nseg = q[4], noth = q[5];
    int64_t cap = s->max_bytes - hb;
    char *const *sl = s->slot[s->k];
    int any_big = q[3] > cap;
    for (int64_t i = 0; i < p; i++) {
        if (i == me) continue;
        uint64_t n = ((const uint64_t *)(sl[i] + SLOT_HDR))[p];
        if (n > (uint64_t)cap) {
            if (!x->big || n > (uint64_t)x->lim) return A2A_PYTHON;
            any_big = 1;
        }
    }
    const int64_t *o = q + A2A_FIXED + 4 * nseg;
    if (any_big) { /* every pair, as _mismatch: a rank that fails here fails on every rank */
        for (int64_t r = 0; r < p; r++) {
            const uint64_t *hr = (const uint64_t *)(sl[r] + SLOT_HDR);
            for (int64_t j = 0; j < p; j++) {
                const uint64_t *hj = (const uint64_t *)(sl[j] + SLOT_HDR);
                if (r != j && hr[j + 1] - hr[j] != hj[p + 2 + r] - hj[p + 1 + r]) return A2A_PYTHON;
            }
        }
    }
    int own = q[6] >= 0 && s->a2a_own != s->count; /* not copied yet (exchange_a2a copies it while waiting) */
    Py_ssize_t total = own ? q[10] - q[9] : 0;
    for (int64_t i = 0; i < noth; i++) {
        const int64_t *e = o + 4 * i;
        const uint64_t *h = (const uint64_t *)(sl[e[0]] + SLOT_HDR);
        uint64_t lo = h[me], hi = h[me + 1], n = h[p];
        if (hi < lo || hi - lo != (uint64_t)e[3] || hi > n) return A2A_PYTHON;
        total += e[3];
    }
    Big *b = x->big;
    int nogil = total >= BIG_NOGIL;
    PyThreadState *ts = NULL;
    if (nogil) {
        s->busy++;
        if (b) b->busy++;
        ts = PyEval_SaveThread();
    }
    const Py_buffer *sb = x->bufs, *rb = x->bufs + x->ns;
    if (own) copy_bytes((char *)rb[q[8]].buf + q[9], (const char *)sb[q[6]].buf + q[7], (size_t)(q[10] - q[9]));
    for (int64_t i = 0; i < noth; i++) {
        const int64_t *e = o + 4 * i;
        if (!e[3]) continue;
        const uint64_t *h = (const uint64_t *)(sl[e[0]] + SLOT_HDR);
        uint64_t lo = h[me], n = h[p];
        const char *src = n <= (uint64_t)cap ? sl[e[0]] + SLOT_HDR + hb + lo : b->buf[x->bk][e[0]] + lo;
        copy_bytes((char *)rb[e[1]].buf + e[2], src, (size_t)e[3]);
    }
    if (nogil) {
        PyEval_RestoreThread(ts);
        s->busy--;
        if (b) {
            b->busy--;
            if (b->released && !b->busy) big_free(b);
        }
        if (s->released && !s->busy) free_bufs(s);
    }
    return any_big ? A2A_BIG : 0;
}

/* exchange_a2a(spec, head, send, recv, check, big, bk, lim): see above */
static PyObject *Slots_exchange_a2a(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "exchange_a2a(spec, head, send, recv, check, big, bk, lim)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    unsigned long check = PyLong_AsUnsignedLongMask(args[4]);
    if (check == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    A2A x;
    Py_buffer h;
    int bad = a2a_args(s, &x, args[0], args[2], args[3], args[5], args[6], args[7]), r = R_MISALIGNED;
    if (bad < 0) goto out;
    if (PyObject_GetBuffer(args[1], &h, PyBUF_SIMPLE) < 0) goto out;
    if (!bad && h.len <= x.q[2]) {
        const int64_t *q = x.q;
        int64_t hb = q[2], mine = q[3], nseg = q[4];
        int k = (int)(s->count & 1);
        char *slot = s->slot[k][s->me] + SLOT_HDR, *dst = NULL;
        if (mine <= s->max_bytes - hb)
            dst = slot + hb;
        else if (x.big && mine <= x.lim)
            dst = x.big->buf[x.bk][s->me];
        if (dst) {
            memcpy(slot, h.buf, (size_t)h.len);
            const int64_t *g = q + A2A_FIXED;
            int nogil = mine >= BIG_NOGIL;
            PyThreadState *ts = NULL;
            if (nogil) {
                s->busy++;
                if (x.big) x.big->busy++;
                ts = PyEval_SaveThread();
            }
            for (int64_t i = 0; i < nseg; i++, g += 4)
                copy_bytes(dst + g[0], (const char *)x.bufs[g[1]].buf + g[2], (size_t)(g[3] - g[2]));
            if (nogil) {
                PyEval_RestoreThread(ts);
                s->busy--;
                if (x.big) x.big->busy--;
            }
            if (s->released || (x.big && x.big->released)) {
                if (x.big && x.big->released && !x.big->busy) big_free(x.big);
                r = R_WAIT; /* the sleep loop raises the close */
                if (s->released && !s->busy) free_bufs(s);
            } else {
                r = publish_only(s, NULL, 0, (uint32_t)check);
                if (q[6] >= 0) { /* our own piece while the others arrive */
                    size_t n = (size_t)(q[10] - q[9]);
                    char *to = (char *)x.bufs[x.ns + q[8]].buf + q[9];
                    const char *from = (const char *)x.bufs[q[6]].buf + q[7];
                    if (n >= BIG_NOGIL) {
                        s->busy++;
                        Py_BEGIN_ALLOW_THREADS copy_bytes(to, from, n);
                        Py_END_ALLOW_THREADS s->busy--;
                        if (s->released) {
                            if (!s->busy) free_bufs(s);
                            r = R_WAIT; /* the sleep loop raises the close */
                        }
                    } else {
                        copy_bytes(to, from, n);
                    }
                    s->a2a_own = s->count;
                }
                if (r == R_WAIT && !s->released) r = spin_wait(s);
                if (r >= 0 && !s->released) r |= a2a_finish(s, &x);
            }
        }
    }
    PyBuffer_Release(&h);
out:
    a2a_release(&x);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLong(r);
}

/* a2a_finish(spec, send, recv, big, bk, lim): exchange_a2a's copy out, after the caller saw the exchange complete */
static PyObject *Slots_a2a_finish(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "a2a_finish(spec, send, recv, big, bk, lim)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    A2A x;
    int bad = a2a_args(s, &x, args[0], args[1], args[2], args[3], args[4], args[5]), r = A2A_PYTHON;
    if (!bad) r = a2a_finish(s, &x);
    a2a_release(&x);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLong(r);
}

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_native", "Compiled fast path of the shm arena (optional).", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&SlotsType) < 0 || PyType_Ready(&BigType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&SlotsType);
    if (PyModule_AddObject(m, "Slots", (PyObject *)&SlotsType) < 0) {
        Py_DECREF(&SlotsType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&BigType);
    if (PyModule_AddObject(m, "Big", (PyObject *)&BigType) < 0) {
        Py_DECREF(&BigType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "SLOT_HDR", SLOT_HDR) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

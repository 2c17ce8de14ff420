/* The one-way queue of procgroup.transport.shm._native (see _native.c). */

#include "_native.h"

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
PyObject *Slots_queue_init(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *Slots_q_post(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
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
            if (b.len) copy_to_shared(e + Q_HDR, b.buf, (size_t)b.len, STREAM_WHOLE_OF(s->n));
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
PyObject *Slots_q_read(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *Slots_q_gather(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *Slots_q_ack(Slots *s, PyObject *unused) {
    if (check_live(s)) return NULL;
    if (s->qheld) {
        s->qheld = 0;
        q_complete(s);
    }
    Py_RETURN_NONE;
}

PyObject *Slots_q_ready(Slots *s, PyObject *unused) {
    if (s->released || !s->bufs || !s->qreg) Py_RETURN_FALSE;
    return PyBool_FromLong(q_poll(s));
}

/* q_missing(): indices of the members the pending wait still waits for */
PyObject *Slots_q_missing(Slots *s, PyObject *unused) {
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

/* The arena exchange of procgroup.transport.shm._native (see _native.c): publish this member's payload, fence,
 * poll every member's slot, spin with the GIL released; and the Slots methods that copy or inspect the slots. */

#include "_native.h"

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
 * behaves as an oversubscribed one, and an idle CPU returns from sched_yield at once.
 * A yield that kept us off the CPU for more than LONG_YIELD_NS, with the members still missing, ends the spin:
 * another thread (not the member we wait for, who would have arrived) had our CPU for a time slice, and each
 * further yield would hand it another one (EEVDF pushes a yielding task's deadline back by a slice: a big
 * all_reduce beside a busy compute thread, as DDP runs it, took 160 ms instead of 8; 4 ranks on 2 CPUs, 64 KiB
 * all_reduce 283 against 534 us, three rounds summed).  The caller then sleeps on its doorbell, and the last
 * member to arrive wakes it at once. */
static int spin(Slots *s, int k, uint32_t val, uint32_t check) {
    long long start = now_ns(), end = start + s->spin_ns, pure = s->yield ? start : start + PURE_SPIN_NS;
    for (;;) {
        long long now = now_ns();
        int yld = now >= pure;
        for (int j = 0; j < (yld ? 1 : 64); j++) {
            if (all_arrived(s, k, val, check)) return 1;
            if (yld) {
                if (yield_was_long()) return all_arrived(s, k, val, check);
            } else {
                CPU_RELAX();
            }
        }
        if (__atomic_load_n(&s->released, __ATOMIC_RELAXED) || now >= end) return 0;
    }
}

/* publish, fence, check: R_RING (we completed the call and a member's sleep flag is up: the caller rings its
 * doorbell), R_DONE (complete, nobody to wake), R_WAIT (not complete) */
int publish_only(Slots *s, const char *data, Py_ssize_t nbytes, uint32_t check) {
    check ^= s->chain; /* the one-way calls since the group began (queue.py): members that disagree never meet */
    int k = (int)(s->count & 1);
    s->count++;
    uint32_t val = (uint32_t)((s->count - 1) % 0xFFFFFFFFULL + 1); /* never 0 (0: never published) */
    char *mine = s->slot[k][s->me];
    if (nbytes) copy_to_shared(mine + SLOT_HDR, data, (size_t)nbytes, STREAM_WHOLE_OF(s->n));
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
int spin_wait(Slots *s) {
    if (s->spin_ns <= 0) return R_WAIT;
    int ok;
    s->busy++;
    Py_BEGIN_ALLOW_THREADS ok = spin(s, s->k, s->val, s->check);
    Py_END_ALLOW_THREADS s->busy--;
    if (s->released && !s->busy) free_bufs(s);
    return ok && !s->released ? R_DONE : R_WAIT;
}

PyObject *Slots_exchange(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *Slots_exchange_copy(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *Slots_copy(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
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

PyObject *Slots_arrived(Slots *s, PyObject *unused) {
    if (s->released || !s->bufs || !s->count) Py_RETURN_FALSE;
    return PyBool_FromLong(all_arrived(s, s->k, s->val, s->check));
}

/* missing(): indices of the members that have not published the last call (with its check word) */
PyObject *Slots_missing(Slots *s, PyObject *unused) {
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

PyObject *Slots_release(Slots *s, PyObject *unused) {
    s->released = 1;
    if (!s->busy) free_bufs(s);
    Py_RETURN_NONE;
}

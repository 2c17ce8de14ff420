/* The big slots of procgroup.transport.shm._native (see _native.c): the Big type. */

#include "_native.h"

/* ---- big slots (procgroup.transport.shm.bigarena): a header (u64 count, u32 check word) and two buffers per
 * member.  sync(val, wait, check) publishes the check word and then the count `val` (release), fences, and with
 * `wait` BIG_ALL polls until every member's count is `val` with this call's check word, or past `val` (that member
 * passed this step, which it only does after seeing ours agree); with BIG_NONE (a one-way step: a reduce's
 * non-root) it returns at once.  settle(val, check) polls as a BIG_ALL sync of `val` without publishing (a one-way
 * step's member before it writes its buffers again).  sync_reduce also copies the caller's buffer in first and
 * reduces every member's buffer into it after.  The counts are kept by the Python object (ShmBigArena), which
 * passes them in; the sleep loop stays in Python as for Slots. */
#define BIG_ALL (-1)
#define BIG_NONE (-2)
/* (struct Big and BIG_NOGIL are in _native.h) */

void big_free(Big *b) {
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
    if (b->wait == BIG_NONE) return 1;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        unsigned long long c = __atomic_load_n((unsigned long long *)b->hdr[i], __ATOMIC_ACQUIRE);
        if (c > b->val) continue;
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
            if (yld) {
                if (yield_was_long()) return big_arrived(b); /* see spin in _native_slots.c */
            } else {
                CPU_RELAX();
            }
        }
        if (__atomic_load_n(&b->released, __ATOMIC_RELAXED) || now >= end) return 0;
    }
}

/* poll for step `val` (b->wait); spin with the GIL released: R_RING / R_DONE / R_WAIT */
static int big_poll(Big *b, unsigned long long val, long long wait, uint32_t check) {
    b->val = val;
    b->wait = wait;
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

/* publish (check word, then the count), fence, then poll as big_poll */
static int big_sync(Big *b, unsigned long long val, long long wait, uint32_t check) {
    char *h = b->hdr[b->me];
    __atomic_store_n((uint32_t *)(h + 8), check, __ATOMIC_RELAXED);
    __atomic_store_n((unsigned long long *)h, val, __ATOMIC_RELEASE); /* our buffer and check before the count */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);                           /* before their counts and sleep flags */
    return big_poll(b, val, wait, check);
}

static int big_live(Big *b) {
    if (b->released || !b->bufs) {
        PyErr_SetString(PyExc_ValueError, "big slots were released");
        return -1;
    }
    return 0;
}

static int big_counts(PyObject *const *args, unsigned long long *val, long long *wait, uint32_t *check) {
    *val = PyLong_AsUnsignedLongLong(args[0]);
    *wait = PyLong_AsLongLong(args[1]);
    unsigned long c = PyLong_AsUnsignedLongMask(args[2]);
    if (PyErr_Occurred()) return -1;
    if (*wait != BIG_ALL && *wait != BIG_NONE) {
        PyErr_SetString(PyExc_ValueError, "big slots: wait must be -1 (every member) or -2 (none)");
        return -1;
    }
    *check = (uint32_t)c;
    return 0;
}

/* sync(val, wait, check) -> R_RING / R_DONE / R_WAIT */
static PyObject *Big_sync(Big *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sync(val, wait, check)");
        return NULL;
    }
    unsigned long long val;
    long long wait;
    uint32_t check;
    if (big_live(b) || big_counts(args, &val, &wait, &check)) return NULL;
    return PyLong_FromLong(big_sync(b, val, wait, check));
}

/* settle(val, check) -> R_RING / R_DONE / R_WAIT: as a sync of every member at `val`, without publishing */
static PyObject *Big_settle(Big *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "settle(val, check)");
        return NULL;
    }
    unsigned long long val = PyLong_AsUnsignedLongLong(args[0]);
    unsigned long c = PyLong_AsUnsignedLongMask(args[1]);
    if (big_live(b) || PyErr_Occurred()) return NULL;
    int r = big_poll(b, val, BIG_ALL, (uint32_t)c);
    return PyLong_FromLong(r == R_RING ? R_DONE : r); /* a settle publishes nothing: nobody to ring */
}

/* out = every member's buffer k from byte off on (this member's from `own` instead, where not NULL), reduced in
 * member order; -1: out of memory.  `own` may be out itself only for member 0 or 1: reduce_ptrs writes out from the
 * first two members' elements before it reads the third's */
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

/* n bytes at `from` into this member's buffer at `to` (copy_to_shared, of `kind`), with the GIL released from
 * BIG_NOGIL bytes on (busy keeps the mappings; the caller frees them where a release came meanwhile) */
static void big_copy_in(Big *b, char *to, const char *from, size_t n, int kind) {
    if (n >= BIG_NOGIL) {
        b->busy++;
        Py_BEGIN_ALLOW_THREADS copy_to_shared(to, from, n, kind);
        Py_END_ALLOW_THREADS b->busy--;
    } else {
        copy_to_shared(to, from, n, kind);
    }
}

/* sync_reduce(buf, k, val, wait, check, op, type, reduce) -> -3 (buf not aligned to its element size, or larger
 * than a buffer: nothing done), else as sync; copies buf into this member's buffer k first and, when the sync
 * completed and `reduce`, reduces every member's buffer k into buf (member order) */
static PyObject *Big_sync_reduce(Big *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 && nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "sync_reduce(buf, k, val, wait, check, op, type, reduce[, publish])");
        return NULL;
    }
    unsigned long long val;
    long long wait;
    uint32_t check;
    int op, type;
    if (big_live(b) || big_counts(args + 2, &val, &wait, &check) || parse_op(args[5], args[6], &op, &type))
        return NULL;
    long k = PyLong_AsLong(args[1]);
    int red = PyObject_IsTrue(args[7]);
    int pub = nargs == 9 ? PyObject_IsTrue(args[8]) : 1;
    if ((k == -1 && PyErr_Occurred()) || red < 0 || pub < 0) return NULL;
    if (!pub && (!red || b->me > 1)) {
        PyErr_SetString(PyExc_ValueError, "big slots: only a reducing member 0 or 1 may skip publishing its buffer");
        return NULL;
    }
    Py_buffer v;
    if (PyObject_GetBuffer(args[0], &v, red ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return NULL;
    int sz = type_size[type], r;
    if ((k != 0 && k != 1) || v.len > b->bytes || v.len % sz || (uintptr_t)v.buf % (uintptr_t)sz) {
        r = R_MISALIGNED;
    } else {
        char *mine = b->buf[k][b->me];
        /* an all_reduce's buffer is read whole by every member; a reduce's non-root's by the root alone, whose
         * reads from memory after streamed stores would be the call's critical path (N=4, 64 KiB: 93-118 us
         * streamed against 49-57 plain in the fast periods) */
        int kind = red ? STREAM_WHOLE_OF(b->n) : STREAM_PIECES;
        /* unpublished, nobody reads our buffer (a reduce's root): the reduction reads our part from buf itself */
        if (pub) big_copy_in(b, mine, v.buf, (size_t)v.len, kind);
        r = b->released ? R_WAIT : big_sync(b, val, wait, check);
        if (r >= 0 && red && !b->released &&
            big_reduce(b, (int)k, 0, v.buf, v.len, op, type, pub ? NULL : (char *)v.buf) < 0)
            r = -4;
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

/* copy member src's (src -1: every member's) chunk of buffer k into out (see sync_copy).  `own`: the data this
 * member copied into its buffer (NULL: unknown); where its own part of out is that very memory (an all_gather
 * whose input is its block of the output) that part is already in place and is not copied onto itself */
static void big_copy_out(Big *b, int k, char *out, Py_ssize_t src, Py_ssize_t off, Py_ssize_t stride,
                         Py_ssize_t chunk, const char *own) {
    int nogil = chunk * (src >= 0 ? 1 : b->n) >= BIG_NOGIL;
    PyThreadState *ts = NULL;
    if (nogil) {
        b->busy++;
        ts = PyEval_SaveThread();
    }
    if (src >= 0) {
        if (!(src == b->me && own == out + off)) copy_bytes(out + off, b->buf[k][src], (size_t)chunk);
    } else {
        for (Py_ssize_t m = 0; m < b->n; m++) {
            char *dst = out + m * stride + off;
            if (!(m == b->me && own == dst)) copy_bytes(dst, b->buf[k][m], (size_t)chunk);
        }
    }
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

/* sync_copy(data, k, val, wait, check, out, src, off, stride, chunk) -> -3 (bad sizes: nothing done), else as sync.
 * Copies data (None: nothing) into this member's buffer k, syncs, and when complete copies into out (None:
 * nothing) the first `chunk` bytes of member src's buffer k at byte `off`, or with src -1 every member m's at
 * `off + m * stride` */
static PyObject *Big_sync_copy(Big *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "sync_copy(data, k, val, wait, check, out, src, off, stride, chunk)");
        return NULL;
    }
    unsigned long long val;
    long long wait;
    uint32_t check;
    if (big_live(b) || big_counts(args + 2, &val, &wait, &check)) return NULL;
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
        if (d.len) big_copy_in(b, b->buf[k][b->me], d.buf, (size_t)d.len, STREAM_WHOLE_OF(b->n));
        r = b->released ? R_WAIT : big_sync(b, val, wait, check);
        if (r >= 0 && ho && !b->released)
            big_copy_out(b, (int)k, o.buf, src, off, stride, chunk, hd && d.len == chunk ? (char *)d.buf : NULL);
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
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "copy(out, k, src, off, stride, chunk[, data])");
        return NULL;
    }
    if (big_live(b)) return NULL;
    long k = PyLong_AsLong(args[1]);
    if (k == -1 && PyErr_Occurred()) return NULL;
    Py_buffer o, d;
    int hd = nargs == 7 && args[6] != Py_None;
    if (PyObject_GetBuffer(args[0], &o, PyBUF_WRITABLE) < 0) return NULL;
    if (hd && PyObject_GetBuffer(args[6], &d, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&o);
        return NULL;
    }
    PyObject *a5[5] = {args[0], args[2], args[3], args[4], args[5]};
    Py_ssize_t src, off, stride, chunk;
    int bad = big_copy_args(b, a5, &o, &src, &off, &stride, &chunk);
    if (!bad && (k == 0 || k == 1)) {
        big_copy_out(b, (int)k, o.buf, src, off, stride, chunk, hd && d.len == chunk ? (char *)d.buf : NULL);
        if (b->released && !b->busy) big_free(b);
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "big slots: bad copy");
    }
    if (hd) PyBuffer_Release(&d);
    PyBuffer_Release(&o);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* put(k, off, data, pieces): copy data into this member's buffer k at byte off (copy_to_shared: STREAM_PIECES
 * where `pieces`, each reader then taking its own part; else STREAM_WHOLE_OF the members) */
static PyObject *Big_put(Big *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "put(k, off, data, pieces)");
        return NULL;
    }
    if (big_live(b)) return NULL;
    long k = PyLong_AsLong(args[0]);
    Py_ssize_t off = PyLong_AsSsize_t(args[1]);
    int pieces = PyObject_IsTrue(args[3]);
    if (PyErr_Occurred() || pieces < 0) return NULL;
    Py_buffer d;
    if (PyObject_GetBuffer(args[2], &d, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if ((k != 0 && k != 1) || off < 0 || d.len > b->bytes - off) {
        PyErr_SetString(PyExc_ValueError, "big slots: bad put");
    } else if (d.len) {
        int kind = pieces ? STREAM_PIECES : STREAM_WHOLE_OF(b->n);
        big_copy_in(b, b->buf[k][b->me] + off, d.buf, (size_t)d.len, kind);
        if (b->released && !b->busy) big_free(b);
    }
    PyBuffer_Release(&d);
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
     "sync(val, wait, check) -> -1 not complete, 0 complete, 1 complete and a member sleeps"},
    {"settle", (PyCFunction)(void (*)(void))Big_settle, METH_FASTCALL,
     "settle(val, check) -> -1 not yet, 0 every member passed step val (with check)"},
    {"sync_reduce", (PyCFunction)(void (*)(void))Big_sync_reduce, METH_FASTCALL,
     "sync_reduce(buf, k, val, wait, check, op, type, reduce[, publish]) -> as sync, or -3 (nothing done); copies "
     "buf into buffer k first (not where publish is false: a reducing member 0 or 1 whose buffer nobody reads), "
     "reduces every member's buffer k (its own part: buf, where not published) into buf when complete and reduce"},
    {"reduce", (PyCFunction)(void (*)(void))Big_reduce, METH_FASTCALL,
     "reduce(out, k, off, op, type): every member's buffer k from byte off, reduced into out"},
    {"sync_copy", (PyCFunction)(void (*)(void))Big_sync_copy, METH_FASTCALL,
     "sync_copy(data, k, val, wait, check, out, src, off, stride, chunk) -> as sync, or -3 (nothing done); copies "
     "data into buffer k first, and member src's buffer k (src -1: every member's) into out when complete"},
    {"copy", (PyCFunction)(void (*)(void))Big_copy, METH_FASTCALL,
     "copy(out, k, src, off, stride, chunk[, data]): sync_copy's copy out (data: what sync_copy copied in; this "
     "member's part of out is not copied where it is that memory)"},
    {"put", (PyCFunction)(void (*)(void))Big_put, METH_FASTCALL,
     "put(k, off, data, pieces): data into this member's buffer k at byte off (streamed: see copy_to_shared)"},
    {"arrived", (PyCFunction)Big_arrived, METH_NOARGS, "True when the last sync or settle is complete"},
    {"release", (PyCFunction)Big_release, METH_NOARGS, "drop the exports of the mappings"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject BigType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "procgroup.transport.shm._native.Big",
    .tp_basicsize = sizeof(Big),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Every member's big slots of one group (see bigarena.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Big_init,
    .tp_dealloc = (destructor)Big_dealloc,
    .tp_methods = Big_methods,
};

/* One-copy reads between the members of one host, compiled (see _native.c): algorithms.onecopy's protocol in one
 * C call -- an opening exchange that offers every member's buffer address, the reads (process_vm_readv straight out
 * of the owners' buffers into the caller's), and a closing exchange after which every owner may change its buffer
 * again.  The slot layout and check words are those of onecopy.read_directly (two u64 words: "can read", address),
 * so a member on this path and one on the pure-Python path take part in the same call.
 *
 * Modes (which piece of whose buffer lands where; p members, me this one):
 *   RD_GATHER  all_gather: recv[j*n, (j+1)*n) = member j's send (n bytes each); own part copied locally
 *   RD_BCAST   broadcast: a non-root's buffer = the root's (n bytes); the root only takes part in the exchanges
 * Each rank starts its reads at its right neighbour, so the reads spread over the owners.  (all_to_all reads
 * inside its own compiled call, _native_a2a.c, where its headers carry the offers.) */

#include "_native.h"

#include <errno.h>
#include <sys/uio.h>

enum { RD_GATHER = 0, RD_BCAST = 1 };
#define RD_PENDING (-1)    /* the opening exchange is not complete: the caller sleeps on it, then read_finish */
#define RD_CLOSING (-5)    /* read, but the closing exchange is not complete: the caller sleeps on it, then returns */
#define RD_FALLBACK (-6)   /* a member cannot read the others: nothing moved; every member returns this */
#define RD_RING_FIRST (-8) /* the opening exchange completed with a member asleep: the caller rings, then read_finish */

/* the whole of [addr, addr + n) of process pid into dst: 0, or the errno of the read that failed */
int cma_read(pid_t pid, char *dst, uint64_t addr, size_t n) {
    while (n) {
        struct iovec l = {dst, n}, r = {(void *)(uintptr_t)addr, n};
        ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (got == 0) return EFAULT;
        dst += got;
        addr += (uint64_t)got;
        n -= (size_t)got;
    }
    return 0;
}

/* the reads of the last call (its opening exchange complete); 0, RD_FALLBACK or RD_FAILED */
static int rd_reads(Slots *s, char *send, Py_ssize_t n, char *recv, int mode, Py_ssize_t root) {
    Py_ssize_t p = s->n, me = s->me;
    char *const *sl = s->slot[s->k];
    for (Py_ssize_t i = 0; i < p; i++)
        if (!((const uint64_t *)(sl[i] + SLOT_HDR))[0]) return RD_FALLBACK;
    if (mode == RD_BCAST && me == root) return 0;
    int err = 0;
    Py_ssize_t bad = -1;
    int nogil = (mode == RD_BCAST ? n : n * (p - 1)) >= BIG_NOGIL;
    s->busy++;
    PyThreadState *ts = nogil ? PyEval_SaveThread() : NULL;
    if (mode == RD_GATHER && recv + me * n != send) memmove(recv + me * n, send, (size_t)n);
    for (Py_ssize_t t = 1; t < p && !err; t++) {
        Py_ssize_t j = mode == RD_BCAST ? root : (me + t) % p;
        uint64_t addr = ((const uint64_t *)(sl[j] + SLOT_HDR))[1];
        err = cma_read(s->pids[j], mode == RD_BCAST ? send : recv + j * n, addr, (size_t)n);
        if (err) bad = j;
        if (mode == RD_BCAST) break;
    }
    if (ts) PyEval_RestoreThread(ts);
    s->busy--;
    if (s->released && !s->busy) free_bufs(s);
    if (err) {
        s->rd_errno = err;
        s->rd_peer = bad;
        return RD_FAILED;
    }
    s->rd_calls++;
    return 0;
}

/* the reads and the closing exchange (check end) of the last call, whose opening exchange completed */
static int rd_finish(Slots *s, char *send, Py_ssize_t n, char *recv, uint32_t end, int mode, Py_ssize_t root) {
    int r = rd_reads(s, send, n, recv, mode, root);
    if (r) return r;
    if (s->released) return RD_CLOSING; /* the caller's sleep sees the release and raises */
    r = publish_only(s, NULL, 0, end);
    if (r == R_WAIT) r = spin_wait(s);
    return r == R_WAIT ? RD_CLOSING : r;
}

typedef struct {
    Py_buffer sb, rb;
    int have_r;
    uint32_t check, end;
    int mode;
    Py_ssize_t root;
} rd_args;

/* parse (send, recv, [check,] end, mode, root) from args[0..]; -1 with an exception set; R_MISALIGNED: the sizes
 * do not fit the mode (nothing done, buffers released) */
static int rd_parse(Slots *s, PyObject *const *args, Py_ssize_t nargs, int with_check, rd_args *a) {
    Py_ssize_t want = with_check ? 6 : 5;
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, with_check ? "exchange_read(send, recv, check, end, mode, root)"
                                                    : "read_finish(send, recv, end, mode, root)");
        return -1;
    }
    if (check_live(s)) return -1;
    int i = 2;
    unsigned long check = 0;
    if (with_check) {
        check = PyLong_AsUnsignedLongMask(args[i++]);
        if (check == (unsigned long)-1 && PyErr_Occurred()) return -1;
    }
    unsigned long end = PyLong_AsUnsignedLongMask(args[i++]);
    long mode = PyLong_AsLong(args[i++]);
    Py_ssize_t root = PyLong_AsSsize_t(args[i]);
    if (PyErr_Occurred()) return -1;
    if (mode < RD_GATHER || mode > RD_BCAST || (mode == RD_BCAST && (root < 0 || root >= s->n))) {
        PyErr_SetString(PyExc_ValueError, "exchange_read: bad mode or root");
        return -1;
    }
    a->check = (uint32_t)check;
    a->end = (uint32_t)end;
    a->mode = (int)mode;
    a->root = root;
    int writes = mode == RD_BCAST && root != s->me; /* a broadcast's reader writes its buffer; the root only offers */
    if (PyObject_GetBuffer(args[0], &a->sb, writes ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    a->have_r = mode != RD_BCAST;
    if (a->have_r && PyObject_GetBuffer(args[1], &a->rb, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&a->sb);
        return -1;
    }
    Py_ssize_t n = a->sb.len;
    int fits = mode == RD_BCAST || a->rb.len >= n * s->n;
    if (!fits) {
        PyBuffer_Release(&a->sb);
        if (a->have_r) PyBuffer_Release(&a->rb);
        return R_MISALIGNED;
    }
    return 0;
}

static void rd_release(rd_args *a) {
    PyBuffer_Release(&a->sb);
    if (a->have_r) PyBuffer_Release(&a->rb);
}

/* exchange_read(send, recv, check, end, mode, root): the whole call (see the top of this file) */
PyObject *Slots_exchange_read(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    rd_args a;
    int r = rd_parse(s, args, nargs, 1, &a);
    if (r) return r < 0 ? NULL : PyLong_FromLong(r);
    char *send = a.sb.buf, *recv = a.have_r ? a.rb.buf : a.sb.buf;
    uint64_t offer[2] = {s->pids != NULL, a.mode == RD_BCAST && s->me != a.root ? 0 : (uint64_t)(uintptr_t)send};
    r = publish_only(s, (const char *)offer, (Py_ssize_t)sizeof offer, a.check);
    if (r == R_WAIT) r = spin_wait(s);
    if (r == R_WAIT)
        r = RD_PENDING;
    else if (r == R_RING)
        r = RD_RING_FIRST;
    else
        r = rd_finish(s, send, a.sb.len, recv, a.end, a.mode, a.root);
    rd_release(&a);
    return PyLong_FromLong(r);
}

/* read_finish(send, recv, end, mode, root): the reads and the closing exchange, after the caller saw the opening
 * exchange complete (exchange_read returned RD_PENDING or RD_RING_FIRST) */
PyObject *Slots_read_finish(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    rd_args a;
    int r = rd_parse(s, args, nargs, 0, &a);
    if (r) return r < 0 ? NULL : PyLong_FromLong(r);
    r = rd_finish(s, a.sb.buf, a.sb.len, a.have_r ? a.rb.buf : a.sb.buf, a.end, a.mode, a.root);
    rd_release(&a);
    return PyLong_FromLong(r);
}

/* set_pids(pids): every member's process id (this member's ignored), whose memory this process can read; until
 * then (or with an empty sequence) exchange_read offers "cannot read" and every member falls back */
PyObject *Slots_set_pids(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "set_pids(pids)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    PyObject *f = PySequence_Fast(args[0], "pids must be a sequence");
    if (!f) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(f);
    PyMem_Free(s->pids);
    s->pids = NULL;
    if (m == 0) {
        Py_DECREF(f);
        Py_RETURN_NONE;
    }
    if (m != s->n) {
        Py_DECREF(f);
        PyErr_SetString(PyExc_ValueError, "set_pids: one process id a member");
        return NULL;
    }
    pid_t *v = PyMem_Malloc((size_t)m * sizeof(pid_t));
    if (!v) {
        Py_DECREF(f);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        long x = PyLong_AsLong(PySequence_Fast_GET_ITEM(f, i));
        if (x == -1 && PyErr_Occurred()) {
            PyMem_Free(v);
            Py_DECREF(f);
            return NULL;
        }
        v[i] = (pid_t)x;
    }
    Py_DECREF(f);
    s->pids = v;
    Py_RETURN_NONE;
}

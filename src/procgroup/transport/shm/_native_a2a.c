/* all_to_all's exchange in procgroup.transport.shm._native (see _native.c). */

#include "_native.h"

/* ---- all_to_all (procgroup.algorithms.alltoall_shm): one call writes this rank's header and stream (its pieces
 * for the other ranks, in rank order) into its arena slot -- or, for a stream beyond the slot, the stream into
 * its big buffer `bk` (one window: at most `lim` bytes) -- publishes, polls, and copies out its own piece and
 * every other rank's piece for it, from that rank's slot or big buffer (every rank reads every header, so all
 * agree which).  `send` and `recv` are one buffer each (all_to_all_single) or tuples of buffers (the list form);
 * the layout comes from the caller in `spec` (int64 words):
 *   [p, me, hb, stream, nseg, noth, own_sbi (-1: no own piece), own_src, own_rbi, own_lo, own_hi, own_sent,
 *    then nseg x (pos, sbi, a, b): stream bytes [pos, pos + b - a) are send[sbi][a:b],
 *    then noth x (rank, rbi, dst, want): that rank's piece (want bytes) lands at recv[rbi][dst:]]
 * (own_sent: the bytes of send that the stream skips, this rank's own piece.)
 * Streams longer than `beyond` (the streams' limit, select.BIG_LIMIT['all_to_all']; or any beyond the slot where
 * the group has no big slots) are read straight out of their senders' send buffer, as alltoall_shm's offered
 * reads: every rank writes its offer into its header (its send buffer's address, own_sent, "can read": set_pids
 * was called; one send buffer only), and where the longest stream is beyond `beyond` and
 * every header offers, every rank reads its pieces with process_vm_readv and publishes the exchange that ends the
 * call (check word: the call's ^ 1 ^ END_SALT, alltoall_shm's).  `beyond` < 0: never (Python decides).
 * Anything else (a stream of several big-slot windows, one beyond `lim`, an offer missing, counts that disagree)
 * returns A2A_PYTHON having copied nothing: Python then reads the slots itself (algorithms.alltoall_shm), as on
 * the pure-Python path, so the protocol (and every error) is the same on both. */
#define A2A_BIG 2
#define A2A_PYTHON 4
#define A2A_CLOSING 16 /* read; the closing exchange is not complete: the caller sleeps on it */
#define A2A_DEFER 32   /* the exchange completed with a member asleep and the pieces are to be read: the caller
                          rings, then calls a2a_finish (nothing copied) */
#define A2A_READ 64    /* the pieces were read (bit 0 is then the closing exchange's) */
#define A2A_FIXED 12
#define A2A_MAXBUF 4096


typedef struct {
    Py_buffer spec, *bufs; /* bufs: the send buffers, then the recv buffers */
    Py_ssize_t ns, nr, held;
    int hs;
    const int64_t *q;
    Big *big;
    int bk;
    Py_ssize_t lim, beyond;
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
                    PyObject *lim, PyObject *beyond) {
    memset(x, 0, sizeof(*x));
    if (big != Py_None && !PyObject_TypeCheck(big, &BigType)) {
        PyErr_SetString(PyExc_TypeError, "exchange_a2a: big must be the group's big slots or None");
        return -1;
    }
    x->big = big == Py_None ? NULL : (Big *)big;
    long k = PyLong_AsLong(bk);
    x->lim = PyLong_AsSsize_t(lim);
    x->beyond = PyLong_AsSsize_t(beyond);
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
    if (q[11] < 0) return 1;
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

/* the header word of member i's offer (alltoall_shm._OFFER): address, own_sent, "can read" */
static inline const uint64_t *a2a_offer(const Slots *s, int64_t i, int64_t p) {
    return (const uint64_t *)(s->slot[s->k][i] + SLOT_HDR + 16 * (p + 1));
}

/* every stream's pieces for this rank into recv (the last exchange complete): 0 or A2A_BIG, A2A_PYTHON (nothing
 * copied), A2A_DEFER (defer: the pieces are to be read and a member sleeps; nothing copied), or A2A_READ with
 * the closing exchange's R_RING bit or A2A_CLOSING; RD_FAILED */
static int a2a_finish(Slots *s, A2A *x, int defer) {
    const int64_t *q = x->q;
    int64_t p = q[0], me = q[1], hb = q[2], nseg = q[4], noth = q[5];
    int64_t cap = s->max_bytes - hb;
    char *const *sl = s->slot[s->k];
    int any_big = q[3] > cap;
    uint64_t longest = any_big ? (uint64_t)q[3] : 0;
    for (int64_t i = 0; i < p; i++) {
        uint64_t n = ((const uint64_t *)(sl[i] + SLOT_HDR))[p];
        if (i != me && n > (uint64_t)cap) {
            any_big = 1;
            if (n > longest) longest = n;
        }
    }
    int reads = any_big && (!x->big || longest > (uint64_t)x->beyond);
    if (reads) { /* alltoall_shm._offered_reads: every rank offers "can read", every stream not inline an address */
        if (x->beyond < 0 || !s->pids) return A2A_PYTHON;
        for (int64_t i = 0; i < p; i++) {
            const uint64_t *of = a2a_offer(s, i, p);
            if (!of[2] || (i != me && ((const uint64_t *)(sl[i] + SLOT_HDR))[p] > (uint64_t)cap && !of[0]))
                return A2A_PYTHON;
        }
    } else if (any_big) {
        for (int64_t i = 0; i < p; i++) {
            uint64_t n = ((const uint64_t *)(sl[i] + SLOT_HDR))[p];
            if (i != me && n > (uint64_t)cap && (!x->big || n > (uint64_t)x->lim)) return A2A_PYTHON;
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
    if (reads && defer) return A2A_DEFER;
    Big *b = x->big;
    int nogil = total >= BIG_NOGIL, err = 0;
    Py_ssize_t bad = -1;
    PyThreadState *ts = NULL;
    if (nogil) {
        s->busy++;
        if (b) b->busy++;
        ts = PyEval_SaveThread();
    }
    const Py_buffer *sb = x->bufs, *rb = x->bufs + x->ns;
    if (own) copy_bytes((char *)rb[q[8]].buf + q[9], (const char *)sb[q[6]].buf + q[7], (size_t)(q[10] - q[9]));
    for (int64_t i = 0; i < noth && !err; i++) {
        const int64_t *e = o + 4 * i;
        if (!e[3]) continue;
        const uint64_t *h = (const uint64_t *)(sl[e[0]] + SLOT_HDR);
        uint64_t lo = h[me], n = h[p];
        char *to = (char *)rb[e[1]].buf + e[2];
        if (n <= (uint64_t)cap) {
            copy_bytes(to, sl[e[0]] + SLOT_HDR + hb + lo, (size_t)e[3]);
        } else if (reads) { /* the stream skips the sender's own piece: past it, its send buffer is own_sent further */
            const uint64_t *of = a2a_offer(s, e[0], p);
            if ((err = cma_read(s->pids[e[0]], to, of[0] + lo + (me > e[0] ? of[1] : 0), (size_t)e[3]))) bad = e[0];
        } else {
            copy_bytes(to, b->buf[x->bk][e[0]] + lo, (size_t)e[3]);
        }
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
    if (err) {
        s->rd_errno = err;
        s->rd_peer = bad;
        return RD_FAILED;
    }
    if (!reads) return any_big ? A2A_BIG : 0;
    s->rd_calls++;
    if (s->released) return A2A_READ | A2A_CLOSING; /* the caller's sleep sees the release and raises */
    int r = publish_only(s, NULL, 0, (s->check ^ s->chain) ^ 1u ^ PG_END_SALT);
    if (r == R_WAIT) r = spin_wait(s);
    return A2A_READ | (r == R_WAIT ? A2A_CLOSING : r);
}

/* exchange_a2a(spec, head, send, recv, check, big, bk, lim, beyond): see above */
PyObject *Slots_exchange_a2a(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "exchange_a2a(spec, head, send, recv, check, big, bk, lim, beyond)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    unsigned long check = PyLong_AsUnsignedLongMask(args[4]);
    if (check == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    A2A x;
    Py_buffer h;
    int bad = a2a_args(s, &x, args[0], args[2], args[3], args[5], args[6], args[7], args[8]), r = R_MISALIGNED;
    if (bad < 0) goto out;
    if (PyObject_GetBuffer(args[1], &h, PyBUF_SIMPLE) < 0) goto out;
    if (!bad && h.len <= x.q[2] && h.len >= 16 * (x.q[0] + 1) + 24) {
        const int64_t *q = x.q;
        int64_t hb = q[2], mine = q[3], nseg = q[4];
        int k = (int)(s->count & 1);
        char *slot = s->slot[k][s->me] + SLOT_HDR, *dst = NULL;
        /* a stream beyond the slot can be read out of send: offer it (a reader needs one send buffer) */
        int offer = s->pids && x.ns == 1 && x.beyond >= 0, only = 0; /* inline too: all can then read the rest */
        if (mine <= s->max_bytes - hb)
            dst = slot + hb;
        else if (x.big && mine <= x.lim)
            dst = x.big->buf[x.bk][s->me];
        else if (offer && (!x.big || mine > x.beyond))
            only = 1; /* every rank reads it out of send: nothing to write but the offer */
        if (dst || only) {
            memcpy(slot, h.buf, (size_t)h.len);
            if (offer) {
                uint64_t *of = (uint64_t *)(slot + 16 * (q[0] + 1));
                of[0] = (uint64_t)(uintptr_t)x.bufs[0].buf;
                of[1] = (uint64_t)q[11];
                of[2] = 1;
            }
            const int64_t *g = q + A2A_FIXED;
            int nogil = dst && mine >= BIG_NOGIL;
            PyThreadState *ts = NULL;
            if (nogil) {
                s->busy++;
                if (x.big) x.big->busy++;
                ts = PyEval_SaveThread();
            }
            for (int64_t i = 0; dst && i < nseg; i++, g += 4)
                copy_to_shared(dst + g[0], (const char *)x.bufs[g[1]].buf + g[2], (size_t)(g[3] - g[2]), STREAM_PIECES);
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
                if (r >= 0 && !s->released) {
                    int f = a2a_finish(s, &x, r == R_RING);
                    r = f < 0 || (f & A2A_READ) ? f : r | f; /* after reads, bit 0 is the closing exchange's */
                }
            }
        }
    }
    PyBuffer_Release(&h);
out:
    a2a_release(&x);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLong(r);
}

/* a2a_finish(spec, send, recv, big, bk, lim, beyond): exchange_a2a's copy out (or reads), after the caller saw
 * the exchange complete */
PyObject *Slots_a2a_finish(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "a2a_finish(spec, send, recv, big, bk, lim, beyond)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    A2A x;
    int bad = a2a_args(s, &x, args[0], args[1], args[2], args[3], args[4], args[5], args[6]), r = A2A_PYTHON;
    if (!bad) r = a2a_finish(s, &x, 0);
    a2a_release(&x);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLong(r);
}

/* The Core type of procgroup.transport.shm._p2pwait (module init in _p2pwait.c; the comment below describes it). */

#include "_p2pwait.h"

/* ---------------------------------------------------------------------------------------------------------
 * Core: send_fast/recv_fast of one ShmTransport in one call each (issue 14: the 4-byte ping-pong's Python).
 *
 * Core(transport, lock, posted, unexpected, failed, hooks, pending_out, bell, flow, ring, notify, progress,
 *      py_send, py_recv, world_size, spin_ns, yield_cpu, calm_ns, outs, ins)
 * outs: [(peer, OutRing, data, q, head_i, tail_i, pending)], ins: [(peer, InRing, data, q, head_i, tail_i, want_i,
 * peer_seg)].  send(dst, tag, payload) and recv(src, tag, out) return what p2pfast.send_fast/recv_fast return.
 * recv's head poll yields the CPU (yield_cpu) only after its first calm_ns (p2pfast.CALM_NS; 0 on a host our
 * ranks oversubscribe): each sched_yield is a syscall during which an arriving reply goes unseen.
 *
 * Thread safety: they make p2pfast's checks in the same order under the transport's own lock, taken with
 * lock.acquire() (waiting with the GIL released when another thread holds it, as `with self._lock:`) and
 * released before returning or polling; so whatever the lock orders for the Python path (a progress thread,
 * other groups, the liveness check, close/abort) it orders for these too.  They read the very state the
 * general path keeps (the transport's _closed/_aborted, its _posted/_unexpected/_failed dicts, the OutRing's
 * pending deque, the InRing's cur, the doorbell's last/sleepers: the same objects, never copies), write back
 * what the Python path writes (OutRing.head, InRing.tail, Doorbell.last, Flow.moved, _fast_spun; the counters
 * are the Core's own, which the transport's fast_sends/fast_recvs/sent_bytes add) and call the Python path's
 * own callbacks (ring for a producer that waits for room, notify, progress), lock held as there.  OutRing.head
 * and InRing.tail equal the published head/released tail in q whenever the lock is free (every writer of one
 * writes the other under it), so the Core reads q.  The rings' data and q stay exported from construction
 * until release() (the transport's release, lock held; send/recv refuse after it); the head poll, which runs
 * with neither the lock nor the GIL, exports q for itself, so the segment cannot be unmapped under it.
 *
 * A payload without a simple (C-contiguous; for recv writable) buffer gets False/-1 at once: the general path
 * copies or refuses it (procgroup.p2p skips its own flags test for these two).  A payload over FAST_MAX
 * (streamed) or a peer without a ring goes to py_send/py_recv (p2pfast's functions) with the same arguments,
 * so their results and errors are the caller's. */

#define OTHERS_SLICE_NS 20000

typedef struct {
    PyObject *ring;    /* OutRing / InRing (NULL: no ring with this rank) */
    PyObject *data, *q;
    Py_ssize_t head_i, tail_i, want_i;
    PyObject *pending; /* OutRing.pending (a deque) */
    PyObject *peer_seg; /* InRing.peer_seg: rung when the producer wants space */
    Py_buffer d, qb;    /* data and q, exported while `held` (Core.release ends it: the transport's release) */
    int held;
} Link;

typedef struct {
    PyObject_HEAD
    PyObject *transport, *acquire, *release, *posted, *unexpected, *failed, *hooks, *pending_out, *bell, *flow;
    PyObject *ring, *notify, *progress, *py_send, *py_recv;
    int ws, others, yield_cpu;
    long long spin_ns, calm_ns;
    Link *out, *in;
    unsigned long long sends, recvs, bytes;
} Core;


/* the ring checks of put/take (a power-of-two size >= 32, aligned, indices inside q) */
static int ring_ok(const Py_buffer *d, const Py_buffer *q, const Link *l) {
    uint64_t cap = (uint64_t)d->len;
    return cap >= 32 && !(cap & (cap - 1)) && !((uintptr_t)d->buf & 15) && !((uintptr_t)q->buf & 7) &&
           (l->head_i + 1) * 8 <= q->len && (l->tail_i + 1) * 8 <= q->len && (l->want_i + 1) * 4 <= q->len &&
           q->len >= OFF_SLEEP + 4;
}

static int core_traverse(Core *c, visitproc visit, void *arg) {
    Py_VISIT(c->transport);
    Py_VISIT(c->acquire);
    Py_VISIT(c->release);
    Py_VISIT(c->posted);
    Py_VISIT(c->unexpected);
    Py_VISIT(c->failed);
    Py_VISIT(c->hooks);
    Py_VISIT(c->pending_out);
    Py_VISIT(c->bell);
    Py_VISIT(c->flow);
    Py_VISIT(c->ring);
    Py_VISIT(c->notify);
    Py_VISIT(c->progress);
    Py_VISIT(c->py_send);
    Py_VISIT(c->py_recv);
    for (int i = 0; i < c->ws && c->out != NULL; i++) {
        Py_VISIT(c->out[i].ring);
        Py_VISIT(c->out[i].data);
        Py_VISIT(c->out[i].q);
        Py_VISIT(c->out[i].pending);
        Py_VISIT(c->in[i].ring);
        Py_VISIT(c->in[i].data);
        Py_VISIT(c->in[i].q);
        Py_VISIT(c->in[i].peer_seg);
        for (int k = 0; k < 2; k++) {
            Link *l = k ? &c->in[i] : &c->out[i];
            if (l->held) {
                Py_VISIT(l->d.obj);
                Py_VISIT(l->qb.obj);
            }
        }
    }
    return 0;
}

/* end the exports of the rings' buffers (lock held, or the Core unreachable) */
static void core_release_all(Core *c) {
    for (int i = 0; i < c->ws && c->out != NULL; i++)
        for (int k = 0; k < 2; k++) {
            Link *l = k ? &c->in[i] : &c->out[i];
            if (l->held) {
                l->held = 0;
                PyBuffer_Release(&l->d);
                PyBuffer_Release(&l->qb);
            }
        }
}

static int core_clear(Core *c) {
    core_release_all(c);
    Py_CLEAR(c->transport);
    Py_CLEAR(c->acquire);
    Py_CLEAR(c->release);
    Py_CLEAR(c->posted);
    Py_CLEAR(c->unexpected);
    Py_CLEAR(c->failed);
    Py_CLEAR(c->hooks);
    Py_CLEAR(c->pending_out);
    Py_CLEAR(c->bell);
    Py_CLEAR(c->flow);
    Py_CLEAR(c->ring);
    Py_CLEAR(c->notify);
    Py_CLEAR(c->progress);
    Py_CLEAR(c->py_send);
    Py_CLEAR(c->py_recv);
    for (int i = 0; i < c->ws && c->out != NULL; i++) {
        Py_CLEAR(c->out[i].ring);
        Py_CLEAR(c->out[i].data);
        Py_CLEAR(c->out[i].q);
        Py_CLEAR(c->out[i].pending);
        Py_CLEAR(c->in[i].ring);
        Py_CLEAR(c->in[i].data);
        Py_CLEAR(c->in[i].q);
        Py_CLEAR(c->in[i].peer_seg);
    }
    return 0;
}

static void core_dealloc(Core *c) {
    PyObject_GC_UnTrack(c);
    core_clear(c);
    PyMem_Free(c->out);
    PyMem_Free(c->in);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* one (peer, ring, ...) tuple of outs/ins into the link of its peer; 0 or -1 (error set) */
static int core_link(Core *c, PyObject *item, int in) {
    Py_ssize_t peer, hi, ti, wi = 0;
    PyObject *ring, *data, *q, *extra;
    int ok = in ? PyArg_ParseTuple(item, "nOOOnnnO", &peer, &ring, &data, &q, &hi, &ti, &wi, &extra)
                : PyArg_ParseTuple(item, "nOOOnnO", &peer, &ring, &data, &q, &hi, &ti, &extra);
    if (!ok)
        return -1;
    if (peer < 0 || peer >= c->ws || hi < 0 || ti < 0 || wi < 0) {
        PyErr_SetString(PyExc_ValueError, "Core: a peer outside the world or a negative index");
        return -1;
    }
    Link *l = in ? &c->in[peer] : &c->out[peer];
    Py_INCREF(ring);
    Py_INCREF(data);
    Py_INCREF(q);
    Py_INCREF(extra);
    Py_XSETREF(l->ring, ring);
    Py_XSETREF(l->data, data);
    Py_XSETREF(l->q, q);
    if (in)
        Py_XSETREF(l->peer_seg, extra);
    else
        Py_XSETREF(l->pending, extra);
    l->head_i = hi;
    l->tail_i = ti;
    l->want_i = wi;
    if (l->held)
        return 0;
    if (PyObject_GetBuffer(data, &l->d, PyBUF_WRITABLE) < 0)
        return -1;
    if (PyObject_GetBuffer(q, &l->qb, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&l->d);
        return -1;
    }
    l->held = 1;
    if (!ring_ok(&l->d, &l->qb, l)) {
        PyErr_SetString(PyExc_ValueError, "Core: a ring of a power-of-two size >= 32 and indices inside q");
        return -1;
    }
    return 0;
}

static PyObject *core_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)kw;
    PyObject *t, *lock, *posted, *unexpected, *failed, *hooks, *pending_out, *bell, *flow, *ring, *notify, *progress;
    PyObject *py_send, *py_recv, *outs, *ins;
    int ws, yield_cpu;
    long long spin_ns, calm_ns;
    if (!PyArg_ParseTuple(args, "OOO!O!O!O!O!OOOOOOOiLpLO!O!", &t, &lock, &PyDict_Type, &posted, &PyDict_Type,
                          &unexpected, &PyDict_Type, &failed, &PyList_Type, &hooks, &PyList_Type, &pending_out, &bell,
                          &flow, &ring, &notify, &progress, &py_send, &py_recv, &ws, &spin_ns, &yield_cpu, &calm_ns,
                          &PyList_Type, &outs, &PyList_Type, &ins))
        return NULL;
    if (ws < 1) {
        PyErr_SetString(PyExc_ValueError, "Core: world_size < 1");
        return NULL;
    }
    Core *c = (Core *)type->tp_alloc(type, 0);
    if (c == NULL)
        return NULL;
    c->ws = ws;
    c->out = PyMem_Calloc((size_t)ws, sizeof(Link));
    c->in = PyMem_Calloc((size_t)ws, sizeof(Link));
    if (c->out == NULL || c->in == NULL) {
        Py_DECREF(c);
        return PyErr_NoMemory();
    }
    c->acquire = PyObject_GetAttrString(lock, "acquire");
    c->release = PyObject_GetAttrString(lock, "release");
    if (c->acquire == NULL || c->release == NULL) {
        Py_DECREF(c);
        return NULL;
    }
    PyObject **slots[] = {&c->transport, &c->posted, &c->unexpected, &c->failed, &c->hooks, &c->pending_out,
                          &c->bell,      &c->flow,   &c->ring,       &c->notify, &c->progress, &c->py_send,
                          &c->py_recv};
    PyObject *vals[] = {t, posted, unexpected, failed, hooks, pending_out, bell, flow, ring, notify, progress,
                        py_send, py_recv};
    for (size_t i = 0; i < sizeof(vals) / sizeof(vals[0]); i++) {
        Py_INCREF(vals[i]);
        *slots[i] = vals[i];
    }
    c->spin_ns = spin_ns;
    c->yield_cpu = yield_cpu;
    c->calm_ns = calm_ns > 0 ? calm_ns : 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outs); i++)
        if (core_link(c, PyList_GET_ITEM(outs, i), 0) < 0) {
            Py_DECREF(c);
            return NULL;
        }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ins); i++)
        if (core_link(c, PyList_GET_ITEM(ins, i), 1) < 0) {
            Py_DECREF(c);
            return NULL;
        }
    c->others = PyList_GET_SIZE(ins) > 1;
    return (PyObject *)c;
}

/* lock.acquire() as `with lock:` (waiting with the GIL released when another thread holds it): 1, or -1 error
 * (a signal handler's exception) */
static int core_trylock(Core *c) {
    PyObject *r = PyObject_Vectorcall(c->acquire, NULL, 0, NULL);
    if (r == NULL)
        return -1;
    int got = r == Py_True;
    Py_DECREF(r);
    return got ? 1 : -1;
}

/* lock.release(), keeping an error already set (the caller's) */
static int core_unlock(Core *c) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *r = PyObject_Vectorcall(c->release, NULL, 0, NULL);
    if (r == NULL) {
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        return -1;
    }
    Py_DECREF(r);
    PyErr_Restore(et, ev, tb);
    return 0;
}

/* the Python path (p2pfast) with the caller's arguments */
static PyObject *core_fallback(PyObject *fn, PyObject *const *args) { return PyObject_Vectorcall(fn, args, 3, NULL); }

/* 1 when the transport is closed or aborted or `peer` failed (the fast path must not run), 0, -1 error */
static int core_refused(Core *c, PyObject *peer) {
    PyObject *v = PyObject_GetAttr(c->transport, s_closed);
    if (v == NULL)
        return -1;
    int closed = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (closed)
        return closed;
    v = PyObject_GetAttr(c->transport, s_aborted);
    if (v == NULL)
        return -1;
    int aborted = v != Py_None;
    Py_DECREF(v);
    if (aborted)
        return 1;
    return PyDict_GET_SIZE(c->failed) ? PyDict_Contains(c->failed, peer) : 0;
}

/* obj.name = v (an unsigned 64-bit int); 0 or -1 */
static int set_u64(PyObject *obj, PyObject *name, unsigned long long v) {
    PyObject *x = PyLong_FromUnsignedLongLong(v);
    if (x == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, x);
    Py_DECREF(x);
    return rc;
}

/* obj.name as an unsigned 64-bit int; (unsigned long long)-1 with an error set on failure */
static unsigned long long get_u64(PyObject *obj, PyObject *name) {
    PyObject *x = PyObject_GetAttr(obj, name);
    if (x == NULL)
        return (unsigned long long)-1;
    unsigned long long v = PyLong_AsUnsignedLongLong(x);
    Py_DECREF(x);
    return v;
}

/* send(dst, tag, payload) -> True, False (the caller takes isend) or p2pfast.send_fast's result */
static PyObject *core_send(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send(dst, tag, payload) takes 3 arguments");
        return NULL;
    }
    Py_ssize_t dst = PyLong_AsSsize_t(args[0]);
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    Link *o = dst >= 0 && dst < c->ws ? &c->out[dst] : NULL;
    if (o == NULL || o->ring == NULL)
        return core_fallback(c->py_send, args);
    Py_buffer p;
    if (PyObject_GetBuffer(args[2], &p, PyBUF_SIMPLE) < 0) { /* not C-contiguous (or no buffer): the general path */
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    if (p.len > FAST_MAX_C) {
        PyBuffer_Release(&p);
        return core_fallback(c->py_send, args);
    }
    int got = core_trylock(c);
    if (got < 0) {
        PyBuffer_Release(&p);
        return NULL;
    }
    PyObject *res = Py_False;
    int err = 0;
    int refused = o->held ? core_refused(c, args[0]) : 1;
    Py_ssize_t queued = refused ? 0 : PyObject_Length(o->pending);
    if (refused < 0 || queued < 0) {
        err = 1;
    } else if (!refused && queued == 0) {
        uint64_t n = (uint64_t)p.len, cap = (uint64_t)o->d.len;
        uint64_t *qq = (uint64_t *)o->qb.buf;
        /* our own published head: OutRing.head equals it whenever the lock is free */
        uint64_t head = __atomic_load_n(&qq[o->head_i], __ATOMIC_RELAXED);
        uint64_t h = (head + 15) & ~(uint64_t)15, end = h + 16 + n;
        uint64_t tail = __atomic_load_n(&qq[o->tail_i], __ATOMIC_ACQUIRE);
        if (end - tail <= cap && n <= cap) {
            unsigned long long last = get_u64(c->bell, s_last);
            uint32_t v = (uint32_t)((last + (unsigned long long)c->ws) & 0xFFFFFFFFull);
            if (PyErr_Occurred() || set_u64(c->bell, s_last, v) < 0 || set_u64(o->ring, s_head, end) < 0) {
                err = 1;
            } else {
                char *data = (char *)o->d.buf;
                uint64_t hdr[2] = {tag, n};
                memcpy(data + (h & (cap - 1)), hdr, 16);
                ring_copy_in(data, cap - 1, h + 16, (const char *)p.buf, n);
                __atomic_store_n(&qq[o->head_i], end, __ATOMIC_RELEASE);
                ring_bell((char *)o->qb.buf, v);
                c->sends++;
                c->bytes += n;
                res = Py_True;
            }
        }
    }
    PyBuffer_Release(&p);
    if (core_unlock(c) < 0 || err)
        return NULL;
    Py_INCREF(res);
    return res;
}

/* a Python call f(*a) whose result is dropped; 0 or -1 */
static int call_void(PyObject *f, PyObject *const *a, size_t n) {
    PyObject *r = PyObject_Vectorcall(f, a, n, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* recv_fast's step with the lock held: 1 done (*n the byte count), 0 nothing yet, -1 give up (-1 to the caller),
 * -2 error */
static int core_recv_step(Core *c, Link *r, PyObject *src, PyObject *tagobj, unsigned long long tag, Py_buffer *o,
                          uint64_t *tail_out, long long *n_out) {
    int refused = core_refused(c, src);
    if (refused)
        return refused < 0 ? -2 : -1;
    PyObject *cur = PyObject_GetAttr(r->ring, s_cur);
    if (cur == NULL)
        return -2;
    int busy = cur != Py_None;
    Py_DECREF(cur);
    if (busy)
        return -1;
    if (PyDict_GET_SIZE(c->posted) && (busy = PyDict_Contains(c->posted, tagobj)) != 0)
        return busy < 0 ? -2 : -1;
    if (PyDict_GET_SIZE(c->unexpected) && (busy = PyDict_Contains(c->unexpected, tagobj)) != 0)
        return busy < 0 ? -2 : -1;
    if (!r->held)
        return -1;
    int rc = 0, want = 0;
    uint64_t n = 0;
    uint64_t *qq = (uint64_t *)r->qb.buf, cap = (uint64_t)r->d.len, mask = cap - 1;
    uint64_t head = __atomic_load_n(&qq[r->head_i], __ATOMIC_ACQUIRE);
    /* our own released tail: InRing.tail equals it whenever the lock is free */
    uint64_t tail = __atomic_load_n(&qq[r->tail_i], __ATOMIC_RELAXED);
    *tail_out = tail;
    if (head != tail) {
        uint64_t t = (tail + 15) & ~(uint64_t)15;
        rc = -1; /* another message, a control record, too large or still streaming: the general path */
        if (head >= t + 16) {
            const char *data = (const char *)r->d.buf;
            uint64_t pos = t & mask, hdr[2];
            memcpy(hdr, data + pos, 16);
            n = hdr[1];
            if (hdr[0] == tag && n <= (uint64_t)o->len && n <= cap && head >= t + 16 + n) {
                ring_copy_out((char *)o->buf, data, mask, t + 16, n);
                __atomic_store_n(&qq[r->tail_i], t + 16 + n, __ATOMIC_RELEASE);
                __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the tail before the want flag (Dekker) */
                want = __atomic_load_n(&((const uint32_t *)r->qb.buf)[r->want_i], __ATOMIC_RELAXED) != 0;
                rc = 1;
                *tail_out = t + 16 + n;
            }
        }
    }
    if (rc != 1)
        return rc;
    /* what recv_fast does after take: ring a producer waiting for room, r.tail, the flow, our sleepers */
    if (want && call_void(c->ring, &r->peer_seg, 1) < 0)
        return -2;
    if (set_u64(r->ring, s_tail, *tail_out) < 0)
        return -2;
    unsigned long long moved = get_u64(c->flow, s_moved);
    if (PyErr_Occurred() || set_u64(c->flow, s_moved, moved + 1) < 0)
        return -2;
    PyObject *sl = PyObject_GetAttr(c->bell, s_sleepers);
    if (sl == NULL)
        return -2;
    int sleepers = PyObject_IsTrue(sl);
    Py_DECREF(sl);
    if (sleepers < 0)
        return -2;
    if ((sleepers || PyList_GET_SIZE(c->hooks)) && call_void(c->notify, NULL, 0) < 0)
        return -2;
    c->recvs++;
    *n_out = (long long)n;
    return 1;
}

/* recv(src, tag, out) -> the byte count, -1 (the caller takes the general path) or p2pfast.recv_fast's result */
static PyObject *core_recv(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "recv(src, tag, out) takes 3 arguments");
        return NULL;
    }
    Py_ssize_t src = PyLong_AsSsize_t(args[0]);
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    Link *r = src >= 0 && src < c->ws ? &c->in[src] : NULL;
    if (r == NULL || r->ring == NULL)
        return core_fallback(c->py_recv, args);
    Py_buffer o;
    if (PyObject_GetBuffer(args[2], &o, PyBUF_WRITABLE) < 0) { /* not C-contiguous, read-only: the general path */
        PyErr_Clear();
        return PyLong_FromLong(-1);
    }
    if (o.len > FAST_MAX_C) {
        PyBuffer_Release(&o);
        return core_fallback(c->py_recv, args);
    }
    uint64_t end = 0;
    long long n = -1;
    for (;;) {
        int got = core_trylock(c);
        if (got < 0) {
            PyBuffer_Release(&o);
            return NULL;
        }
        uint64_t tail = 0;
        int rc = core_recv_step(c, r, args[0], args[1], tag, &o, &tail, &n);
        int pending = rc == 0 ? PyList_GET_SIZE(c->pending_out) != 0 : 0;
        if (rc == 0 && (pending || c->others)) {
            PyObject *a[1] = {r->ring};
            if (call_void(c->progress, a, 1) < 0)
                rc = -2;
            pending = PyList_GET_SIZE(c->pending_out) != 0;
        }
        if (core_unlock(c) < 0)
            rc = -2;
        if (rc != 0) {
            PyBuffer_Release(&o);
            if (rc == -2)
                return NULL;
            return PyLong_FromLongLong(rc == 1 ? n : -1);
        }
        uint64_t now = now_ns();
        if (!end) {
            end = now + (uint64_t)(c->spin_ns > 0 ? c->spin_ns : 0);
        } else if (now >= end) { /* the general wait that follows sleeps at once (no second spin) */
            PyBuffer_Release(&o);
            PyObject *f = PyFloat_FromDouble((double)now * 1e-9);
            if (f == NULL || PyObject_SetAttr(c->transport, s_fast_spun, f) < 0) {
                Py_XDECREF(f);
                return NULL;
            }
            Py_DECREF(f);
            return PyLong_FromLong(-1);
        }
        if (!pending) { /* poll the head, GIL released, until it moves */
            Py_buffer q;
            if (PyObject_GetBuffer(r->q, &q, PyBUF_SIMPLE) < 0) {
                PyBuffer_Release(&o);
                return NULL;
            }
            const uint64_t *hp = (const uint64_t *)q.buf + r->head_i;
            uint64_t spin = end - now;
            if (c->others && spin > OTHERS_SLICE_NS)
                spin = OTHERS_SLICE_NS;
            int yield_cpu = c->yield_cpu;
            /* no sched_yield for the first calm_ns of the receive (a reply in flight is seen at once, not after
             * a syscall), then every 16 polls as spin_over */
            uint64_t calm = end - (uint64_t)(c->spin_ns > 0 ? c->spin_ns : 0) + (uint64_t)c->calm_ns;
            Py_BEGIN_ALLOW_THREADS
            uint64_t e = now + spin;
            unsigned k = 0;
            while (__atomic_load_n(hp, __ATOMIC_ACQUIRE) == tail) {
                if ((++k & 15) == 0) {
                    uint64_t t = now_ns();
                    if (t >= e)
                        break;
                    if (yield_cpu && t >= calm)
                        sched_yield();
                } else {
                    CPU_RELAX();
                }
            }
            Py_END_ALLOW_THREADS
            PyBuffer_Release(&q);
        } else if (c->yield_cpu) {
            sched_yield();
        }
    }
}

static PyObject *core_release(Core *c, PyObject *unused) {
    (void)unused;
    core_release_all(c);
    Py_RETURN_NONE;
}

static PyObject *core_counts(Core *c, PyObject *unused) {
    (void)unused;
    return Py_BuildValue("(KKK)", c->sends, c->recvs, c->bytes);
}

static PyMethodDef core_methods[] = {
    {"send", (PyCFunction)(void (*)(void))core_send, METH_FASTCALL,
     "send(dst, tag, payload) -> True, False or p2pfast.send_fast's result (see the Core comment)"},
    {"recv", (PyCFunction)(void (*)(void))core_recv, METH_FASTCALL,
     "recv(src, tag, out) -> the byte count, -1 or p2pfast.recv_fast's result (see the Core comment)"},
    {"counts", (PyCFunction)core_counts, METH_NOARGS, "counts() -> (sends, receives, bytes sent) taken in C"},
    {"release", (PyCFunction)core_release, METH_NOARGS,
     "release(): end the exports of the rings' buffers (the transport's release, lock held); send/recv then refuse"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "procgroup.transport.shm._p2pwait.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One ShmTransport's send_fast/recv_fast in C (see the comment in _p2pwait_core.c)",
    .tp_new = core_new,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_methods = core_methods,
};

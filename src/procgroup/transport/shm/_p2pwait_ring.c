/* The module functions of procgroup.transport.shm._p2pwait (module init in _p2pwait.c): wait_head, and the ring's
 * record writes and reads put, take, put_stream and stream. */

#include "_p2pwait.h"


/* The three buffers of put/take/put_stream/stream: the ring's data (args[0]), the control words q (args[1]) and
 * the payload or output buffer (args[pi]), with these flags.  On failure releases what it had and returns -1
 * (the Python error set). */
static int get_buffers(PyObject *const *args, Py_ssize_t pi, int dflags, int qflags, int pflags, Py_buffer *d,
                       Py_buffer *q, Py_buffer *p) {
    if (PyObject_GetBuffer(args[0], d, dflags) < 0)
        return -1;
    if (PyObject_GetBuffer(args[1], q, qflags) < 0) {
        PyBuffer_Release(d);
        return -1;
    }
    if (PyObject_GetBuffer(args[pi], p, pflags) < 0) {
        PyBuffer_Release(d);
        PyBuffer_Release(q);
        return -1;
    }
    return 0;
}

static void release_buffers(Py_buffer *d, Py_buffer *q, Py_buffer *p) {
    PyBuffer_Release(d);
    PyBuffer_Release(q);
    PyBuffer_Release(p);
}

static PyObject *wait_head(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "wait_head(q, head_i, tail, spin_ns, yield_cpu) takes 5 arguments");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    unsigned long long tail = PyLong_AsUnsignedLongLong(args[2]);
    long long spin = PyLong_AsLongLong(args[3]);
    int yield_cpu = PyObject_IsTrue(args[4]);
    if (PyErr_Occurred() || yield_cpu < 0)
        return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0)
        return NULL;
    if (i < 0 || (i + 1) * 8 > b.len || ((uintptr_t)b.buf & 7)) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_IndexError, "wait_head: head index outside the buffer (or a misaligned buffer)");
        return NULL;
    }
    const uint64_t *p = (const uint64_t *)((const char *)b.buf + i * 8);
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    uint64_t end = spin_end(spin);
    unsigned k = 0;
    for (;;) {
        h = __atomic_load_n(p, __ATOMIC_ACQUIRE);
        if (h != (uint64_t)tail)
            break;
        if (spin_over(&k, end, yield_cpu))
            break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

/* put(data, q, head_i, tail_i, head, tag, payload[, bell[, chunk, step]]) -> the new head, or -1 when the record
 * does not fit now.  Writes one record (16-byte header at the 16-aligned position after head, then the payload,
 * wrapping) into ring data (a power-of-two size) and publishes the head (release store at index head_i of q).
 * bell (a u32 no other ringer writes), given and the record written: Doorbell.ring's handshake on the segment
 * q: writes bell into its doorbell, a full fence, then reads its sleep flag and makes the FUTEX_WAKE syscall
 * only when it is up.  The sleeper raises the flag, fences, then futex_wait compares the doorbell (Dekker):
 * without the fence our flag read could pass our head/doorbell stores and a sleeper miss its wake-up.
 * chunk (> 0) and step: the record is written in pieces of chunk payload bytes (the header with the first),
 * the head published and the doorbell rung after each, with bell, bell + step, bell + 2 step, ... (a new value
 * each time: a sleeper that saw one value must be woken by the next), so the consumer copies piece k while we
 * write piece k + 1; the caller's last bell value is then bell + (max(1, ceil(n / chunk)) - 1) * step.  The
 * whole record must fit the ring's free space now (else -1, nothing written): we never wait.  The GIL is
 * released while a payload over 64 KiB is copied. */
static PyObject *put(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7 && nargs != 8 && nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "put(data, q, head_i, tail_i, head, tag, payload[, bell[, chunk, step]]) takes 7, 8 or 10 "
                        "arguments");
        return NULL;
    }
    Py_ssize_t hi = PyLong_AsSsize_t(args[2]), ti = PyLong_AsSsize_t(args[3]);
    unsigned long long head = PyLong_AsUnsignedLongLong(args[4]);
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[5]);
    unsigned long bell = nargs >= 8 ? PyLong_AsUnsignedLong(args[7]) : 0;
    long long chunk = nargs == 10 ? PyLong_AsLongLong(args[8]) : 0;
    unsigned long step = nargs == 10 ? PyLong_AsUnsignedLong(args[9]) : 0;
    if (PyErr_Occurred())
        return NULL;
    Py_buffer d, q, p;
    if (get_buffers(args, 6, PyBUF_WRITABLE, PyBUF_WRITABLE, PyBUF_SIMPLE, &d, &q, &p) < 0)
        return NULL;
    long long res = -1;
    uint64_t cap = (uint64_t)d.len, n = (uint64_t)p.len;
    if (cap < 32 || (cap & (cap - 1)) || ((uintptr_t)d.buf & 15) || ((uintptr_t)q.buf & 7) || hi < 0 || ti < 0 ||
        (hi + 1) * 8 > q.len || (ti + 1) * 8 > q.len || (nargs >= 8 && q.len < OFF_SLEEP + 4) || chunk < 0) {
        PyErr_SetString(PyExc_ValueError, "put: a ring of a power-of-two size >= 32 and indices inside q");
        res = -2;
    } else {
        uint64_t *qq = (uint64_t *)q.buf;
        uint64_t h = ((uint64_t)head + 15) & ~(uint64_t)15, end = h + 16 + n;
        uint64_t tail = __atomic_load_n(&qq[ti], __ATOMIC_ACQUIRE);
        if (end - tail <= cap && n <= cap) {
            char *data = (char *)d.buf;
            uint64_t mask = cap - 1;
            uint64_t hdr[2] = {(uint64_t)tag, n};
            memcpy(data + (h & mask), hdr, 16);
            uint64_t k = chunk > 0 ? (uint64_t)chunk : n;
            if (k >= n) {
                ring_copy_in(data, mask, h + 16, (const char *)p.buf, n);
                __atomic_store_n(&qq[hi], end, __ATOMIC_RELEASE);
                if (nargs >= 8)
                    ring_bell((char *)q.buf, (uint32_t)bell);
            } else {
                int big = n > (64u << 10);
                PyThreadState *ts = big ? PyEval_SaveThread() : NULL;
                uint64_t off = 0, pos = h + 16;
                uint32_t v = (uint32_t)bell;
                while (off < n) {
                    uint64_t m = n - off < k ? n - off : k;
                    ring_copy_in(data, mask, pos, (const char *)p.buf + off, m);
                    off += m;
                    pos += m;
                    __atomic_store_n(&qq[hi], pos, __ATOMIC_RELEASE);
                    ring_bell((char *)q.buf, v);
                    v += (uint32_t)step;
                }
                if (ts != NULL)
                    PyEval_RestoreThread(ts);
            }
            res = (long long)end;
        }
    }
    release_buffers(&d, &q, &p);
    if (res == -2)
        return NULL;
    return PyLong_FromLongLong(res);
}

/* take(data, q, head_i, tail, tag, out[, tail_i, want_i]) -> the payload's byte count, or -1 (nothing
 * consumed) unless the next record after tail is a whole message of this tag that fits out; copies its payload
 * into out.  Without tail_i the caller releases the ring up to ((tail + 15) & ~15) + 16 + n.  With them, take
 * releases it (store at index tail_i of q), fences and reads the producer's want-space flag (u32 index want_i
 * of q): a raised flag returns -2 - n instead of n, and the caller rings the producer. */
static PyObject *take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "take(data, q, head_i, tail, tag, out[, tail_i, want_i]) takes 6 or 8 arguments");
        return NULL;
    }
    Py_ssize_t hi = PyLong_AsSsize_t(args[2]);
    Py_ssize_t ti = nargs == 8 ? PyLong_AsSsize_t(args[6]) : 0, wi = nargs == 8 ? PyLong_AsSsize_t(args[7]) : 0;
    unsigned long long tail = PyLong_AsUnsignedLongLong(args[3]);
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer d, q, o;
    if (get_buffers(args, 5, PyBUF_SIMPLE, nargs == 8 ? PyBUF_WRITABLE : PyBUF_SIMPLE, PyBUF_WRITABLE, &d, &q, &o) < 0)
        return NULL;
    long long res = -1;
    int err = 0;
    uint64_t cap = (uint64_t)d.len;
    if (cap < 32 || (cap & (cap - 1)) || ((uintptr_t)d.buf & 15) || ((uintptr_t)q.buf & 7) || hi < 0 ||
        (hi + 1) * 8 > q.len || ti < 0 || (ti + 1) * 8 > q.len || wi < 0 || (wi + 1) * 4 > q.len) {
        PyErr_SetString(PyExc_ValueError, "take: a ring of a power-of-two size >= 32 and indices inside q");
        err = 1;
    } else {
        uint64_t head = __atomic_load_n(&((const uint64_t *)q.buf)[hi], __ATOMIC_ACQUIRE);
        uint64_t t = ((uint64_t)tail + 15) & ~(uint64_t)15;
        if (head >= t + 16) {
            const char *data = (const char *)d.buf;
            uint64_t mask = cap - 1, pos = t & mask, hdr[2];
            memcpy(hdr, data + pos, 16);
            uint64_t n = hdr[1];
            if (hdr[0] == (uint64_t)tag && n <= (uint64_t)o.len && n <= cap && head >= t + 16 + n) {
                pos = (pos + 16) & mask;
                uint64_t first = cap - pos;
                if (n <= first) {
                    memcpy(o.buf, data + pos, n);
                } else {
                    memcpy(o.buf, data + pos, first);
                    memcpy((char *)o.buf + first, data, n - first);
                }
                res = (long long)n;
                if (nargs == 8) {
                    __atomic_store_n(&((uint64_t *)q.buf)[ti], t + 16 + n, __ATOMIC_RELEASE);
                    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the tail before the want flag (the producer's Dekker) */
                    if (__atomic_load_n(&((const uint32_t *)q.buf)[wi], __ATOMIC_RELAXED))
                        res = -2 - (long long)n;
                }
            }
        }
    }
    release_buffers(&d, &q, &o);
    if (err)
        return NULL;
    return PyLong_FromLongLong(res);
}

/* put_stream(data, q, head_i, tail_i, head, tag, payload, bell, chunk, step, spin_ns, yield_cpu)
 *   -> (end, off, rings), or -1 when not even the header and the first piece fit before spin_ns passed.
 * put's pieces for a record of any size (larger than the ring too): before each piece it waits, polling the
 * consumer's tail with the GIL released, until the piece fits; then writes it, publishes the head and rings
 * (bell, bell + step, ...).  Returns the head published last (end), the payload bytes written (off: n when
 * the record is complete) and the number of rings (the caller's last bell value is bell + (rings - 1) * step).
 * When the tail did not move for spin_ns (the consumer is busy elsewhere, stopped or dead) it returns with
 * off < n: the caller finishes the record through its general path (its pending send, header written).
 * yield_cpu: sched_yield every 16 polls, as wait_head. */
static PyObject *put_stream(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError,
                        "put_stream(data, q, head_i, tail_i, head, tag, payload, bell, chunk, step, spin_ns, "
                        "yield_cpu) takes 12 arguments");
        return NULL;
    }
    Py_ssize_t hi = PyLong_AsSsize_t(args[2]), ti = PyLong_AsSsize_t(args[3]);
    unsigned long long head = PyLong_AsUnsignedLongLong(args[4]);
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[5]);
    unsigned long bell = PyLong_AsUnsignedLong(args[7]);
    long long chunk = PyLong_AsLongLong(args[8]);
    unsigned long step = PyLong_AsUnsignedLong(args[9]);
    long long spin = PyLong_AsLongLong(args[10]);
    int yield_cpu = PyObject_IsTrue(args[11]);
    if (PyErr_Occurred() || yield_cpu < 0)
        return NULL;
    Py_buffer d, q, p;
    if (get_buffers(args, 6, PyBUF_WRITABLE, PyBUF_WRITABLE, PyBUF_SIMPLE, &d, &q, &p) < 0)
        return NULL;
    int err = 0, hdr_done = 0;
    uint64_t cap = (uint64_t)d.len, n = (uint64_t)p.len, off = 0, wp = 0, rings = 0;
    if (cap < 64 || (cap & (cap - 1)) || ((uintptr_t)d.buf & 15) || ((uintptr_t)q.buf & 7) || hi < 0 || ti < 0 ||
        (hi + 1) * 8 > q.len || (ti + 1) * 8 > q.len || q.len < OFF_SLEEP + 4 || chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "put_stream: a ring of a power-of-two size >= 64, indices inside q, chunk > 0");
        err = 1;
    } else {
        uint64_t *qq = (uint64_t *)q.buf;
        char *data = (char *)d.buf;
        uint64_t mask = cap - 1, h = ((uint64_t)head + 15) & ~(uint64_t)15;
        uint64_t k = (uint64_t)chunk > cap / 2 ? cap / 2 : (uint64_t)chunk;
        uint32_t v = (uint32_t)bell;
        wp = h;
        Py_BEGIN_ALLOW_THREADS
        uint64_t end = spin_end(spin);
        unsigned polls = 0;
        while (!hdr_done || off < n) {
            uint64_t m = n - off < k ? n - off : k;
            uint64_t need = (hdr_done ? 0 : 16) + m;
            uint64_t tail = __atomic_load_n(&qq[ti], __ATOMIC_ACQUIRE);
            if (wp + need - tail > cap) {
                if (spin_over(&polls, end, yield_cpu))
                    break;
                continue;
            }
            if (!hdr_done) {
                uint64_t hdr[2] = {(uint64_t)tag, n};
                memcpy(data + (h & mask), hdr, 16);
                wp = h + 16;
                hdr_done = 1;
            }
            ring_copy_in(data, mask, wp, (const char *)p.buf + off, m);
            off += m;
            wp += m;
            __atomic_store_n(&qq[hi], wp, __ATOMIC_RELEASE);
            ring_bell((char *)q.buf, v);
            v += (uint32_t)step;
            rings++;
            end = spin_end(spin);
            polls = 0;
        }
        Py_END_ALLOW_THREADS
    }
    release_buffers(&d, &q, &p);
    if (err)
        return NULL;
    if (!hdr_done)
        return PyLong_FromLong(-1);
    return Py_BuildValue("(KKK)", (unsigned long long)wp, (unsigned long long)off, (unsigned long long)rings);
}

/* stream(data, q, head_i, tail_i, want_i, tail, tag, out, off, n, spin_ns, yield_cpu) -> (n, off, want), or -1.
 * The receiving half of a streamed record (a blocking receive larger than take's messages).  n < 0: the
 * record after tail must have its header visible, this tag and a length (n) that fits out, else -1 (nothing
 * consumed: a control record's length never fits).  Then its payload is copied into out[off:] as the producer
 * publishes it, the ring released (tail store at index tail_i of q, then a fence and a read of the producer's
 * want-space flag, u32 index want_i) after every piece, with the GIL released.  Returns when the payload is all
 * there (off == n), when the producer's want flag is up (want = 1: the caller rings it, then calls again with
 * this off and n), or when the head did not move for spin_ns (the producer stalled: the caller hands the rest to
 * its general receive path, the ring's tail being ((tail + 15) & ~15) + 16 + off).  n >= 0 resumes such a call
 * at off (the header, checked before, may be overwritten by now: the ring behind the tail is the producer's).  yield_cpu: sched_yield every 16 polls, as wait_head. */
static PyObject *stream(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError,
                        "stream(data, q, head_i, tail_i, want_i, tail, tag, out, off, n, spin_ns, yield_cpu) takes "
                        "12 arguments");
        return NULL;
    }
    Py_ssize_t hi = PyLong_AsSsize_t(args[2]), ti = PyLong_AsSsize_t(args[3]), wi = PyLong_AsSsize_t(args[4]);
    unsigned long long tail = PyLong_AsUnsignedLongLong(args[5]);
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[6]);
    long long off0 = PyLong_AsLongLong(args[8]);
    long long known = PyLong_AsLongLong(args[9]);
    long long spin = PyLong_AsLongLong(args[10]);
    int yield_cpu = PyObject_IsTrue(args[11]);
    if (PyErr_Occurred() || yield_cpu < 0)
        return NULL;
    Py_buffer d, q, o;
    if (get_buffers(args, 7, PyBUF_SIMPLE, PyBUF_WRITABLE, PyBUF_WRITABLE, &d, &q, &o) < 0)
        return NULL;
    int err = 0, want = 0;
    long long res = -1;
    uint64_t n = 0, off = off0 > 0 ? (uint64_t)off0 : 0;
    uint64_t cap = (uint64_t)d.len;
    if (cap < 32 || (cap & (cap - 1)) || ((uintptr_t)d.buf & 15) || ((uintptr_t)q.buf & 7) || hi < 0 ||
        (hi + 1) * 8 > q.len || ti < 0 || (ti + 1) * 8 > q.len || wi < 0 || (wi + 1) * 4 > q.len || off0 < 0 ||
        (known < 0 && off0 != 0)) {
        PyErr_SetString(PyExc_ValueError, "stream: a ring of a power-of-two size >= 32 and indices inside q");
        err = 1;
    } else {
        uint64_t *qq = (uint64_t *)q.buf;
        const uint32_t *wp = &((const uint32_t *)q.buf)[wi];
        const char *data = (const char *)d.buf;
        uint64_t mask = cap - 1, t = ((uint64_t)tail + 15) & ~(uint64_t)15;
        uint64_t head = __atomic_load_n(&qq[hi], __ATOMIC_ACQUIRE);
        if (known >= 0) {
            n = (uint64_t)known;
            if (n <= (uint64_t)o.len && off <= n)
                res = 0;
        } else if (head >= t + 16) {
            uint64_t hdr[2];
            memcpy(hdr, data + (t & mask), 16);
            n = hdr[1];
            if (hdr[0] == (uint64_t)tag && n <= (uint64_t)o.len && off <= n)
                res = 0;
        }
        if (res == 0) {
            uint64_t base = t + 16;
            Py_BEGIN_ALLOW_THREADS
            uint64_t end = spin_end(spin);
            unsigned polls = 0;
            while (off < n) {
                uint64_t avail = head - (base + off);
                if ((int64_t)avail > 0) {
                    uint64_t k = n - off < avail ? n - off : avail;
                    if (k > cap / 4)
                        k = cap / 4; /* release the ring in pieces: the producer refills behind us */
                    ring_copy_out((char *)o.buf + off, data, mask, base + off, k);
                    off += k;
                    __atomic_store_n(&qq[ti], base + off, __ATOMIC_RELEASE);
                    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the tail before the want flag (Dekker) */
                    if (__atomic_load_n(wp, __ATOMIC_RELAXED)) {
                        want = 1;
                        break;
                    }
                    end = spin_end(spin);
                    polls = 0;
                    continue;
                }
                if (spin_over(&polls, end, yield_cpu))
                    break;
                head = __atomic_load_n(&qq[hi], __ATOMIC_ACQUIRE);
            }
            Py_END_ALLOW_THREADS
        }
    }
    release_buffers(&d, &q, &o);
    if (err)
        return NULL;
    if (res < 0)
        return PyLong_FromLong(-1);
    return Py_BuildValue("(KKi)", (unsigned long long)n, (unsigned long long)off, want);
}

PyMethodDef pg_p2pwait_methods[] = {
    {"put", (PyCFunction)(void (*)(void))put, METH_FASTCALL,
     "put(data, q, head_i, tail_i, head, tag, payload[, bell]) -> new head or -1: write and publish one record "
     "(and ring q's doorbell with bell)"},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL,
     "take(data, q, head_i, tail, tag, out[, tail_i, want_i]) -> n or -1: copy out the next record if it is this "
     "tag's, whole (and release the ring: -2 - n when the producer wants to be rung)"},
    {"put_stream", (PyCFunction)(void (*)(void))put_stream, METH_FASTCALL,
     "put_stream(data, q, head_i, tail_i, head, tag, payload, bell, chunk, step, spin_ns, yield_cpu) -> (end, off, "
     "rings) or -1: write a record of any size in pieces as the consumer makes room (GIL released)"},
    {"stream", (PyCFunction)(void (*)(void))stream, METH_FASTCALL,
     "stream(data, q, head_i, tail_i, want_i, tail, tag, out, off, n, spin_ns, yield_cpu) -> (n, off, want) or -1: "
     "copy a record's payload as it streams in, releasing the ring (GIL released)"},
    {"wait_head", (PyCFunction)(void (*)(void))wait_head, METH_FASTCALL,
     "wait_head(q, head_i, tail, spin_ns, yield_cpu) -> head: poll a ring's head with the GIL released"},
    {NULL, NULL, 0, NULL},
};

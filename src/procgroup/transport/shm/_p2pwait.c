/* Compiled poll of the shm transport's blocking fast receive (procgroup.transport.shm.transport.recv_fast).
 *
 * wait_head(q, head_i, tail, spin_ns, yield_cpu) -> head: spins, with the GIL released, until the u64 at
 * index head_i of buffer q (a ring's published head) differs from tail, or spin_ns have passed; returns the
 * head read last.  yield_cpu: sched_yield every 16 polls (an oversubscribed host: let the peer run), else a
 * pause.  put/take: send_fast's record write and recv_fast's record read (below), each with its handshake
 * folded in (put rings the consumer's doorbell, take releases the ring).  Optional, like _native: without it
 * the transport does all of this in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

/* the doorbell and its sleep flag in a segment (layout.OFF_BELL / OFF_SLEEP; the transport checks they agree) */
#define OFF_BELL 64
#define OFF_SLEEP 72

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* the end of a spin of spin_ns from now (a negative spin: none) */
static uint64_t spin_end(long long spin_ns) {
    return now_ns() + (uint64_t)(spin_ns > 0 ? spin_ns : 0);
}

/* One idle poll of a spin that ends at `end`: every 16th poll reads the clock (1: the spin is over) and yields
 * the CPU when asked (an oversubscribed host: let the peer run); the others pause. */
static int spin_over(unsigned *polls, uint64_t end, int yield_cpu) {
    if ((++*polls & 15) == 0) {
        if (now_ns() >= end)
            return 1;
        if (yield_cpu)
            sched_yield();
    } else {
        CPU_RELAX();
    }
    return 0;
}

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

/* the doorbell handshake of a producer that just published a head into segment q (see put) */
static void ring_bell(char *qbuf, uint32_t bell) {
    uint32_t *b = (uint32_t *)(qbuf + OFF_BELL);
    __atomic_store_n(b, bell, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the doorbell write before the flag read (Dekker) */
    if (__atomic_load_n((const uint32_t *)(qbuf + OFF_SLEEP), __ATOMIC_RELAXED))
        syscall(SYS_futex, b, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* copy k bytes of src into the ring at stream position pos (wrapping) */
static void ring_copy_in(char *data, uint64_t mask, uint64_t pos, const char *src, uint64_t k) {
    uint64_t p = pos & mask, first = mask + 1 - p;
    if (k <= first) {
        memcpy(data + p, src, k);
    } else {
        memcpy(data + p, src, first);
        memcpy(data, src + first, k - first);
    }
}

/* copy k bytes out of the ring from stream position pos (wrapping) */
static void ring_copy_out(char *dst, const char *data, uint64_t mask, uint64_t pos, uint64_t k) {
    uint64_t p = pos & mask, first = mask + 1 - p;
    if (k <= first) {
        memcpy(dst, data + p, k);
    } else {
        memcpy(dst, data + p, first);
        memcpy(dst + first, data, k - first);
    }
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

#define FAST_MAX_C (64 << 10)
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

static PyObject *s_closed, *s_aborted, *s_cur, *s_head, *s_tail, *s_last, *s_sleepers, *s_moved, *s_fast_spun;

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

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "procgroup.transport.shm._p2pwait.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One ShmTransport's send_fast/recv_fast in C (see the comment in _p2pwait.c)",
    .tp_new = core_new,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_methods = core_methods,
};

/* ---------------------------------------------------------------------------------------------------------
 * Front: the common case of procgroup.p2p.send/recv in one call (issue 14).
 *
 * Front(state, group_type, array_type, route, check_count); send(tensor, dst, group, tag, group_dst) and
 * recv(tensor, src, group, tag, group_src), the public functions' arguments as given.  They do what the Python
 * fronts do first, in the same order: a numpy array (exactly array_type), no group_dst/group_src (recv: a
 * src), the group (state.default for None) exactly group_type and neither halted nor without this rank, its
 * route from group.p2p_routes under the same key (route(g, recv, peer, tag, dtype) on a miss: the Python
 * function, which raises what the general path raises), and then, only when the route's fast op checks the
 * buffer itself (its 4th item True: the compiled Core), that op.  Returns None when any of it does not hold
 * (the caller takes its own path, nothing done); else send: the fast op's result (True: sent), recv: the
 * sender's rank (the byte count checked: check_count(n, peer, nbytes) raises on a mismatch), -1 (the caller's
 * general path follows), or the request the fast op handed over. */

typedef struct {
    PyObject_HEAD
    PyObject *state, *group_type, *array_type, *route, *check_count;
} Front;

static PyObject *s_default, *s_halt, *s_rank, *s_routes, *s_dtype, *s_nbytes;

static int front_traverse(Front *f, visitproc visit, void *arg) {
    Py_VISIT(f->state);
    Py_VISIT(f->group_type);
    Py_VISIT(f->array_type);
    Py_VISIT(f->route);
    Py_VISIT(f->check_count);
    return 0;
}

static int front_clear(Front *f) {
    Py_CLEAR(f->state);
    Py_CLEAR(f->group_type);
    Py_CLEAR(f->array_type);
    Py_CLEAR(f->route);
    Py_CLEAR(f->check_count);
    return 0;
}

static void front_dealloc(Front *f) {
    PyObject_GC_UnTrack(f);
    front_clear(f);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyObject *front_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)kw;
    PyObject *state, *gt, *at, *route, *cc;
    if (!PyArg_ParseTuple(args, "OO!O!OO", &state, &PyType_Type, &gt, &PyType_Type, &at, &route, &cc))
        return NULL;
    Front *f = (Front *)type->tp_alloc(type, 0);
    if (f == NULL)
        return NULL;
    PyObject **slots[] = {&f->state, &f->group_type, &f->array_type, &f->route, &f->check_count};
    PyObject *vals[] = {state, gt, at, route, cc};
    for (size_t i = 0; i < 5; i++) {
        Py_INCREF(vals[i]);
        *slots[i] = vals[i];
    }
    return (PyObject *)f;
}

/* The route of a call (a new reference to its 4-tuple whose fast op checks buffers), or NULL: with an error
 * set (raised), or without one (not this front's case: the caller returns None). */
static PyObject *front_route(Front *f, PyObject *const *args, Py_ssize_t nargs, int recv) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "Front.send/recv(tensor, peer, group, tag, group_peer) takes 5 arguments");
        return NULL;
    }
    PyObject *tensor = args[0], *peer = args[1], *group = args[2], *tag = args[3];
    if (Py_TYPE(tensor) != (PyTypeObject *)f->array_type || args[4] != Py_None || (recv && peer == Py_None))
        return NULL;
    PyObject *g = group == Py_None ? PyObject_GetAttr(f->state, s_default) : Py_NewRef(group);
    if (g == NULL)
        return NULL;
    PyObject *hit = NULL, *routes = NULL, *dt = NULL, *key = NULL, *v = NULL;
    if (Py_TYPE(g) != (PyTypeObject *)f->group_type)
        goto done;
    if ((v = PyObject_GetAttr(g, s_halt)) == NULL)
        goto done;
    int halted = v != Py_None;
    Py_CLEAR(v);
    if (halted)
        goto done;
    if ((v = PyObject_GetAttr(g, s_rank)) == NULL)
        goto done;
    long rank = PyLong_Check(v) ? PyLong_AsLong(v) : -1;
    Py_CLEAR(v);
    if (rank < 0)
        goto done; /* (an overflow's error, if any, stays set: raised) */
    if ((routes = PyObject_GetAttr(g, s_routes)) == NULL || !PyDict_CheckExact(routes))
        goto done;
    if ((dt = PyObject_GetAttr(tensor, s_dtype)) == NULL)
        goto done;
    if ((key = PyTuple_Pack(4, recv ? Py_True : Py_False, peer, tag, dt)) == NULL)
        goto done;
    hit = PyDict_GetItemWithError(routes, key);
    if (hit != NULL) {
        Py_INCREF(hit);
    } else if (!PyErr_Occurred()) {
        PyObject *a[5] = {g, recv ? Py_True : Py_False, peer, tag, dt};
        hit = PyObject_Vectorcall(f->route, a, 5, NULL);
    }
    if (hit != NULL && (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) != 4 || PyTuple_GET_ITEM(hit, 3) != Py_True ||
                        PyTuple_GET_ITEM(hit, 2) == Py_None))
        Py_CLEAR(hit);
done:
    Py_XDECREF(key);
    Py_XDECREF(dt);
    Py_XDECREF(routes);
    Py_DECREF(g);
    return hit;
}

static PyObject *front_send(Front *f, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *hit = front_route(f, args, nargs, 0);
    if (hit == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *a[3] = {PyTuple_GET_ITEM(hit, 0), PyTuple_GET_ITEM(hit, 1), args[0]};
    PyObject *res = PyObject_Vectorcall(PyTuple_GET_ITEM(hit, 2), a, 3, NULL);
    Py_DECREF(hit);
    return res;
}

static PyObject *front_recv(Front *f, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *hit = front_route(f, args, nargs, 1);
    if (hit == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *peer = PyTuple_GET_ITEM(hit, 0);
    PyObject *a[3] = {peer, PyTuple_GET_ITEM(hit, 1), args[0]};
    PyObject *n = PyObject_Vectorcall(PyTuple_GET_ITEM(hit, 2), a, 3, NULL);
    if (n == NULL || !PyLong_CheckExact(n)) { /* an error, or the request a stalled stream was handed to */
        Py_DECREF(hit);
        return n;
    }
    long long got = PyLong_AsLongLong(n);
    if (got < 0) {
        Py_DECREF(hit);
        if (PyErr_Occurred()) {
            Py_DECREF(n);
            return NULL;
        }
        return n; /* -1: the general path */
    }
    PyObject *nb = PyObject_GetAttr(args[0], s_nbytes);
    int same = nb == NULL ? -1 : PyObject_RichCompareBool(nb, n, Py_EQ);
    if (same == 0) { /* check_count raises the general path's error */
        PyObject *c[3] = {n, peer, nb};
        PyObject *r = PyObject_Vectorcall(f->check_count, c, 3, NULL);
        Py_XDECREF(r);
        same = r == NULL ? -1 : 1;
    }
    Py_XDECREF(nb);
    Py_DECREF(n);
    PyObject *res = same == 1 ? Py_NewRef(peer) : NULL;
    Py_DECREF(hit);
    return res;
}

static PyMethodDef front_methods[] = {
    {"send", (PyCFunction)(void (*)(void))front_send, METH_FASTCALL,
     "send(tensor, dst, group, tag, group_dst) -> None (not this front's case) or the fast op's result"},
    {"recv", (PyCFunction)(void (*)(void))front_recv, METH_FASTCALL,
     "recv(tensor, src, group, tag, group_src) -> None (not this front's case), the sender, -1 or a request"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FrontType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "procgroup.transport.shm._p2pwait.Front",
    .tp_basicsize = sizeof(Front),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "procgroup.p2p.send/recv's common case in one call (see the comment in _p2pwait.c)",
    .tp_new = front_new,
    .tp_dealloc = (destructor)front_dealloc,
    .tp_traverse = (traverseproc)front_traverse,
    .tp_clear = (inquiry)front_clear,
    .tp_methods = front_methods,
};

static PyMethodDef methods[] = {
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

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_p2pwait", "Compiled poll of the shm blocking fast receive (optional).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__p2pwait(void) {
    struct {
        PyObject **p;
        const char *s;
    } names[] = {{&s_closed, "_closed"}, {&s_aborted, "_aborted"},   {&s_cur, "cur"},
                 {&s_head, "head"},      {&s_tail, "tail"},          {&s_last, "last"},
                 {&s_sleepers, "sleepers"}, {&s_moved, "moved"},     {&s_fast_spun, "_fast_spun"},
                 {&s_default, "default"},   {&s_halt, "_halt"},       {&s_rank, "_rank"},
                 {&s_routes, "p2p_routes"}, {&s_dtype, "dtype"},      {&s_nbytes, "nbytes"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (*names[i].p == NULL && (*names[i].p = PyUnicode_InternFromString(names[i].s)) == NULL)
            return NULL;
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&FrontType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (m != NULL && (PyModule_AddIntConstant(m, "OFF_BELL", OFF_BELL) < 0 ||
                      PyModule_AddIntConstant(m, "OFF_SLEEP", OFF_SLEEP) < 0 ||
                      PyModule_AddIntConstant(m, "FAST_MAX", FAST_MAX_C) < 0 ||
                      PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0 ||
                      PyModule_AddObjectRef(m, "Front", (PyObject *)&FrontType) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

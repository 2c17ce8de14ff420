/* The TCP transport's compiled wait for several receives at once (optional; see _tcp_many.py).

   read_frames(fds, tags, outs, hdr, prog, spin_ns, slice_ns, wake_fd[, hold]) -> 0 | 1 | 2 | 3

   Reads, with the GIL released, one single-frame message from each socket fds[i] straight into outs[i]: the
   24-byte frame header (protocol/frames.py) into hdr[24 i:], then exactly its payload.  It never reads a byte
   past that message, so the Python decoder takes the connection over at a clean point whatever happens.
   A header that is not exactly what was expected (magic, version 1, no flags, reserved 0, tags[i], a length
   that fits outs[i]) stops that connection: DIVERTED, its header bytes in hdr for the decoder, which reports
   garbage or places the other message as ever.

   prog holds five int64 words a connection, kept between calls (a wait that goes on after a slice resumes):
   state (0 pending, 1 done, 2 diverted, 3 EOF, 4 error), header bytes read, payload bytes read, the payload's
   length, errno.  It tries each pending socket without blocking, yields the CPU between empty passes for
   spin_ns, then sleeps in poll() on the pending sockets and wake_fd (the transport's abort/close pipe).
   Returns 0 when no connection is pending any more, 1 when slice_ns passed or a signal came (the caller's
   handler runs), 2 when wake_fd turned readable (or was closed), 3 when some connections are finished while
   others are still pending: at once for a diverted one, else when the spin is over and it would sleep.  The
   caller then gives the finished connections back (another thread may wait for one) and calls again with the
   pending ones, so a connection is never held while this call sleeps for another.  With hold true (a caller that
   keeps every connection's role for the whole call anyway) it sleeps for the pending ones instead; a diverted
   connection still returns 3 at once.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define HDR 24
#define MAXC 64
enum { ST_PENDING = 0, ST_DONE = 1, ST_DIVERTED = 2, ST_EOF = 3, ST_ERROR = 4 };
enum { R_ALL = 0, R_SLICE = 1, R_WOKEN = 2, R_PARTIAL = 3 };

typedef struct {
    int64_t state, hgot, pgot, len, err;
} prog_t;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* 1 and the payload length when h is the header of a one-frame message with this tag that fits cap bytes. */
static int expected_header(const unsigned char *h, uint64_t tag, uint64_t cap, uint64_t *len) {
    uint32_t reserved;
    uint64_t t, n;
    if (h[0] != 0x50 || h[1] != 0x47 || h[2] != 1 || h[3] != 0) /* magic b"PG" (0x4750 LE), version 1, no flags */
        return 0;
    memcpy(&reserved, h + 4, 4);
    memcpy(&t, h + 8, 8);  /* little-endian on the wire: a big-endian host never matches and takes Python's path */
    memcpy(&n, h + 16, 8);
    if (reserved || t != tag || n > cap)
        return 0;
    *len = n;
    return 1;
}

static int diverted(const prog_t *pr, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (pr[i].state == ST_DIVERTED)
            return 1;
    return 0;
}

/* Read what is ready on connection i; returns 1 when some byte came. */
static int advance(int fd, uint64_t tag, char *out, Py_ssize_t cap, unsigned char *h, prog_t *p) {
    int got = 0;
    while (p->state == ST_PENDING) {
        ssize_t k;
        if (p->hgot < HDR) {
            k = recv(fd, h + p->hgot, (size_t)(HDR - p->hgot), MSG_DONTWAIT);
        } else {
            k = recv(fd, out + p->pgot, (size_t)(p->len - p->pgot), MSG_DONTWAIT);
        }
        if (k > 0) {
            got = 1;
            if (p->hgot < HDR) {
                uint64_t n = 0;
                p->hgot += k;
                if (p->hgot < HDR)
                    continue;
                if (!expected_header(h, tag, (uint64_t)cap, &n)) {
                    p->state = ST_DIVERTED;
                    break;
                }
                p->len = (int64_t)n;
            } else {
                p->pgot += k;
            }
            if (p->hgot == HDR && p->pgot == p->len)
                p->state = ST_DONE;
            continue;
        }
        if (k == 0) {
            p->state = ST_EOF;
            break;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            p->state = ST_ERROR;
            p->err = errno;
        }
        break;
    }
    return got;
}

static PyObject *read_frames(PyObject *self, PyObject *args) {
    PyObject *fds_o, *tags_o, *outs_o;
    Py_buffer hdr, prog, outs[MAXC];
    long long spin_ns, slice_ns;
    int wake_fd, hold = 0, fds[MAXC], code = R_SLICE;
    unsigned long long tags[MAXC];
    Py_ssize_t n, i, held = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!O!w*w*LLi|p", &PyTuple_Type, &fds_o, &PyTuple_Type, &tags_o, &PyTuple_Type,
                          &outs_o, &hdr, &prog, &spin_ns, &slice_ns, &wake_fd, &hold))
        return NULL;
    n = PyTuple_GET_SIZE(fds_o);
    if (n > MAXC || PyTuple_GET_SIZE(tags_o) != n || PyTuple_GET_SIZE(outs_o) != n || hdr.len < HDR * n ||
        prog.len < (Py_ssize_t)sizeof(prog_t) * n) {
        PyErr_SetString(PyExc_ValueError, "read_frames: at most 64 connections, and as many tags, outputs, "
                                          "header bytes (24 each) and progress words (5 each)");
        goto fail;
    }
    for (i = 0; i < n; i++) {
        fds[i] = (int)PyLong_AsLong(PyTuple_GET_ITEM(fds_o, i));
        tags[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(tags_o, i));
        if (PyErr_Occurred())
            goto fail;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(outs_o, i), &outs[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        held++;
    }
    {
        prog_t *pr = (prog_t *)prog.buf;
        unsigned char *hb = (unsigned char *)hdr.buf;
        Py_BEGIN_ALLOW_THREADS;
        int64_t t0 = now_ns(), spin_end = t0 + spin_ns, end = t0 + slice_ns;
        for (;;) {
            int pending = 0, progressed = 0;
            struct pollfd pf[MAXC + 1];
            for (i = 0; i < n; i++) {
                if (pr[i].state != ST_PENDING)
                    continue;
                progressed |= advance(fds[i], tags[i], (char *)outs[i].buf, outs[i].len, hb + HDR * i, &pr[i]);
                if (pr[i].state == ST_PENDING)
                    pf[pending++] = (struct pollfd){.fd = fds[i], .events = POLLIN};
            }
            if (!pending) {
                code = R_ALL;
                break;
            }
            if (diverted(pr, n)) { /* its connection goes back to Python now: another thread may want it */
                code = R_PARTIAL;
                break;
            }
            if (progressed)
                continue;
            int64_t t = now_ns();
            if (t >= end) {
                code = R_SLICE;
                break;
            }
            if (t < spin_end) {
                sched_yield();
                continue;
            }
            if (pending < n && !hold) { /* about to sleep: give the finished connections back first */
                code = R_PARTIAL;
                break;
            }
            pf[pending] = (struct pollfd){.fd = wake_fd, .events = POLLIN};
            int ms = (int)((end - t + 999999) / 1000000);
            int r = poll(pf, (nfds_t)pending + 1, ms);
            if (r < 0 && errno == EINTR) { /* a signal: back to Python, which runs its handler (Ctrl-C) */
                code = R_SLICE;
                break;
            }
            if (r > 0 && (pf[pending].revents & (POLLIN | POLLNVAL))) { /* abort or close (or the pipe gone) */
                code = R_WOKEN;
                break;
            }
        }
        Py_END_ALLOW_THREADS;
    }
    for (i = 0; i < held; i++)
        PyBuffer_Release(&outs[i]);
    PyBuffer_Release(&hdr);
    PyBuffer_Release(&prog);
    return PyLong_FromLong(code);
fail:
    for (i = 0; i < held; i++)
        PyBuffer_Release(&outs[i]);
    PyBuffer_Release(&hdr);
    PyBuffer_Release(&prog);
    return NULL;
}

static PyMethodDef methods[] = {
    {"read_frames", read_frames, METH_VARARGS,
     "read_frames(fds, tags, outs, hdr, prog, spin_ns, slice_ns, wake_fd[, hold]) -> 0 (none pending), 1 (slice over), "
     "2 (woken), 3 (some finished, some pending): one single-frame message from each socket into its buffer, the GIL released (see the source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tcpwait",
                                    "The TCP transport's compiled wait for several receives (optional).", -1, methods};

PyMODINIT_FUNC PyInit__tcpwait(void) { return PyModule_Create(&module); }

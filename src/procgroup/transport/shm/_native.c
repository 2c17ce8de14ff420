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
 * The sources: _native.c (this file: module init, the Slots type), _native_slots.c (the exchange: publish,
 * fence, poll), _native_reduce.c, _native_queue.c, _native_big.c, _native_a2a.c, _native_read.c; _native.h says what is where.
 *
 * Plain C and the CPython C API only (no build dependency beyond a C compiler); setup.py builds it as an
 * optional extension.
 */

#include "_native.h"

void free_bufs(Slots *s) {
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
    PyMem_Free(s->pids);
    s->pids = NULL;
    PyMem_Free(s->rr_tmp);
    s->rr_tmp = NULL;
    s->qreg = s->qptr = NULL;
    s->qscratch = NULL;
}

static void Slots_dealloc(Slots *s) {
    free_bufs(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
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
    {"exchange_read", (PyCFunction)(void (*)(void))Slots_exchange_read, METH_FASTCALL,
     "exchange_read(send, recv, check, end, mode, root) -> one-copy reads in one call (_native_read.c): 0 or 1 "
     "(done; 1: a member sleeps), -1 opening not complete, -8 opening complete and a member sleeps (then "
     "read_finish), -5 closing not complete, -6 a member cannot read (nothing moved), -9 a read failed, -3 sizes"},
    {"read_finish", (PyCFunction)(void (*)(void))Slots_read_finish, METH_FASTCALL,
     "read_finish(send, recv, end, mode, root) -> exchange_read's reads and closing, after its opening completed"},
    {"set_pids", (PyCFunction)(void (*)(void))Slots_set_pids, METH_FASTCALL,
     "set_pids(pids): every member's process id, for exchange_read"},
    {"exchange_rr", (PyCFunction)(void (*)(void))Slots_exchange_rr, METH_FASTCALL,
     "exchange_rr(send, recv, check, op, type, mode, stage) -> a reduction by one-copy reads (_native_rr.c): as "
     "exchange_read, and -7 middle exchange not complete, -10 middle complete and a member sleeps (then stage 2)"},
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
    {"rd_errno", T_INT, offsetof(Slots, rd_errno), READONLY, "errno of the last failed one-copy read"},
    {"rd_peer", T_PYSSIZET, offsetof(Slots, rd_peer), READONLY, "member of the last failed one-copy read"},
    {"rd_calls", T_ULONGLONG, offsetof(Slots, rd_calls), READONLY, "calls that read out of other members' memory"},
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


size_t pg_stream_min[2] = {SIZE_MAX, SIZE_MAX};

static PyObject *set_stream_min(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_stream_min(whole, pieces)");
        return NULL;
    }
    Py_ssize_t a = PyLong_AsSsize_t(args[0]), b = PyLong_AsSsize_t(args[1]);
    if ((a == -1 || b == -1) && PyErr_Occurred()) return NULL;
    pg_stream_min[STREAM_WHOLE] = a < 0 ? SIZE_MAX : (size_t)a;
    pg_stream_min[STREAM_PIECES] = b < 0 ? SIZE_MAX : (size_t)b;
    Py_RETURN_NONE;
}

static PyObject *get_stream_min(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    Py_ssize_t v[2];
    for (int i = 0; i < 2; i++) v[i] = pg_stream_min[i] == SIZE_MAX ? -1 : (Py_ssize_t)pg_stream_min[i];
    return Py_BuildValue("(nn)", v[0], v[1]);
}

static PyMethodDef mod_methods[] = {
    {"set_stream_min", (PyCFunction)(void (*)(void))set_stream_min, METH_FASTCALL,
     "set_stream_min(whole, pieces): copies into shared memory of that many bytes and more use non-temporal "
     "stores (-1: never); whole: a buffer every member reads whole, pieces: each member reads its own piece"},
    {"stream_min", get_stream_min, METH_NOARGS, "(whole, pieces): set_stream_min's thresholds (-1: never)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_native", "Compiled fast path of the shm arena (optional).", -1, mod_methods, NULL, NULL,
    NULL, NULL,
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
    if (PyModule_AddIntConstant(m, "SLOT_HDR", SLOT_HDR) < 0 ||
        PyModule_AddIntConstant(m, "END_SALT", (long)PG_END_SALT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* Compiled per-call bookkeeping of a planned collective (procgroup.groupcore; issue 14).
 *
 * GroupCore is the base class of procgroup.process_group.ProcessGroup: it holds, as C fields, the state that
 * every planned call reads and writes (sequence number, fingerprint chain, flight and chain windows, the
 * one-thread token, the reused Comm and Deadline), and its run_plan does ProcessGroup._run_plan_py's work
 * for the common case in one C call: the guards, the sequence number, the chain (CRC-32, zlib's), the flight
 * entry, the deadline, the tag, plan.fn(comm, a, b), the completion stamp.  Every other case (the group
 * halted, async work pending, a thread other than the home one, another thread inside a call, an engine's
 * post/done split, no reusable Comm, the compiled path switched off) goes to _run_plan_py before anything
 * is changed, and an error of plan.fn goes through ProcessGroup._plan_failed, so errors, records and the
 * check word are the same on both paths.  Optional: without it procgroup.groupcore's pure-Python class holds
 * the same fields (as slots) and ProcessGroup.run_plan is _run_plan_py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>
#include <stdint.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    PyObject *halt;     /* _halt: None, or why the group refuses calls */
    PyObject *pending;  /* _pending: the outstanding async Works (a list) */
    PyObject *busy;     /* _busy: the one-thread token (a list: pop to take, append to give back) */
    PyObject *chain;    /* chain: deque of (seq, chain value) */
    PyObject *flight;   /* flight: deque of flight entries */
    PyObject *inflight; /* the call in flight's entry, or None */
    PyObject *plan_dl;  /* _plan_dl: the Deadline run_plan resets per call */
    PyObject *comm;     /* _comm: the reused Comm, or None */
    unsigned long home, owner;
    long long seq, gid, last_completed;
    double timeout;
    unsigned int chainv; /* _chain */
    char comm_busy;      /* _comm_busy */
    char fast;           /* _fast: run_plan's compiled path on (PROCGROUP_NATIVE) */
    /* chain.append and flight.append, bound (remade when chain or flight is another deque) */
    PyObject *chain_of, *chain_append, *flight_of, *flight_append;
} GroupCore;

/* PlanCore: the fields of a plan (procgroup.plans.Plan's base) that run_plan reads */
typedef struct {
    PyObject_HEAD
    PyObject *fpb;  /* the fingerprint's bytes, for the chain */
    PyObject *fn;   /* fn(comm, a, b): the call's work */
    PyObject *post; /* the engine's post(a, b), or None */
    unsigned long long fpx; /* the fingerprint xor the group's generation, for the tag */
    char direct;            /* fn takes (a, check word, deadline) instead of (comm, a, b) */
} PlanCore;

/* the tag layout of procgroup.tags / algorithms.comm, set once by procgroup.groupcore (set_layout) */
static unsigned long long seq_mask = 0xFFFF;
static int step_bits = 16;
static long long gid_limit = 1 << 14;

static PyObject *s_run_plan_py, *s_plan_failed, *s_at, *s_start, *s_tag, *s_deadline, *s_append;
static PyTypeObject PlanType;

static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

/* zlib.crc32(data, value) */
static uint32_t crc32_update(uint32_t crc, const unsigned char *p, Py_ssize_t n) {
    crc = ~crc;
    while (n-- > 0) crc = crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

/* time.monotonic() (CLOCK_MONOTONIC on Linux, as CPython's) */
static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int gc_traverse(GroupCore *s, visitproc visit, void *arg) {
    Py_VISIT(s->halt);
    Py_VISIT(s->pending);
    Py_VISIT(s->busy);
    Py_VISIT(s->chain);
    Py_VISIT(s->flight);
    Py_VISIT(s->inflight);
    Py_VISIT(s->plan_dl);
    Py_VISIT(s->comm);
    Py_VISIT(s->chain_of);
    Py_VISIT(s->chain_append);
    Py_VISIT(s->flight_of);
    Py_VISIT(s->flight_append);
    return 0;
}

static int gc_clear(GroupCore *s) {
    Py_CLEAR(s->halt);
    Py_CLEAR(s->pending);
    Py_CLEAR(s->busy);
    Py_CLEAR(s->chain);
    Py_CLEAR(s->flight);
    Py_CLEAR(s->inflight);
    Py_CLEAR(s->plan_dl);
    Py_CLEAR(s->comm);
    Py_CLEAR(s->chain_of);
    Py_CLEAR(s->chain_append);
    Py_CLEAR(s->flight_of);
    Py_CLEAR(s->flight_append);
    return 0;
}

static void gc_dealloc(GroupCore *s) {
    PyObject_GC_UnTrack(s);
    gc_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *core_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)args;
    (void)kw;
    GroupCore *s = (GroupCore *)type->tp_alloc(type, 0);
    if (s == NULL) return NULL;
    PyObject **objs[] = {&s->halt, &s->inflight, &s->comm};
    for (size_t i = 0; i < sizeof objs / sizeof objs[0]; i++) {
        Py_INCREF(Py_None);
        *objs[i] = Py_None;
    }
    s->last_completed = -1;
    s->fast = 1;
    return (PyObject *)s;
}

/* give the one-thread token back (run_plan's finally) */
static int release(GroupCore *s) {
    if (!s->home) s->owner = 0;
    return PyList_Append(s->busy, Py_True);
}

/* obj.append, bound once per deque (*of: the deque it was bound for) */
static PyObject *appender(PyObject *obj, PyObject **of, PyObject **bound) {
    if (*of != obj || *bound == NULL) {
        PyObject *m = PyObject_GetAttr(obj, s_append);
        if (m == NULL) return NULL;
        Py_XSETREF(*bound, m);
        Py_INCREF(obj);
        Py_XSETREF(*of, obj);
    }
    return *bound;
}

static PyObject *delegate(GroupCore *s, PyObject *plan, PyObject *a, PyObject *b) {
    return PyObject_CallMethodObjArgs((PyObject *)s, s_run_plan_py, plan, a, b, NULL);
}

/* an error of plan.fn (set): ProcessGroup._plan_failed(exc, entry, plan, seq) returns what to raise */
static void failed(GroupCore *s, PyObject *rec, PyObject *plan, long long seq) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb != NULL) PyException_SetTraceback(v, tb);
    PyObject *seqo = PyLong_FromLongLong(seq);
    PyObject *err = seqo ? PyObject_CallMethodObjArgs((PyObject *)s, s_plan_failed, v, rec, plan, seqo, NULL) : NULL;
    Py_XDECREF(seqo);
    if (err == NULL) { /* the handler failed: its error wins, the original is its context */
        PyObject *t2, *v2, *tb2;
        PyErr_Fetch(&t2, &v2, &tb2);
        PyErr_NormalizeException(&t2, &v2, &tb2);
        if (v2 != NULL) PyException_SetContext(v2, v); /* steals v */
        else Py_DECREF(v);
        Py_XDECREF(t);
        Py_XDECREF(tb);
        PyErr_Restore(t2, v2, tb2);
        return;
    }
    if (err == v) { /* re-raised as it is */
        Py_DECREF(err);
        PyErr_Restore(t, v, tb);
        return;
    }
    PyException_SetContext(err, v); /* steals v: `raise err` inside `except` */
    Py_XDECREF(t);
    Py_XDECREF(tb);
    PyObject *et = (PyObject *)Py_TYPE(err);
    Py_INCREF(et);
    PyErr_Restore(et, err, PyException_GetTraceback(err)); /* steals et, err and the traceback */
}

static int set_float(PyObject *o, PyObject *name, double x) {
    PyObject *f = PyFloat_FromDouble(x);
    if (f == NULL) return -1;
    int r = PyObject_SetAttr(o, name, f);
    Py_DECREF(f);
    return r;
}

PyDoc_STRVAR(run_plan_doc,
             "run_plan(plan, a=None, b=None)\n--\n\nRun a planned blocking collective (see "
             "ProcessGroup._run_plan_py, whose work this does in one C call for the common case).");

static PyObject *run_plan(GroupCore *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "run_plan(plan, a=None, b=None)");
        return NULL;
    }
    PyObject *plan = args[0], *a = nargs > 1 ? args[1] : Py_None, *b = nargs > 2 ? args[2] : Py_None;
    unsigned long me = PyThread_get_thread_ident();
    if (!s->fast || s->halt != Py_None || s->pending == NULL || !PyList_CheckExact(s->pending) ||
        PyList_GET_SIZE(s->pending) != 0 || (s->home && me != s->home) || s->busy == NULL ||
        !PyList_CheckExact(s->busy) || PyList_GET_SIZE(s->busy) == 0 || s->comm == Py_None || s->comm_busy ||
        s->plan_dl == NULL || s->chain == NULL || s->flight == NULL || s->gid < 0 || s->gid >= gid_limit)
        return delegate(s, plan, a, b);
    PlanCore *p = (PlanCore *)plan;
    /* not a plan, its engine's split (_run_plan_py posts first), or a field unset: _run_plan_py */
    if (!PyObject_TypeCheck(plan, &PlanType) || p->post != Py_None || p->fpb == NULL || !PyBytes_CheckExact(p->fpb) ||
        p->fn == NULL)
        return delegate(s, plan, a, b);
    PyObject *chain_append = appender(s->chain, &s->chain_of, &s->chain_append);
    PyObject *flight_append = chain_append ? appender(s->flight, &s->flight_of, &s->flight_append) : NULL;
    if (flight_append == NULL) return NULL;
    PyObject *fpb = p->fpb, *fn = p->fn, *rec = NULL, *res = NULL;
    Py_INCREF(fpb);
    Py_INCREF(fn);
    Py_INCREF(chain_append);
    Py_INCREF(flight_append);
    unsigned long long fpx = p->fpx;

    /* the token (another thread inside a call found it gone and took _run_plan_py's path: ConcurrentUseError) */
    Py_ssize_t nb = PyList_GET_SIZE(s->busy);
    if (PyList_SetSlice(s->busy, nb - 1, nb, NULL) < 0) goto out;
    if (!s->home) s->owner = me;
    long long seq = s->seq;
    s->seq = seq + 1;
    s->chainv = crc32_update(s->chainv, (const unsigned char *)PyBytes_AS_STRING(fpb), PyBytes_GET_SIZE(fpb));
    PyObject *pair = Py_BuildValue("(LI)", seq, s->chainv);
    if (pair == NULL) goto fail_release;
    PyObject *r = PyObject_CallOneArg(chain_append, pair);
    Py_DECREF(pair);
    if (r == NULL) goto fail_release;
    Py_DECREF(r);
    double now = monotonic();
    if (set_float(s->plan_dl, s_at, now + s->timeout) < 0 || set_float(s->plan_dl, s_start, now) < 0)
        goto fail_release;
    /* the compact flight entry [seq, plan, start, end] (flight.as_record) */
    if ((rec = PyList_New(4)) == NULL) goto fail_release;
    PyObject *seqo = PyLong_FromLongLong(seq), *nowo = PyFloat_FromDouble(now);
    if (seqo == NULL || nowo == NULL) {
        Py_XDECREF(seqo);
        Py_XDECREF(nowo);
        goto fail_release;
    }
    PyList_SET_ITEM(rec, 0, seqo);
    Py_INCREF(plan);
    PyList_SET_ITEM(rec, 1, plan);
    PyList_SET_ITEM(rec, 2, nowo);
    Py_INCREF(Py_None);
    PyList_SET_ITEM(rec, 3, Py_None);
    if ((r = PyObject_CallOneArg(flight_append, rec)) == NULL) goto fail_release;
    Py_DECREF(r);
    Py_INCREF(rec);
    Py_SETREF(s->inflight, rec);
    unsigned long long tag = ((unsigned long long)s->gid << 32) | (((unsigned long long)seq & seq_mask) << 16) | fpx;
    if (p->direct) { /* fn(a, check word, deadline): the check word is the tag's low 32 bits (Comm.check_word) */
        PyObject *cw = PyLong_FromUnsignedLong((unsigned long)(tag & 0xFFFFFFFFull));
        if (cw == NULL) goto fail_release;
        PyObject *dl = s->plan_dl;
        Py_INCREF(dl);
        PyObject *dargs[3] = {a, cw, dl};
        res = PyObject_Vectorcall(fn, dargs, 3, NULL);
        Py_DECREF(cw);
        Py_DECREF(dl);
    } else {
        PyObject *tago = PyLong_FromUnsignedLongLong(tag << step_bits);
        if (tago == NULL) goto fail_release;
        int bad = PyObject_SetAttr(s->comm, s_tag, tago);
        Py_DECREF(tago);
        if (bad < 0 || PyObject_SetAttr(s->comm, s_deadline, s->plan_dl) < 0) goto fail_release;
        PyObject *comm = s->comm;
        Py_INCREF(comm);
        PyObject *cargs[3] = {comm, a, b};
        res = PyObject_Vectorcall(fn, cargs, 3, NULL);
        Py_DECREF(comm);
    }
    if (res == NULL) {
        failed(s, rec, plan, seq);
        goto fail_release;
    }
    Py_DECREF(res);
    PyObject *end = PyFloat_FromDouble(monotonic());
    if (end == NULL) goto fail_release;
    PyList_SetItem(rec, 3, end); /* steals end, drops the None */
    s->last_completed = seq;
    Py_INCREF(Py_None);
    Py_SETREF(s->inflight, Py_None);
    if (release(s) < 0) goto out;
    Py_INCREF(Py_None);
    res = Py_None;
    goto out;
fail_release: {
    /* give the token back with the error kept */
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (release(s) < 0) PyErr_Clear();
    PyErr_Restore(t, v, tb);
    res = NULL;
}
out:
    Py_XDECREF(rec);
    Py_DECREF(fn);
    Py_DECREF(fpb);
    Py_DECREF(chain_append);
    Py_DECREF(flight_append);
    return res;
}

static PyMethodDef core_methods[] = {
    {"run_plan", (PyCFunction)(void (*)(void))run_plan, METH_FASTCALL, run_plan_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef core_members[] = {
    {"_halt", T_OBJECT, offsetof(GroupCore, halt), 0, "why the group refuses every call (None: usable)"},
    {"_pending", T_OBJECT, offsetof(GroupCore, pending), 0, "the outstanding async Works"},
    {"_busy", T_OBJECT, offsetof(GroupCore, busy), 0, "the one-thread token"},
    {"chain", T_OBJECT, offsetof(GroupCore, chain), 0, "(seq, chain value) of the recent calls"},
    {"flight", T_OBJECT, offsetof(GroupCore, flight), 0, "the flight recorder's entries"},
    {"inflight", T_OBJECT, offsetof(GroupCore, inflight), 0, "the call in flight's entry (None: none)"},
    {"_plan_dl", T_OBJECT, offsetof(GroupCore, plan_dl), 0, "run_plan's Deadline, reset per call"},
    {"_comm", T_OBJECT, offsetof(GroupCore, comm), 0, "the Comm reused by blocking calls"},
    {"_home", T_ULONG, offsetof(GroupCore, home), 0, "the home thread's ident (0: none)"},
    {"_owner", T_ULONG, offsetof(GroupCore, owner), 0, "the ident of the thread inside a call (0: none)"},
    {"_seq", T_LONGLONG, offsetof(GroupCore, seq), 0, "the next call's sequence number"},
    {"gid", T_LONGLONG, offsetof(GroupCore, gid), 0, "the group id"},
    {"last_completed", T_LONGLONG, offsetof(GroupCore, last_completed), 0, "the last completed call's seq"},
    {"timeout", T_DOUBLE, offsetof(GroupCore, timeout), 0, "the group's default deadline (s)"},
    {"_chain", T_UINT, offsetof(GroupCore, chainv), 0, "the rolling CRC-32 of the calls' fingerprints"},
    {"_comm_busy", T_BOOL, offsetof(GroupCore, comm_busy), 0, "a call is using _comm"},
    {"_fast", T_BOOL, offsetof(GroupCore, fast), 0, "run_plan's compiled path on"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "procgroup._groupcore.GroupCore",
    .tp_basicsize = sizeof(GroupCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The per-call state of a process group, and its compiled run_plan (see the module).",
    .tp_traverse = (traverseproc)gc_traverse,
    .tp_clear = (inquiry)gc_clear,
    .tp_dealloc = (destructor)gc_dealloc,
    .tp_new = core_new,
    .tp_methods = core_methods,
    .tp_members = core_members,
};

static int plan_traverse(PlanCore *p, visitproc visit, void *arg) {
    Py_VISIT(p->fpb);
    Py_VISIT(p->fn);
    Py_VISIT(p->post);
    return 0;
}

static int plan_clear(PlanCore *p) {
    Py_CLEAR(p->fpb);
    Py_CLEAR(p->fn);
    Py_CLEAR(p->post);
    return 0;
}

static void plan_dealloc(PlanCore *p) {
    PyObject_GC_UnTrack(p);
    plan_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyObject *plan_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)args;
    (void)kw;
    PlanCore *p = (PlanCore *)type->tp_alloc(type, 0);
    if (p == NULL) return NULL;
    Py_INCREF(Py_None);
    p->post = Py_None;
    return (PyObject *)p;
}

static PyMemberDef plan_members[] = {
    {"fpb", T_OBJECT, offsetof(PlanCore, fpb), 0, "the fingerprint's bytes, for the chain"},
    {"fn", T_OBJECT, offsetof(PlanCore, fn), 0, "fn(comm, a, b): the call's work"},
    {"post", T_OBJECT, offsetof(PlanCore, post), 0, "the engine's post(a, b), or None"},
    {"fpx", T_ULONGLONG, offsetof(PlanCore, fpx), 0, "the fingerprint xor the group's generation, for the tag"},
    {"direct", T_BOOL, offsetof(PlanCore, direct), 0, "fn takes (a, check word, deadline), not (comm, a, b)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "procgroup._groupcore.PlanCore",
    .tp_basicsize = sizeof(PlanCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The fields of a planned call that GroupCore.run_plan reads (procgroup.plans.Plan's base).",
    .tp_traverse = (traverseproc)plan_traverse,
    .tp_clear = (inquiry)plan_clear,
    .tp_dealloc = (destructor)plan_dealloc,
    .tp_new = plan_new,
    .tp_members = plan_members,
};

static PyObject *set_layout(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long m;
    int bits;
    long long lim;
    if (!PyArg_ParseTuple(args, "KiL", &m, &bits, &lim)) return NULL;
    if (bits < 0 || bits > 16 || lim <= 0 || lim > (1LL << 14)) {
        PyErr_SetString(PyExc_ValueError, "set_layout: the tag layout would overflow 64 bits");
        return NULL;
    }
    seq_mask = m;
    step_bits = bits;
    gid_limit = lim;
    Py_RETURN_NONE;
}

static PyObject *crc32_py(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &value)) return NULL;
    uint32_t c = crc32_update(value, view.buf, view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

static PyMethodDef methods[] = {
    {"set_layout", set_layout, METH_VARARGS, "set_layout(seq_mask, step_bits, gid_limit): the tag layout."},
    {"crc32", crc32_py, METH_VARARGS, "crc32(data, value=0): run_plan's CRC-32 (zlib.crc32's), for the tests."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_groupcore", "Compiled per-call bookkeeping of planned collectives (optional).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__groupcore(void) {
    crc_init();
    const char *names[] = {"_run_plan_py", "_plan_failed", "at", "start", "tag", "deadline", "append"};
    PyObject **slots[] = {&s_run_plan_py, &s_plan_failed, &s_at, &s_start, &s_tag, &s_deadline, &s_append};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*slots[i] = PyUnicode_InternFromString(names[i])) == NULL) return NULL;
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&PlanType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL) return NULL;
    if (PyModule_AddType(m, &CoreType) < 0 || PyModule_AddType(m, &PlanType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

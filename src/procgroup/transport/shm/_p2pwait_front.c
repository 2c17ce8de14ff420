/* The Front type of procgroup.transport.shm._p2pwait (module init in _p2pwait.c; the comment below describes it). */

#include "_p2pwait.h"

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

PyTypeObject FrontType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "procgroup.transport.shm._p2pwait.Front",
    .tp_basicsize = sizeof(Front),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "procgroup.p2p.send/recv's common case in one call (see the comment in _p2pwait_front.c)",
    .tp_new = front_new,
    .tp_dealloc = (destructor)front_dealloc,
    .tp_traverse = (traverseproc)front_traverse,
    .tp_clear = (inquiry)front_clear,
    .tp_methods = front_methods,
};

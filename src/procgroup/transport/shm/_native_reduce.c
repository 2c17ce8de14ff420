/* The reductions of procgroup.transport.shm._native (see _native.c): reduce_ptrs (also used by the queue and the
 * big slots) and the Slots methods that reduce. */

#include "_native.h"

/* ---- reductions: out = slot[0] op slot[1] op ... in member order (numpy's element-wise results, bit for bit) */
#define MIN_F(a, b) (((a) != (a) || (a) < (b)) ? (a) : (b)) /* np.minimum: NaN wins, a tie gives b */
#define MAX_F(a, b) (((a) != (a) || (a) > (b)) ? (a) : (b))
#define MIN_I(a, b) ((a) < (b) ? (a) : (b))
#define MAX_I(a, b) ((a) > (b) ? (a) : (b))
#define ADD(a, b) ((a) + (b))
#define MUL(a, b) ((a) * (b))

#define REDUCE_LOOP(T, EXPR)                                                  \
    do {                                                                      \
        T *o = (T *)out;                                                      \
        const T *x = (const T *)(src[0] + off);                               \
        const T *y = (const T *)(src[1] + off);                               \
        for (Py_ssize_t i = 0; i < cnt; i++) o[i] = EXPR(x[i], y[i]);         \
        for (Py_ssize_t m = 2; m < n; m++) {                                  \
            const T *z = (const T *)(src[m] + off);                           \
            for (Py_ssize_t i = 0; i < cnt; i++) o[i] = EXPR(o[i], z[i]);     \
        }                                                                     \
    } while (0)

#define REDUCE_TYPE(T, UT, MINX, MAXX)                 \
    switch (op) {                                      \
    case OP_SUM: REDUCE_LOOP(UT, ADD); break;          \
    case OP_PROD: REDUCE_LOOP(UT, MUL); break;         \
    case OP_MIN: REDUCE_LOOP(T, MINX); break;          \
    default: REDUCE_LOOP(T, MAXX); break;              \
    }

/* out = (src[0] + off) op (src[1] + off) op ... over n members, cnt elements, in member order */
void reduce_ptrs(char *const *src, Py_ssize_t n, Py_ssize_t off, char *out, Py_ssize_t cnt, int op, int type) {
    if (n == 1) {
        copy_bytes(out, src[0] + off, (size_t)(cnt * type_size[type]));
        return;
    }
    switch (type) {
    case T_F32: REDUCE_TYPE(float, float, MIN_F, MAX_F); break;
    case T_F64: REDUCE_TYPE(double, double, MIN_F, MAX_F); break;
    case T_I32: REDUCE_TYPE(int32_t, uint32_t, MIN_I, MAX_I); break; /* sums and products wrap, as numpy's */
    default: REDUCE_TYPE(int64_t, uint64_t, MIN_I, MAX_I); break;
    }
}

static void reduce_slots(const Slots *s, int k, char *out, Py_ssize_t cnt, int op, int type) {
    reduce_ptrs(s->slot[k], s->n, SLOT_HDR, out, cnt, op, type);
}

/* exchange_reduce(buf, check, op, type, reduce): publish buf; when complete and `reduce`, buf = the reduction */
PyObject *Slots_exchange_reduce(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "exchange_reduce(buf, check, op, type, reduce)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    int op, type;
    if (parse_op(args[2], args[3], &op, &type)) return NULL;
    unsigned long check = PyLong_AsUnsignedLongMask(args[1]);
    if (check == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    int red = PyObject_IsTrue(args[4]);
    if (red < 0) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, red ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return NULL;
    int sz = type_size[type];
    int r;
    if (b.len > s->max_bytes)
        r = R_TOO_LARGE;
    else if (b.len % sz || (uintptr_t)b.buf % (uintptr_t)sz)
        r = R_MISALIGNED;
    else {
        r = publish_and_poll(s, b.buf, b.len, (uint32_t)check);
        if (r >= 0 && red) reduce_slots(s, s->k, b.buf, b.len / sz, op, type);
    }
    PyBuffer_Release(&b);
    return PyLong_FromLong(r);
}

/* reduce(buf, op, type[, off]): buf = the reduction of the last call's slots from payload byte `off` (after the
 * caller saw it complete) */
PyObject *Slots_reduce(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "reduce(buf, op, type[, off])");
        return NULL;
    }
    if (check_live(s)) return NULL;
    int op, type;
    if (parse_op(args[1], args[2], &op, &type)) return NULL;
    Py_ssize_t off = nargs == 4 ? PyLong_AsSsize_t(args[3]) : 0;
    if (off == -1 && PyErr_Occurred()) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_WRITABLE) < 0) return NULL;
    int sz = type_size[type];
    if (off < 0 || off + b.len > s->max_bytes || b.len % sz || (uintptr_t)b.buf % (uintptr_t)sz) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "arena slots: bad reduction buffer");
        return NULL;
    }
    reduce_ptrs(s->slot[s->k], s->n, SLOT_HDR + off, b.buf, b.len / sz, op, type);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

/* exchange_reduce_block(data, out, check, op, type, off): publish data; when complete, out = every member's slot
 * from payload byte `off` (len(out) bytes), reduced in member order (reduce_scatter's block) */
PyObject *Slots_exchange_reduce_block(Slots *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "exchange_reduce_block(data, out, check, op, type, off)");
        return NULL;
    }
    if (check_live(s)) return NULL;
    int op, type;
    if (parse_op(args[3], args[4], &op, &type)) return NULL;
    unsigned long check = PyLong_AsUnsignedLongMask(args[2]);
    Py_ssize_t off = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer d, o;
    if (PyObject_GetBuffer(args[0], &d, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &o, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    int sz = type_size[type], r;
    if (d.len > s->max_bytes)
        r = R_TOO_LARGE;
    else if (off < 0 || off + o.len > d.len || o.len % sz || (uintptr_t)o.buf % (uintptr_t)sz)
        r = R_MISALIGNED;
    else {
        r = publish_and_poll(s, d.buf, d.len, (uint32_t)check);
        if (r >= 0) reduce_ptrs(s->slot[s->k], s->n, SLOT_HDR + off, o.buf, o.len / sz, op, type);
    }
    PyBuffer_Release(&o);
    PyBuffer_Release(&d);
    return PyLong_FromLong(r);
}

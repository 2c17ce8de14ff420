/* Compiled poll of the shm transport's blocking fast receive (procgroup.transport.shm.transport.recv_fast).
 *
 * wait_head(q, head_i, tail, spin_ns, yield_cpu) -> head: spins, with the GIL released, until the u64 at
 * index head_i of buffer q (a ring's published head) differs from tail, or spin_ns have passed; returns the
 * head read last.  yield_cpu: sched_yield every 16 polls (an oversubscribed host: let the peer run), else a
 * pause.  Optional, like _native: without it recv_fast polls in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

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
    uint64_t end = now_ns() + (uint64_t)(spin > 0 ? spin : 0);
    unsigned k = 0;
    for (;;) {
        h = __atomic_load_n(p, __ATOMIC_ACQUIRE);
        if (h != (uint64_t)tail)
            break;
        if ((++k & 15) == 0) {
            if (now_ns() >= end)
                break;
            if (yield_cpu)
                sched_yield();
        } else {
            CPU_RELAX();
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"wait_head", (PyCFunction)(void (*)(void))wait_head, METH_FASTCALL,
     "wait_head(q, head_i, tail, spin_ns, yield_cpu) -> head: poll a ring's head with the GIL released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_p2pwait", "Compiled poll of the shm blocking fast receive (optional).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__p2pwait(void) { return PyModule_Create(&moddef); }

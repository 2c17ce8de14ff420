/* Compiled poll of the shm transport's blocking fast receive (procgroup.transport.shm.transport.recv_fast).
 *
 * wait_head(q, head_i, tail, spin_ns, yield_cpu) -> head: spins, with the GIL released, until the u64 at
 * index head_i of buffer q (a ring's published head) differs from tail, or spin_ns have passed; returns the
 * head read last.  yield_cpu: sched_yield every 16 polls (an oversubscribed host: let the peer run), else a
 * pause.  put/take: send_fast's record write and recv_fast's record read (below), each with its handshake
 * folded in (put rings the consumer's doorbell, take releases the ring).  Optional, like _native: without it
 * the transport does all of this in Python.
 *
 * The sources (_p2pwait.h says what is where): this file (module init), _p2pwait_ring.c (wait_head, put, take,
 * put_stream, stream), _p2pwait_core.c (Core: its comment describes it) and _p2pwait_front.c (Front: likewise).
 */

#include "_p2pwait.h"

PyObject *s_closed, *s_aborted, *s_cur, *s_head, *s_tail, *s_last, *s_sleepers, *s_moved, *s_fast_spun;
PyObject *s_default, *s_halt, *s_rank, *s_routes, *s_dtype, *s_nbytes;

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_p2pwait", "Compiled poll of the shm blocking fast receive (optional).", -1,
    pg_p2pwait_methods, NULL, NULL, NULL, NULL,
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

/*
 * Batched scatter/gather memory copy for kvtier's host data plane.
 *
 * copy(dst, src, dst_offsets, src_offsets, lengths, threads) copies
 * lengths[i] bytes from src + src_offsets[i] to dst + dst_offsets[i] for every i.
 *
 * Invariants:
 *  - Every range is checked against its buffer before any byte moves; a bad
 *    range raises ValueError and copies nothing.
 *  - The GIL is released for the copy, so other Python threads (the gRPC event
 *    loop) keep running.
 *  - Ranges that continue each other in both buffers are merged into one memcpy,
 *    so a contiguous layout costs one call per run, not one per chunk.
 *  - With threads > 1 the ranges are split into that many parts of about equal
 *    bytes; the caller guarantees that destination ranges do not overlap.
 *  - A copy survives memory that disappears under it. Either buffer may be a
 *    shared mapping that another process can shrink (ftruncate) at any moment;
 *    touching a page past the new end of the object raises SIGBUS. Every copy
 *    runs under a per-thread guard (sigsetjmp); the process-wide SIGBUS handler
 *    jumps back to the guard of the faulting thread, and the call raises
 *    MemoryFault naming the address and the buffer it lies in. Bytes copied
 *    before the fault stay copied: the caller must treat the whole destination
 *    as undefined.
 *  - A SIGBUS outside a guarded copy (or sent with kill) is not ours: it goes
 *    to the handler that was installed before (Python's faulthandler, say) or
 *    gets the default action, exactly as if this module were not loaded.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 64

/* ------------------------------------------------------------------ guard */

typedef struct {
    sigjmp_buf env;
    void *volatile addr;
} fault_guard;

/* The guard of the copy this thread is running, or NULL. initial-exec: the
 * handler reads it without any call into the dynamic linker. */
static _Thread_local fault_guard *volatile tls_guard __attribute__((tls_model("initial-exec")));
/* Set while this thread runs the previous handler, so that a handler that
 * re-raises into us ends in the default action instead of a loop. */
static _Thread_local volatile int tls_in_chain __attribute__((tls_model("initial-exec")));

/* Written before our handler is installed, read-only afterwards. */
static struct sigaction prev_action;

static void default_action(int sig, const siginfo_t *info)
{
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    /* A fault repeats when the handler returns and now kills; a signal sent by
     * kill() or raise() does not repeat, so send it again. */
    if (info == NULL || info->si_code <= 0)
        raise(sig);
}

static void on_sigbus(int sig, siginfo_t *info, void *uctx)
{
    fault_guard *g = tls_guard;
    /* si_code > 0: raised by the kernel for this thread's own access. */
    if (g != NULL && info != NULL && info->si_code > 0) {
        tls_guard = NULL;
        g->addr = info->si_addr;
        siglongjmp(g->env, 1);
    }
    if (tls_in_chain) {
        default_action(sig, info);
        return;
    }
    struct sigaction prev = prev_action;
    if (prev.sa_flags & SA_SIGINFO) {
        if (prev.sa_sigaction != NULL) {
            tls_in_chain = 1;
            prev.sa_sigaction(sig, info, uctx);
            tls_in_chain = 0;
            return;
        }
    } else if (prev.sa_handler == SIG_IGN) {
        if (info != NULL && info->si_code <= 0)
            return; /* an ignored kill(); a real fault cannot be ignored */
    } else if (prev.sa_handler != SIG_DFL) {
        tls_in_chain = 1;
        prev.sa_handler(sig);
        tls_in_chain = 0;
        return;
    }
    default_action(sig, info);
}

static int handler_is_ours(void)
{
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) != 0)
        return 0;
    return (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus;
}

/* Installs the handler unless it is already the current one; 1 if it was
 * installed now, 0 if it already was, -1 with errno on failure. */
static int install_handler(void)
{
    if (handler_is_ours())
        return 0;
    struct sigaction old, act;
    if (sigaction(SIGBUS, NULL, &old) != 0)
        return -1;
    prev_action = old;
    memset(&act, 0, sizeof act);
    act.sa_sigaction = on_sigbus;
    /* NODEFER: a handler we chain to may re-raise SIGBUS and expect it at once. */
    act.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&act.sa_mask);
    if (sigaction(SIGBUS, &act, NULL) != 0)
        return -1;
    return 1;
}

typedef struct {
    char *dst;
    const char *src;
    const uint64_t *dst_off;
    const uint64_t *src_off;
    const uint64_t *len;   /* NULL: every range has length uniform_len */
    uint64_t uniform_len;
    Py_ssize_t begin;
    Py_ssize_t end;
    int faulted;
    void *fault_addr;
} copy_job;

static inline uint64_t job_len(const copy_job *j, Py_ssize_t i)
{
    return j->len ? j->len[i] : j->uniform_len;
}

static void run_job(const copy_job *j)
{
    Py_ssize_t i = j->begin;
    while (i < j->end) {
        uint64_t d = j->dst_off[i], s = j->src_off[i], n = job_len(j, i);
        Py_ssize_t k = i + 1;
        while (k < j->end && j->dst_off[k] == d + n && j->src_off[k] == s + n) {
            n += job_len(j, k);
            k++;
        }
        memcpy(j->dst + d, j->src + s, (size_t)n);
        i = k;
    }
}

/* run_job under this thread's guard: a SIGBUS while it runs ends the job with
 * faulted set instead of killing the process. */
static void run_job_guarded(copy_job *j)
{
    fault_guard g;
    g.addr = NULL;
    j->faulted = 0;
    j->fault_addr = NULL;
    /* savemask=0 spares a syscall per copy: the handler runs with SA_NODEFER and an empty
     * sa_mask, so the mask it jumps out with is the one the copy had. */
    if (sigsetjmp(g.env, 0) != 0) {
        tls_guard = NULL;
        j->faulted = 1;
        j->fault_addr = g.addr;
        return;
    }
    tls_guard = &g;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    run_job(j);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    tls_guard = NULL;
}

static void *thread_main(void *arg)
{
    run_job_guarded((copy_job *)arg);
    return NULL;
}

/* Accepts a contiguous buffer of native uint64 values. */
static int get_u64_buffer(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    int ok = view->itemsize == 8 && (strcmp(f, "Q") == 0 || strcmp(f, "L") == 0 ||
                                     strcmp(f, "K") == 0 || strcmp(f, "k") == 0);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous uint64 buffer (got format '%s')",
                     what, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *MemoryFault;

/* Raise MemoryFault(message) with .address (int), .side ("dst", "src" or "")
 * and .offset (into that buffer). */
static void raise_fault(void *addr, const Py_buffer *dst, const Py_buffer *src)
{
    uintptr_t a = (uintptr_t)addr;
    const char *side = "";
    uintptr_t offset = 0;
    if (a >= (uintptr_t)dst->buf && a < (uintptr_t)dst->buf + (uintptr_t)dst->len) {
        side = "dst";
        offset = a - (uintptr_t)dst->buf;
    } else if (a >= (uintptr_t)src->buf && a < (uintptr_t)src->buf + (uintptr_t)src->len) {
        side = "src";
        offset = a - (uintptr_t)src->buf;
    }
    PyObject *msg = *side
        ? PyUnicode_FromFormat("memory fault (SIGBUS) at offset %zu of the %s buffer: "
                               "the mapping behind it was truncated or cannot be backed",
                               (size_t)offset, *side == 'd' ? "destination" : "source")
        : PyUnicode_FromString("memory fault (SIGBUS) outside both buffers");
    if (msg == NULL)
        return;
    PyObject *exc = PyObject_CallOneArg(MemoryFault, msg);
    Py_DECREF(msg);
    if (exc == NULL)
        return;
    PyObject *address = PyLong_FromUnsignedLongLong((unsigned long long)a);
    PyObject *off_obj = PyLong_FromUnsignedLongLong((unsigned long long)offset);
    PyObject *side_obj = PyUnicode_FromString(side);
    if (address && off_obj && side_obj && PyObject_SetAttrString(exc, "address", address) == 0 &&
        PyObject_SetAttrString(exc, "offset", off_obj) == 0 &&
        PyObject_SetAttrString(exc, "side", side_obj) == 0)
        PyErr_SetObject(MemoryFault, exc);
    Py_XDECREF(address);
    Py_XDECREF(off_obj);
    Py_XDECREF(side_obj);
    Py_DECREF(exc);
}

static PyObject *kv_copy(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *dst_obj, *src_obj, *dst_off_obj, *src_off_obj, *len_obj;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOOOO|i:copy", &dst_obj, &src_obj, &dst_off_obj, &src_off_obj,
                          &len_obj, &threads))
        return NULL;

    Py_buffer dst = {0}, src = {0}, doff = {0}, soff = {0}, lens = {0};
    int have_lens = 0;
    uint64_t uniform_len = 0;
    PyObject *result = NULL;

    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (get_u64_buffer(dst_off_obj, &doff, "dst_offsets") < 0)
        goto done;
    if (get_u64_buffer(src_off_obj, &soff, "src_offsets") < 0)
        goto done;
    if (PyLong_Check(len_obj)) {
        uniform_len = PyLong_AsUnsignedLongLong(len_obj);
        if (PyErr_Occurred())
            goto done;
    } else {
        if (get_u64_buffer(len_obj, &lens, "lengths") < 0)
            goto done;
        have_lens = 1;
    }

    Py_ssize_t n = doff.len / 8;
    if (soff.len / 8 != n || (have_lens && lens.len / 8 != n)) {
        PyErr_SetString(PyExc_ValueError, "offset and length arrays differ in size");
        goto done;
    }
    const uint64_t *dp = doff.buf, *sp = soff.buf, *lp = have_lens ? lens.buf : NULL;
    uint64_t dst_size = (uint64_t)dst.len, src_size = (uint64_t)src.len, total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t l = lp ? lp[i] : uniform_len;
        if (dp[i] > dst_size || l > dst_size - dp[i]) {
            PyErr_Format(PyExc_ValueError, "range %zd [%llu, +%llu) exceeds destination of %llu bytes",
                         i, (unsigned long long)dp[i], (unsigned long long)l,
                         (unsigned long long)dst_size);
            goto done;
        }
        if (sp[i] > src_size || l > src_size - sp[i]) {
            PyErr_Format(PyExc_ValueError, "range %zd [%llu, +%llu) exceeds source of %llu bytes",
                         i, (unsigned long long)sp[i], (unsigned long long)l,
                         (unsigned long long)src_size);
            goto done;
        }
        total += l;
    }

    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if ((Py_ssize_t)threads > n)
        threads = n > 0 ? (int)n : 1;

    copy_job jobs[MAX_THREADS];
    int njobs = 0;
    {
        /* Split by bytes so that each thread moves about total / threads. */
        uint64_t share = total / (uint64_t)threads + 1, acc = 0;
        Py_ssize_t begin = 0;
        for (Py_ssize_t i = 0; i < n && njobs < threads - 1; i++) {
            acc += lp ? lp[i] : uniform_len;
            if (acc >= share) {
                jobs[njobs++] = (copy_job){dst.buf, src.buf, dp, sp, lp, uniform_len, begin, i + 1, 0, NULL};
                begin = i + 1;
                acc = 0;
            }
        }
        jobs[njobs++] = (copy_job){dst.buf, src.buf, dp, sp, lp, uniform_len, begin, n, 0, NULL};
    }

    Py_BEGIN_ALLOW_THREADS
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < njobs; t++)
        started[t] = pthread_create(&tids[t], NULL, thread_main, &jobs[t]) == 0;
    run_job_guarded(&jobs[0]);
    for (int t = 1; t < njobs; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else {
            /* No thread to be had: do its share here rather than skip it. */
            run_job_guarded(&jobs[t]);
        }
    }
    Py_END_ALLOW_THREADS

    for (int t = 0; t < njobs; t++) {
        if (jobs[t].faulted) {
            raise_fault(jobs[t].fault_addr, &dst, &src);
            goto done;
        }
    }
    result = PyLong_FromUnsignedLongLong(total);

done:
    if (dst.obj)
        PyBuffer_Release(&dst);
    if (src.obj)
        PyBuffer_Release(&src);
    if (doff.obj)
        PyBuffer_Release(&doff);
    if (soff.obj)
        PyBuffer_Release(&soff);
    if (lens.obj)
        PyBuffer_Release(&lens);
    return result;
}

static PyObject *kv_install_fault_handler(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    int r = install_handler();
    if (r < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong(r);
}

static PyObject *kv_fault_handler_installed(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(handler_is_ours());
}

static PyMethodDef methods[] = {
    {"copy", kv_copy, METH_VARARGS,
     "copy(dst, src, dst_offsets, src_offsets, lengths, threads=1) -> bytes copied\n\n"
     "Copies lengths[i] bytes from src[src_offsets[i]:] to dst[dst_offsets[i]:] for every i.\n"
     "Offsets are uint64 buffers; lengths is a uint64 buffer or one int for all ranges.\n"
     "Every range is bounds-checked first; the copy runs without the GIL.\n"
     "A SIGBUS while copying (a mapping truncated under the copy) raises MemoryFault\n"
     "with .address, .side ('dst', 'src' or '') and .offset; the destination is then undefined."},
    {"install_fault_handler", kv_install_fault_handler, METH_NOARGS,
     "install_fault_handler() -> bool\n\n"
     "Make the guarded-copy SIGBUS handler the current one (True if it was not), chaining to\n"
     "the handler it replaces. Done at import; call again after anything else installs one."},
    {"fault_handler_installed", kv_fault_handler_installed, METH_NOARGS,
     "fault_handler_installed() -> bool: whether the current SIGBUS handler is this module's."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_copy", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__copy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    MemoryFault = PyErr_NewExceptionWithDoc(
        "kvtier.kernels._copy.MemoryFault",
        "A copy touched memory that is gone (SIGBUS): a shared mapping was truncated under it.",
        PyExc_Exception, NULL);
    if (MemoryFault == NULL || PyModule_AddObjectRef(m, "MemoryFault", MemoryFault) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (install_handler() < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

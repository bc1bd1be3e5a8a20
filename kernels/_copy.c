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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 64

typedef struct {
    char *dst;
    const char *src;
    const uint64_t *dst_off;
    const uint64_t *src_off;
    const uint64_t *len;   /* NULL: every range has length uniform_len */
    uint64_t uniform_len;
    Py_ssize_t begin;
    Py_ssize_t end;
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

static void *thread_main(void *arg)
{
    run_job((const copy_job *)arg);
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
                jobs[njobs++] = (copy_job){dst.buf, src.buf, dp, sp, lp, uniform_len, begin, i + 1};
                begin = i + 1;
                acc = 0;
            }
        }
        jobs[njobs++] = (copy_job){dst.buf, src.buf, dp, sp, lp, uniform_len, begin, n};
    }

    Py_BEGIN_ALLOW_THREADS
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < njobs; t++)
        started[t] = pthread_create(&tids[t], NULL, thread_main, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < njobs; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else {
            /* No thread to be had: do its share here rather than skip it. */
            run_job(&jobs[t]);
        }
    }
    Py_END_ALLOW_THREADS

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

static PyMethodDef methods[] = {
    {"copy", kv_copy, METH_VARARGS,
     "copy(dst, src, dst_offsets, src_offsets, lengths, threads=1) -> bytes copied\n\n"
     "Copies lengths[i] bytes from src[src_offsets[i]:] to dst[dst_offsets[i]:] for every i.\n"
     "Offsets are uint64 buffers; lengths is a uint64 buffer or one int for all ranges.\n"
     "Every range is bounds-checked first; the copy runs without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy(void)
{
    return PyModule_Create(&module);
}

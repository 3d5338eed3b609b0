/* The number scan of meshplan.plan.json.skeleton in one pass over the text: what its numpy path does in ~10 passes
 * (a byte table lookup, the digits' edges, the string digits put back, the numbers cut out, each number parsed
 * eight digits at a time), 5x faster on this project's hosts (docs/speed.md). Optional: where it is not built (no C
 * compiler at install), the reader scans with numpy, with the same results (tests/plan/test_skeleton.py compares
 * the two on every method's files and on fuzzed text).
 *
 * scan(text, allowed, wordish, values, lengths, zeros) -> (skeleton, count) or None
 *   text     bytes-like, the text to scan
 *   allowed  256 bytes, nonzero where a byte may occur outside a run of digits
 *   wordish  256 bytes, nonzero where a run of digits right after that byte is part of a string, not a number
 *   values   writable, room for (len(text) + 1) // 2 uint64 (native order): each number's value, in text order
 *   lengths  writable, as many bytes: each number's digit count
 *   zeros    writable, as many bytes: 1 where a number's first digit is 0
 * skeleton: the text with each number's digits replaced by one '#' (a string's digits kept); count: the numbers.
 * None: a byte outside `allowed` (not a digit), or a number of more than 19 digits (beyond uint64's exact range).
 * Raises ValueError where a table is not 256 bytes or an output has no room. The GIL is released while scanning.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_DIGITS 19

static int is_digit(uint8_t c) { return (uint8_t)(c - '0') < 10; }

/* 0: done; 1: a byte not allowed; 2: a number too long */
static int scan_text(const uint8_t *t, Py_ssize_t n, const uint8_t *allowed, const uint8_t *wordish, uint8_t *skel,
                     Py_ssize_t *skel_len, uint8_t *values, uint8_t *lengths, uint8_t *zeros, Py_ssize_t *count)
{
    Py_ssize_t i = 0, o = 0, k = 0;
    uint8_t prev = 0;                               /* the byte before a run: none at the start (not a string's) */
    while (i < n) {
        uint8_t c = t[i];
        if (!is_digit(c)) {
            if (!allowed[c])
                return 1;
            skel[o++] = c;
            prev = c;
            i++;
            continue;
        }
        Py_ssize_t start = i;
        uint64_t v = 0;
        while (i < n && is_digit(t[i]) && i - start < MAX_DIGITS) {
            v = v * 10 + (uint64_t)(t[i] - '0');
            i++;
        }
        while (i < n && is_digit(t[i]))              /* past 19 digits: a string's run may go on, a number may not */
            i++;
        Py_ssize_t len = i - start;
        if (wordish[prev]) {                         /* a string's digits ("bf16"): kept as they are */
            memcpy(skel + o, t + start, (size_t)len);
            o += len;
        } else {
            if (len > MAX_DIGITS)
                return 2;
            memcpy(values + 8 * k, &v, 8);
            lengths[k] = (uint8_t)len;
            zeros[k] = t[start] == '0';
            k++;
            skel[o++] = '#';
        }
        prev = t[i - 1];
    }
    *skel_len = o;
    *count = k;
    return 0;
}

static PyObject *scan(PyObject *self, PyObject *args)
{
    Py_buffer text, allowed, wordish, values, lengths, zeros;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*w*", &text, &allowed, &wordish, &values, &lengths, &zeros))
        return NULL;
    PyObject *result = NULL, *skel = NULL;
    Py_ssize_t n = text.len, room = (n + 1) / 2, skel_len = 0, count = 0;
    if (allowed.len != 256 || wordish.len != 256) {
        PyErr_SetString(PyExc_ValueError, "allowed and wordish must be 256 bytes each");
        goto done;
    }
    if (values.len < 8 * room || lengths.len < room || zeros.len < room) {
        PyErr_SetString(PyExc_ValueError, "values, lengths and zeros need room for (len(text) + 1) // 2 numbers");
        goto done;
    }
    skel = PyBytes_FromStringAndSize(NULL, n);
    if (skel == NULL)
        goto done;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = scan_text((const uint8_t *)text.buf, n, (const uint8_t *)allowed.buf, (const uint8_t *)wordish.buf,
                       (uint8_t *)PyBytes_AS_STRING(skel), &skel_len, (uint8_t *)values.buf,
                       (uint8_t *)lengths.buf, (uint8_t *)zeros.buf, &count);
    Py_END_ALLOW_THREADS
    if (status != 0) {
        Py_CLEAR(skel);
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (_PyBytes_Resize(&skel, skel_len) < 0)        /* frees skel on failure */
        goto done;
    result = Py_BuildValue("(Nn)", skel, count);
    skel = NULL;
done:
    Py_XDECREF(skel);
    PyBuffer_Release(&text);
    PyBuffer_Release(&allowed);
    PyBuffer_Release(&wordish);
    PyBuffer_Release(&values);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&zeros);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "scan(text, allowed, wordish, values, lengths, zeros) -> (skeleton, count) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan", "The number scan of skeleton.py, compiled.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&module); }

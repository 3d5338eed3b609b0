/* The JSON text's two hot loops in C: the reader's number scan (meshplan.plan.json.number_scan) and the writer's
 * stores of literals and integers at given offsets (meshplan.plan.json.text_rows). Each does in one pass what numpy
 * does in many (the scan: a byte table lookup, the digits' edges, the string digits put back, the numbers cut out,
 * each parsed eight digits at a time; the stores: a word store per 8 bytes, a division per two digits): 5x faster
 * on this project's hosts (docs/speed.md). Optional: where this is not built (no C compiler at install), numpy does
 * the same, with the same results (tests/plan/test_compiled_text.py compares the two, on every method's files and
 * on fuzzed input). Every offset is checked against its buffer before anything is written. The GIL is released
 * while a loop runs.
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
 *
 * put_literal(out, pos, literal): out[p:p + len(literal)] = literal for each p of pos (int64, native order).
 * put_ints(out, pos, size, values): the decimal digits of values[i] (int64 >= 0), size[i] of them (int64, 1..19),
 *   at out[pos[i]:pos[i] + size[i]] (a value of fewer digits is led by zeros, of more is cut to its last ones).
 * Both raise ValueError where an offset, a size or a value is out of range, writing nothing.
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

/* the int64 array of a buffer (its length in *n), or NULL with ValueError set */
static const int64_t *int64s(Py_buffer *b, Py_ssize_t *n, const char *name)
{
    if (b->len % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "%s must hold int64 values", name);
        return NULL;
    }
    *n = b->len / 8;
    return (const int64_t *)b->buf;
}

/* the literal l (len bytes, w <= len <= 2w) at each of the n offsets p of o, as two w-byte stores, the second
 * overlapping the first: a constant w makes each a single move once inlined, not a call of memcpy */
static inline void put_two_words(uint8_t *o, const int64_t *p, Py_ssize_t n, const uint8_t *l, Py_ssize_t len,
                                 size_t w)
{
    uint8_t first[8], last[8];
    memcpy(first, l, w);
    memcpy(last, l + len - w, w);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(o + p[i], first, w);
        memcpy(o + p[i] + len - w, last, w);
    }
}

static PyObject *put_literal(PyObject *self, PyObject *args)
{
    Py_buffer out, pos, lit;
    if (!PyArg_ParseTuple(args, "w*y*y*", &out, &pos, &lit))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = 0, len = lit.len;
    const int64_t *p = int64s(&pos, &n, "pos");
    if (p == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (p[i] < 0 || p[i] > (int64_t)(out.len - len)) {
            PyErr_SetString(PyExc_ValueError, "put_literal: an offset out of the buffer");
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
    uint8_t *o = (uint8_t *)out.buf;
    const uint8_t *l = (const uint8_t *)lit.buf;
    if (len >= 8 && len <= 16)
        put_two_words(o, p, n, l, len, 8);
    else if (len >= 4 && len < 8)
        put_two_words(o, p, n, l, len, 4);
    else
        for (Py_ssize_t i = 0; i < n; i++)
            memcpy(o + p[i], l, (size_t)len);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&lit);
    return result;
}

static PyObject *put_ints(PyObject *self, PyObject *args)
{
    Py_buffer out, pos, size, values;
    if (!PyArg_ParseTuple(args, "w*y*y*y*", &out, &pos, &size, &values))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = 0, n_size = 0, n_values = 0;
    const int64_t *p = int64s(&pos, &n, "pos"), *s = p ? int64s(&size, &n_size, "size") : NULL,
                  *v = s ? int64s(&values, &n_values, "values") : NULL;
    if (v == NULL)
        goto done;
    if (n_size != n || n_values != n) {
        PyErr_SetString(PyExc_ValueError, "put_ints: pos, size and values differ in length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (s[i] < 1 || s[i] > MAX_DIGITS || v[i] < 0 || p[i] < 0 || p[i] > (int64_t)out.len - s[i]) {
            PyErr_SetString(PyExc_ValueError, "put_ints: an offset, size or value out of range");
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
    uint8_t *o = (uint8_t *)out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t x = (uint64_t)v[i];
        for (int64_t j = p[i] + s[i] - 1; j >= p[i]; j--) {
            o[j] = (uint8_t)('0' + x % 10);
            x /= 10;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&size);
    PyBuffer_Release(&values);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "scan(text, allowed, wordish, values, lengths, zeros) -> (skeleton, count) or None"},
    {"put_literal", put_literal, METH_VARARGS, "put_literal(out, pos, literal): the literal at each offset"},
    {"put_ints", put_ints, METH_VARARGS, "put_ints(out, pos, size, values): each value's digits at its offset"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_text", "The JSON text's hot loops, compiled.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__text(void) { return PyModule_Create(&module); }

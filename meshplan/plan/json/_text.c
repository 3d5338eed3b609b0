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
 * Both raise ValueError where an offset, a size or a value is out of range, writing nothing. Each offset is read
 * once into a local and checked again where it is used, so arrays that overlap `out` (or that another thread
 * changes while the GIL is released) cannot make a store leave the buffer: the call then stops with ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_DIGITS 19

static int is_digit(uint8_t c) { return (uint8_t)(c - '0') < 10; }

/* 0: done; 1: a byte not allowed; 2: a number too long; 3: more numbers than `room` (only where the text changed
 * while it was read). Each byte of t is read once and written to skel as it is (a number's digits then replaced by
 * one '#'), so o <= i <= n; a run's digits are taken from what was read, not read again. */
static int scan_text(const uint8_t *t, Py_ssize_t n, const uint8_t *allowed, const uint8_t *wordish, uint8_t *skel,
                     Py_ssize_t *skel_len, uint8_t *values, uint8_t *lengths, uint8_t *zeros, Py_ssize_t room,
                     Py_ssize_t *count)
{
    Py_ssize_t i = 0, o = 0, k = 0;
    uint8_t c = 0;
    int held = 0;                                   /* c holds the byte after a run, read but not yet handled */
    while (held || i < n) {
        if (!held)
            c = t[i++];
        held = 0;
        if (!is_digit(c)) {
            if (!allowed[c])
                return 1;
            skel[o++] = c;
            continue;
        }
        /* a run of digits from c; the byte before it (a non-digit, copied as it was; none at the start) says
         * whether it is a string's ("bf16": kept as it is) or a number */
        Py_ssize_t start = o, len = 0;
        uint8_t before = start > 0 ? skel[start - 1] : 0, first = c;
        uint64_t v = 0;
        for (;;) {
            if (len < MAX_DIGITS)                    /* past 19: a string's run may go on, a number may not */
                v = v * 10 + (uint64_t)(c - '0');
            skel[o++] = c;
            len++;
            if (i >= n)
                break;
            c = t[i++];
            if (!is_digit(c)) {
                held = 1;
                break;
            }
        }
        if (wordish[before])
            continue;
        if (len > MAX_DIGITS)
            return 2;
        if (k >= room)
            return 3;
        memcpy(values + 8 * k, &v, 8);
        lengths[k] = (uint8_t)len;
        zeros[k] = first == '0';
        k++;
        o = start;
        skel[o++] = '#';
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
    if (values.len / 8 < room || lengths.len < room || zeros.len < room) {
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
                       (uint8_t *)lengths.buf, (uint8_t *)zeros.buf, room, &count);
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

/* the int64 values of a buffer (their count in *n; read with load64: any alignment), or NULL with ValueError set */
static const uint8_t *int64s(Py_buffer *b, Py_ssize_t *n, const char *name)
{
    if (b->len % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "%s must hold int64 values", name);
        return NULL;
    }
    *n = b->len / 8;
    return (const uint8_t *)b->buf;
}

static int64_t load64(const uint8_t *a, Py_ssize_t i)
{
    int64_t x;
    memcpy(&x, a + 8 * i, 8);
    return x;
}

/* whether a store of len bytes at offset at stays within a buffer of size bytes */
static int fits(int64_t at, int64_t len, Py_ssize_t size) { return at >= 0 && len <= size && at <= size - len; }

/* the literal l (len bytes) at each of the n offsets p of o; 0, or -1 where an offset is out of the buffer (its
 * store and the later ones not made). Each offset is loaded once, checked, then used. A literal of w..2w bytes
 * (w 4 or 8: a constant once inlined, a single move each) is two w-byte stores, the second overlapping the first. */
static inline int put_each(uint8_t *o, Py_ssize_t size, const uint8_t *p, Py_ssize_t n, const uint8_t *l,
                           Py_ssize_t len, size_t w)
{
    uint8_t first[8], last[8];
    if (w) {
        memcpy(first, l, w);
        memcpy(last, l + len - w, w);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t at = load64(p, i);
        if (!fits(at, len, size))
            return -1;
        if (w) {
            memcpy(o + at, first, w);
            memcpy(o + at + len - w, last, w);
        } else {
            memmove(o + at, l, (size_t)len);         /* a literal may be a view of out itself */
        }
    }
    return 0;
}

static PyObject *put_literal(PyObject *self, PyObject *args)
{
    Py_buffer out, pos, lit;
    if (!PyArg_ParseTuple(args, "w*y*y*", &out, &pos, &lit))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = 0, len = lit.len;
    const uint8_t *p = int64s(&pos, &n, "pos");
    if (p == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)              /* every offset before any store: nothing written on error */
        if (!fits(load64(p, i), len, out.len)) {
            PyErr_SetString(PyExc_ValueError, "put_literal: an offset out of the buffer");
            goto done;
        }
    int status;
    Py_BEGIN_ALLOW_THREADS
    uint8_t *o = (uint8_t *)out.buf;
    const uint8_t *l = (const uint8_t *)lit.buf;
    if (len >= 8 && len <= 16)
        status = put_each(o, out.len, p, n, l, len, 8);
    else if (len >= 4 && len < 8)
        status = put_each(o, out.len, p, n, l, len, 4);
    else
        status = put_each(o, out.len, p, n, l, len, 0);
    Py_END_ALLOW_THREADS
    if (status != 0) {                               /* an offset changed by a store (pos overlapping out) */
        PyErr_SetString(PyExc_ValueError, "put_literal: an offset out of the buffer");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&lit);
    return result;
}

/* whether value x (int64 >= 0) of len digits (1..19) at offset at stays within a buffer of size bytes */
static int int_fits(int64_t at, int64_t len, int64_t x, Py_ssize_t size)
{
    return len >= 1 && len <= MAX_DIGITS && x >= 0 && fits(at, len, size);
}

static PyObject *put_ints(PyObject *self, PyObject *args)
{
    Py_buffer out, pos, size, values;
    if (!PyArg_ParseTuple(args, "w*y*y*y*", &out, &pos, &size, &values))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = 0, n_size = 0, n_values = 0;
    const uint8_t *p = int64s(&pos, &n, "pos"), *s = p ? int64s(&size, &n_size, "size") : NULL,
                  *v = s ? int64s(&values, &n_values, "values") : NULL;
    if (v == NULL)
        goto done;
    if (n_size != n || n_values != n) {
        PyErr_SetString(PyExc_ValueError, "put_ints: pos, size and values differ in length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)              /* every store before any: nothing written on error */
        if (!int_fits(load64(p, i), load64(s, i), load64(v, i), out.len)) {
            PyErr_SetString(PyExc_ValueError, "put_ints: an offset, size or value out of range");
            goto done;
        }
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    uint8_t *o = (uint8_t *)out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t at = load64(p, i), len = load64(s, i), x = load64(v, i);    /* each loaded once, checked, used */
        if (!int_fits(at, len, x, out.len)) {
            status = -1;
            break;
        }
        uint64_t rest = (uint64_t)x;
        for (int64_t j = at + len - 1; j >= at; j--) {
            o[j] = (uint8_t)('0' + rest % 10);
            rest /= 10;
        }
    }
    Py_END_ALLOW_THREADS
    if (status != 0) {                               /* changed by a store (an array overlapping out) */
        PyErr_SetString(PyExc_ValueError, "put_ints: an offset, size or value out of range");
        goto done;
    }
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

/* A worker order in C: sluice.dispatcher.orders.PureOrder, the reference, with the same
 * answers. tests/test_orders.py drives both with the same random operations and compares
 * them. Read the reference first; this file says only how it keeps the same order.
 *
 * - The pairs sit in two arrays (the values as doubles, the worker ids as references), so
 *   that a binary search reads contiguous doubles: a Python list of (value, id) tuples costs
 *   three pointer chases per comparison, which on a dispatcher's large heap are cache misses
 *   (docs/BENCHMARKS.md, twenty-third pass).
 * - Pairs compare as Python compares the tuples: by value, then (on equal values, -0.0 equal
 *   to 0.0) by worker id, as str compares. Ids must be exactly str (no comparison can fail
 *   or run Python code, and an id cannot refer back to its order: the type is not tracked
 *   by the garbage collector) and values not NaN (no order holds with it); ints are read as
 *   doubles (exact below 2**53).
 * - A pair read out takes its id's reference before anything is allocated: an allocation may
 *   run a garbage collection, whose callbacks may change the order.
 * - A move shifts only the pairs between the old place and the new one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

typedef struct {
    PyObject_HEAD
    double *val;
    PyObject **id;
    Py_ssize_t n, cap;
} Order;

typedef struct {
    PyObject_HEAD
    Order *order;
    Py_ssize_t i;
} OrderIter;

static PyTypeObject OrderType;
static PyTypeObject OrderIterType;

static int cmp(double v1, PyObject *w1, double v2, PyObject *w2) {
    if (v1 < v2)
        return -1;
    if (v1 > v2)
        return 1;
    if (w1 == w2)
        return 0;
    return PyUnicode_Compare(w1, w2); /* both str: cannot fail */
}

/* The first place whose pair is not less than (v, w). */
static Py_ssize_t lower(const Order *o, double v, PyObject *w) {
    Py_ssize_t lo = 0, hi = o->n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (cmp(o->val[mid], o->id[mid], v, w) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int read_number(PyObject *value, double *v) {
    if (!PyFloat_Check(value) && !PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "an order's value must be a float or an int, not %.80s",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    *v = PyFloat_CheckExact(value) ? PyFloat_AS_DOUBLE(value) : PyFloat_AsDouble(value);
    return (*v == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

static int read_pair(PyObject *value, PyObject *worker, double *v) {
    if (!PyUnicode_CheckExact(worker)) {
        PyErr_Format(PyExc_TypeError, "a worker id must be a str, not %.80s",
                     Py_TYPE(worker)->tp_name);
        return -1;
    }
    if (read_number(value, v) < 0)
        return -1;
    if (isnan(*v)) {
        PyErr_SetString(PyExc_ValueError, "an order's value must not be NaN");
        return -1;
    }
    return 0;
}

static int read_query(PyObject *value, double *v) {
    if (read_number(value, v) < 0)
        return -1;
    if (isnan(*v)) {
        PyErr_SetString(PyExc_ValueError, "an order is not counted against NaN");
        return -1;
    }
    return 0;
}

/* The place of (v, w), which must be in the order. */
static Py_ssize_t place_of(const Order *o, double v, PyObject *w) {
    Py_ssize_t i = lower(o, v, w);
    if (i >= o->n || cmp(o->val[i], o->id[i], v, w) != 0) {
        PyObject *f = PyFloat_FromDouble(v);
        if (f != NULL) {
            PyErr_Format(PyExc_ValueError, "(%R, %R) is not in the order", f, w);
            Py_DECREF(f);
        }
        return -1;
    }
    return i;
}

static int reserve_one(Order *o) {
    if (o->n < o->cap)
        return 0;
    Py_ssize_t cap = o->cap ? 2 * o->cap : 8;
    double *val = PyMem_Realloc(o->val, (size_t)cap * sizeof(double));
    if (val == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->val = val;
    PyObject **id = PyMem_Realloc(o->id, (size_t)cap * sizeof(PyObject *));
    if (id == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->id = id;
    o->cap = cap;
    return 0;
}

static PyObject *Order_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Order() takes no arguments");
        return NULL;
    }
    Order *o = (Order *)type->tp_alloc(type, 0);
    if (o != NULL) {
        o->val = NULL;
        o->id = NULL;
        o->n = o->cap = 0;
    }
    return (PyObject *)o;
}

static void Order_dealloc(Order *o) {
    for (Py_ssize_t i = 0; i < o->n; i++)
        Py_DECREF(o->id[i]);
    PyMem_Free(o->val);
    PyMem_Free(o->id);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

/* A (value, worker_id) call's arguments, read and checked. */
static int pair_args(PyObject *const *args, Py_ssize_t nargs, const char *usage, double *v) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    return read_pair(args[0], args[1], v);
}

static PyObject *Order_add(Order *o, PyObject *const *args, Py_ssize_t nargs) {
    double v;
    if (pair_args(args, nargs, "add(value, worker_id)", &v) < 0)
        return NULL;
    Py_ssize_t i = lower(o, v, args[1]);
    if (i < o->n && cmp(o->val[i], o->id[i], v, args[1]) == 0) {
        PyErr_Format(PyExc_ValueError, "(%R, %R) is in the order already", args[0], args[1]);
        return NULL;
    }
    if (reserve_one(o) < 0)
        return NULL;
    memmove(&o->val[i + 1], &o->val[i], (size_t)(o->n - i) * sizeof(double));
    memmove(&o->id[i + 1], &o->id[i], (size_t)(o->n - i) * sizeof(PyObject *));
    o->val[i] = v;
    Py_INCREF(args[1]);
    o->id[i] = args[1];
    o->n++;
    Py_RETURN_NONE;
}

static PyObject *Order_remove(Order *o, PyObject *const *args, Py_ssize_t nargs) {
    double v;
    if (pair_args(args, nargs, "remove(value, worker_id)", &v) < 0)
        return NULL;
    Py_ssize_t i = place_of(o, v, args[1]);
    if (i < 0)
        return NULL;
    PyObject *gone = o->id[i];
    memmove(&o->val[i], &o->val[i + 1], (size_t)(o->n - i - 1) * sizeof(double));
    memmove(&o->id[i], &o->id[i + 1], (size_t)(o->n - i - 1) * sizeof(PyObject *));
    o->n--;
    Py_DECREF(gone);
    Py_RETURN_NONE;
}

static PyObject *Order_move(Order *o, PyObject *const *args, Py_ssize_t nargs) {
    double old, v;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "move(old_value, new_value, worker_id)");
        return NULL;
    }
    if (read_pair(args[0], args[2], &old) < 0 || read_pair(args[1], args[2], &v) < 0)
        return NULL;
    Py_ssize_t i = place_of(o, old, args[2]);
    if (i < 0)
        return NULL;
    PyObject *w = args[2], *was = o->id[i];
    /* Where (v, w) goes among the others: the pair at i is still there, and sorts before
     * it exactly when the value grows. */
    Py_ssize_t j = lower(o, v, w);
    if (j != i && j < o->n && cmp(o->val[j], o->id[j], v, w) == 0) {
        PyErr_Format(PyExc_ValueError, "(%R, %R) is in the order already", args[1], w);
        return NULL;
    }
    if (j > i) {
        j--; /* the pairs i+1..j move one place down */
        memmove(&o->val[i], &o->val[i + 1], (size_t)(j - i) * sizeof(double));
        memmove(&o->id[i], &o->id[i + 1], (size_t)(j - i) * sizeof(PyObject *));
    } else if (j < i) { /* the pairs j..i-1 move one place up */
        memmove(&o->val[j + 1], &o->val[j], (size_t)(i - j) * sizeof(double));
        memmove(&o->id[j + 1], &o->id[j], (size_t)(i - j) * sizeof(PyObject *));
    }
    o->val[j] = v;
    Py_INCREF(w); /* the pair is (new value, the id given), as the reference's */
    o->id[j] = w;
    Py_DECREF(was);
    Py_RETURN_NONE;
}

/* How many pairs come first with a value under ``value`` (or at most it, if ``inclusive``). */
static PyObject *count_first(Order *o, PyObject *value, int inclusive) {
    double v;
    if (read_query(value, &v) < 0)
        return NULL;
    Py_ssize_t lo = 0, hi = o->n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (o->val[mid] < v || (inclusive && o->val[mid] == v))
            lo = mid + 1;
        else
            hi = mid;
    }
    return PyLong_FromSsize_t(lo);
}

static PyObject *Order_count_below(Order *o, PyObject *value) { return count_first(o, value, 0); }

static PyObject *Order_count_at_most(Order *o, PyObject *value) { return count_first(o, value, 1); }

static PyObject *pair(const Order *o, Py_ssize_t i) {
    PyObject *w = o->id[i];
    double value = o->val[i];
    Py_INCREF(w); /* before any allocation (the header says why) */
    PyObject *v = PyFloat_FromDouble(value);
    PyObject *t = v == NULL ? NULL : PyTuple_New(2);
    if (t == NULL) {
        Py_XDECREF(v);
        Py_DECREF(w);
        return NULL;
    }
    PyTuple_SET_ITEM(t, 0, v);
    PyTuple_SET_ITEM(t, 1, w);
    return t;
}

static Py_ssize_t Order_len(Order *o) { return o->n; }

static PyObject *Order_item(Order *o, Py_ssize_t i) {
    if (i < 0 || i >= o->n) {
        PyErr_SetString(PyExc_IndexError, "order index out of range");
        return NULL;
    }
    return pair(o, i);
}

static PyObject *iter_at(Order *o, Py_ssize_t start) {
    OrderIter *it = PyObject_New(OrderIter, &OrderIterType);
    if (it == NULL)
        return NULL;
    Py_INCREF(o);
    it->order = o;
    it->i = start < 0 ? 0 : start;
    return (PyObject *)it;
}

static PyObject *Order_iter(Order *o) { return iter_at(o, 0); }

static PyObject *Order_iter_from(Order *o, PyObject *start) {
    Py_ssize_t s = PyNumber_AsSsize_t(start, NULL); /* an int, clamped to Py_ssize_t */
    if (s == -1 && PyErr_Occurred())
        return NULL;
    return iter_at(o, s);
}

static PyObject *Order_repr(Order *o) { return PyUnicode_FromFormat("<Order of %zd>", o->n); }

static void OrderIter_dealloc(OrderIter *it) {
    Py_XDECREF(it->order);
    PyObject_Free(it);
}

static PyObject *OrderIter_next(OrderIter *it) {
    Order *o = it->order;
    if (o == NULL)
        return NULL;
    if (it->i >= o->n) { /* (a pair removed meanwhile ends it early, as a list's iterator does) */
        it->order = NULL; /* exhausted for good, as a list's iterator is */
        Py_DECREF(o);
        return NULL;
    }
    return pair(o, it->i++);
}

static PyMethodDef Order_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Order_add, METH_FASTCALL,
     "add(value, worker_id): put the pair in its place (ValueError if it is there already)."},
    {"remove", (PyCFunction)(void (*)(void))Order_remove, METH_FASTCALL,
     "remove(value, worker_id): take the pair out (ValueError if it is not there)."},
    {"move", (PyCFunction)(void (*)(void))Order_move, METH_FASTCALL,
     "move(old_value, new_value, worker_id): the worker's pair, from its old value to its new."},
    {"count_below", (PyCFunction)Order_count_below, METH_O,
     "count_below(value): how many pairs have a value under it (they come first)."},
    {"count_at_most", (PyCFunction)Order_count_at_most, METH_O,
     "count_at_most(value): how many pairs have a value at most it (they come first)."},
    {"iter_from", (PyCFunction)Order_iter_from, METH_O,
     "iter_from(start): the pairs from place start on."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Order_as_sequence = {
    .sq_length = (lenfunc)Order_len,
    .sq_item = (ssizeargfunc)Order_item,
};

static PyTypeObject OrderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sluice.dispatcher._orders.Order",
    .tp_basicsize = sizeof(Order),
    .tp_dealloc = (destructor)Order_dealloc,
    .tp_repr = (reprfunc)Order_repr,
    .tp_as_sequence = &Order_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "(value, worker id) pairs in ascending order: PureOrder in C.",
    .tp_iter = (getiterfunc)Order_iter,
    .tp_methods = Order_methods,
    .tp_new = Order_new,
};

static PyTypeObject OrderIterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sluice.dispatcher._orders.OrderIterator",
    .tp_basicsize = sizeof(OrderIter),
    .tp_dealloc = (destructor)OrderIter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)OrderIter_next,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_orders", "A worker order in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit__orders(void) {
    if (PyType_Ready(&OrderType) < 0 || PyType_Ready(&OrderIterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&OrderType);
    if (PyModule_AddObject(m, "Order", (PyObject *)&OrderType) < 0) {
        Py_DECREF(&OrderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

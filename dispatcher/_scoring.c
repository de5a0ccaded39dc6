/* Scoring a decision's candidates in C: sluice.dispatcher.scoring.score_into_pure, the
 * reference, line for line (and group_keys and held_at_least: group_keys_pure and
 * held_at_least_pure, the loops a decision runs over every holder of its prefix). tests/test_scoring.py drives both with the same random
 * candidates and compares what they keep. Read the reference first; this file says only how
 * the same arithmetic is kept the same.
 *
 * - Every float expression is evaluated in the reference's order, in doubles, and built
 *   with -ffp-contract=off (pyproject.toml), so that no multiply-add is fused: the scores
 *   are the same bits, and so are the decisions.
 * - Ints the reference adds to floats are read as doubles (exact below 2**53); the hit and
 *   the uncached tokens are integer arithmetic, as there.
 * - A candidate that could tie or win a minimum is handed to the Python keep(), which owns
 *   the minimums (tuples compared as Python compares them). The rounded queue is computed
 *   with Python's round() only where the reference's filter or keep() reads it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_best, *s_sticky, *s_expand, *s_prefill, *s_decode, *round_fn, *two, *zero;

/* Candidate's fields (a NamedTuple: sluice.dispatcher.routing.Candidate). */
enum { C_WORKER = 0, C_CAPACITY = 1, C_BOOKED = 2, C_REPORTED_PREFILL = 5, C_UNREPORTED = 6,
       C_AGE = 7, C_JOINED = 8, C_FIELDS = 9 };

static int as_double(PyObject *o, double *out) {
    *out = PyFloat_CheckExact(o) ? PyFloat_AS_DOUBLE(o) : PyFloat_AsDouble(o);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

static int as_ll(PyObject *o, long long *out) {
    *out = PyLong_AsLongLong(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* A minimum's first item (a float), or NULL's absence as has = 0. */
static int first(PyObject *t, int *has, double *v) {
    if (t == Py_None) {
        *has = 0;
        return 0;
    }
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 1) {
        PyErr_SetString(PyExc_TypeError, "a kept minimum must be a tuple");
        return -1;
    }
    *has = 1;
    return as_double(PyTuple_GET_ITEM(t, 0), v);
}

typedef struct {
    int has_best, has_sticky, has_expand;
    double best, sticky, expand;
} Mins;

static int read_mins(PyObject *acc, Mins *m, int all) {
    PyObject *t = PyObject_GetAttr(acc, s_best);
    if (t == NULL) return -1;
    int rc = first(t, &m->has_best, &m->best);
    Py_DECREF(t);
    if (rc < 0 || !all) return rc;
    t = PyObject_GetAttr(acc, s_sticky);
    if (t == NULL) return -1;
    rc = first(t, &m->has_sticky, &m->sticky);
    Py_DECREF(t);
    if (rc < 0) return -1;
    t = PyObject_GetAttr(acc, s_expand);
    if (t == NULL) return -1;
    rc = first(t, &m->has_expand, &m->expand);
    Py_DECREF(t);
    return rc;
}

static PyObject *rounded(double x) {
    PyObject *f = PyFloat_FromDouble(x);
    if (f == NULL) return NULL;
    PyObject *args[2] = {f, two};
    PyObject *r = PyObject_Vectorcall(round_fn, args, 2, NULL);
    Py_DECREF(f);
    return r;
}

static int speeds_of(PyObject *sp, double *prefill, double *decode) {
    PyObject *p = PyObject_GetAttr(sp, s_prefill);
    if (p == NULL) return -1;
    int rc = as_double(p, prefill);
    Py_DECREF(p);
    if (rc < 0) return -1;
    p = PyObject_GetAttr(sp, s_decode);
    if (p == NULL) return -1;
    rc = as_double(p, decode);
    Py_DECREF(p);
    return rc;
}

/* One candidate; 0 to go on, -1 on an error. */
/* A prompt's holders as match_split() gives them: `matches` (each one's count), and the others
 * of `common` (each holding `cb`), all replicas if `rep_common`. */
typedef struct {
    PyObject *common;
    long long cb;
    int n_common, rep_common;
} Common;

static int score_one(PyObject *cand, PyObject *acc, PyObject *keep, PyObject *matches,
                     const Common *co, PyObject *rep_set, int has_reps, const double *wt,
                     long long ibt,
                     long long n_indexed, long long prompt, PyObject *rh, PyObject *speeds,
                     double prior_prefill, double prior_decode, int explores, double now_s,
                     Mins *m) {
    const double min_hit = wt[0], scale = wt[1], w_busy = wt[2], w_load = wt[3],
                 w_cache = wt[4], w_stable = wt[5], hard_fraction = wt[6], hard_ttft = wt[7],
                 window = wt[8];
    if (!PyTuple_Check(cand) || PyTuple_GET_SIZE(cand) < C_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "a candidate must be a Candidate");
        return -1;
    }
    PyObject *w = PyTuple_GET_ITEM(cand, C_WORKER);
    long long blocks = 0;
    PyObject *b = PyDict_GetItemWithError(matches, w);
    if (b == NULL && PyErr_Occurred()) return -1;
    if (b != NULL) {
        if (as_ll(b, &blocks) < 0) return -1;
    } else if (co->n_common) {
        int in = PySet_Contains(co->common, w);
        if (in < 0) return -1;
        if (in) blocks = co->cb;
    }
    long long hit = 0;
    if (blocks) {
        hit = blocks * ibt;
        if (prompt - 1 < hit) hit = prompt - 1;
    }
    double fraction = n_indexed ? (double)blocks / (double)n_indexed : 0.0;
    double miss = fraction >= min_hit ? 1.0 - fraction : 1.0;
    double per_token = prior_prefill, decode = prior_decode;
    if (speeds != Py_None) {
        /* A dict lookup for the speeds computed already; a missing one through the mapping
         * (Calibration.table() computes and keeps it), as the reference's speeds[w]. */
        PyObject *sp = PyDict_GetItemWithError(speeds, w);
        if (sp != NULL) {
            Py_INCREF(sp);
        } else {
            if (PyErr_Occurred()) return -1;
            sp = PyObject_GetItem(speeds, w);
            if (sp == NULL) return -1;
        }
        int rc = speeds_of(sp, &per_token, &decode);
        Py_DECREF(sp);
        if (rc < 0) return -1;
    }
    double reported, age, unreported, booked, capacity, joined;
    if (as_double(PyTuple_GET_ITEM(cand, C_REPORTED_PREFILL), &reported) < 0 ||
        as_double(PyTuple_GET_ITEM(cand, C_AGE), &age) < 0 ||
        as_double(PyTuple_GET_ITEM(cand, C_UNREPORTED), &unreported) < 0 ||
        as_double(PyTuple_GET_ITEM(cand, C_BOOKED), &booked) < 0 ||
        as_double(PyTuple_GET_ITEM(cand, C_CAPACITY), &capacity) < 0 ||
        as_double(PyTuple_GET_ITEM(cand, C_JOINED), &joined) < 0)
        return -1;
    double ahead = reported - age / per_token;
    ahead = (ahead > 0.0 ? ahead : 0.0) + unreported;
    long long own = prompt - hit > 1 ? prompt - hit : 1;
    double ttft = (ahead + (double)own) * per_token + decode;
    double busy = w_busy * booked / (capacity != 0.0 ? capacity : 1.0);
    int is_rep = 0;
    if (has_reps) {
        is_rep = PySet_GET_SIZE(rep_set) > 0 ? PySet_Contains(rep_set, w) : 0;
        if (is_rep == 0 && co->rep_common && co->n_common) is_rep = PySet_Contains(co->common, w);
        if (is_rep < 0) return -1;
    }
    double moved = has_reps && !is_rep ? 1.0 : 0.0;
    double s = w_load * (ttft / scale + busy) + w_cache * miss + w_stable * moved;
    int cold = explores && now_s - joined < window;
    PyObject *hit_o = NULL, *s_o = NULL, *queue = NULL, *r = NULL;
    int rc = -1;
    if (has_reps) {
        PyObject *rq = NULL;
        int go = cold || !m->has_best || s <= m->best ||
                 (is_rep && (!m->has_sticky || s <= m->sticky)) || !m->has_expand;
        if (!go) {
            rq = rounded(ahead * per_token / scale + busy);
            if (rq == NULL) return -1;
            double q;
            if (as_double(rq, &q) < 0) {
                Py_DECREF(rq);
                return -1;
            }
            go = q <= m->expand;
            if (!go) {
                Py_DECREF(rq);
                return 0;
            }
        } else {
            rq = rounded(ahead * per_token / scale + busy);
            if (rq == NULL) return -1;
        }
        int over = booked >= hard_fraction * capacity || ttft > hard_ttft;
        PyObject *miss_o = PyFloat_FromDouble(miss);
        queue = miss_o ? PyTuple_Pack(2, rq, miss_o) : NULL;
        Py_XDECREF(miss_o);
        Py_DECREF(rq);
        if (queue == NULL) return -1;
        hit_o = PyLong_FromLongLong(hit);
        s_o = PyFloat_FromDouble(s);
        if (hit_o == NULL || s_o == NULL) goto done;
        PyObject *args[8] = {acc, rh, w, hit_o, s_o, queue,
                             (is_rep && !over) ? Py_True : Py_False, cold ? Py_True : Py_False};
        r = PyObject_Vectorcall(keep, args, 8, NULL);
        if (r == NULL || read_mins(acc, m, 1) < 0) goto done;
    } else if (cold || !m->has_best || s <= m->best) {
        hit_o = PyLong_FromLongLong(hit);
        s_o = PyFloat_FromDouble(s);
        if (hit_o == NULL || s_o == NULL) goto done;
        PyObject *args[8] = {acc, rh, w, hit_o, s_o, Py_None, Py_False,
                             cold ? Py_True : Py_False};
        r = PyObject_Vectorcall(keep, args, 8, NULL);
        if (r == NULL || read_mins(acc, m, 0) < 0) goto done;
    }
    rc = 0;
done:
    Py_XDECREF(hit_o);
    Py_XDECREF(s_o);
    Py_XDECREF(queue);
    Py_XDECREF(r);
    return rc;
}

PyDoc_STRVAR(score_into_doc,
             "score_into(acc, keep, candidates, weights, matches, rep_set, n_indexed, prompt, "
             "rh, speeds, prior, explores, now_s, common, common_blocks, rep_common, /)\n--\n\n"
             "sluice.dispatcher.scoring.score_into_pure, in C.");

static PyObject *score_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 16) {
        PyErr_Format(PyExc_TypeError, "score_into() takes 16 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *acc = args[0], *keep = args[1], *candidates = args[2], *weights = args[3],
             *matches = args[4], *rep_set = args[5], *rh = args[8], *speeds = args[9],
             *prior = args[10];
    if (!PyDict_Check(matches)) {
        PyErr_SetString(PyExc_TypeError, "matches must be a dict");
        return NULL;
    }
    if (speeds != Py_None && !PyDict_Check(speeds)) {
        PyErr_SetString(PyExc_TypeError, "speeds must be a dict (or None)");
        return NULL;
    }
    if (!PyAnySet_Check(rep_set) || !PyAnySet_Check(args[13])) {
        PyErr_SetString(PyExc_TypeError, "rep_set and common must be frozensets");
        return NULL;
    }
    Common co = {args[13], 0, PySet_GET_SIZE(args[13]) > 0, PyObject_IsTrue(args[15])};
    if (co.rep_common < 0 || as_ll(args[14], &co.cb) < 0) return NULL;
    if (!PyTuple_Check(weights) || PyTuple_GET_SIZE(weights) != 10) {
        PyErr_SetString(PyExc_TypeError, "weights must be a Weights");
        return NULL;
    }
    long long ibt, n_indexed, prompt;
    double wt[9], now_s, prior_prefill, prior_decode;
    if (as_ll(PyTuple_GET_ITEM(weights, 0), &ibt) < 0) return NULL;
    for (int i = 0; i < 9; i++)
        if (as_double(PyTuple_GET_ITEM(weights, i + 1), &wt[i]) < 0) return NULL;
    if (as_ll(args[6], &n_indexed) < 0 || as_ll(args[7], &prompt) < 0 ||
        as_double(args[12], &now_s) < 0 || speeds_of(prior, &prior_prefill, &prior_decode) < 0)
        return NULL;
    int explores = PyObject_IsTrue(args[11]);
    if (explores < 0) return NULL;
    int has_reps = PySet_GET_SIZE(rep_set) > 0 || (co.rep_common && co.n_common);
    Mins m;
    if (read_mins(acc, &m, 1) < 0) return NULL;
    if (PyList_CheckExact(candidates)) {
        /* The list may not change under the loop: keep() is ours and does not touch it. */
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(candidates); i++) {
            PyObject *cand = PyList_GET_ITEM(candidates, i);
            Py_INCREF(cand);
            int rc = score_one(cand, acc, keep, matches, &co, rep_set, has_reps, wt, ibt, n_indexed,
                               prompt, rh, speeds, prior_prefill, prior_decode, explores,
                               now_s, &m);
            Py_DECREF(cand);
            if (rc < 0) return NULL;
        }
        Py_RETURN_NONE;
    }
    PyObject *it = PyObject_GetIter(candidates);
    if (it == NULL) return NULL;
    PyObject *cand;
    while ((cand = PyIter_Next(it)) != NULL) {
        int rc = score_one(cand, acc, keep, matches, &co, rep_set, has_reps, wt, ibt, n_indexed,
                           prompt, rh, speeds, prior_prefill, prior_decode, explores, now_s,
                           &m);
        Py_DECREF(cand);
        if (rc < 0) {
            Py_DECREF(it);
            return NULL;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* group_keys: sluice.dispatcher.scoring.group_keys_pure, the reference. */
PyDoc_STRVAR(group_keys_doc,
             "group_keys(workers, blocks_of, skip, moved_key, keys, /) -> dict\n\n"
             "Per index entries held, the (load key, worker) of the candidates among workers "
             "(see sluice.dispatcher.scoring.group_keys_pure).");

/* map[key] as a new reference; NULL without an error if absent (any mapping, dicts fast). */
static PyObject *get_item(PyObject *map, PyObject *key) {
    if (PyDict_CheckExact(map)) {
        PyObject *v = PyDict_GetItemWithError(map, key);
        Py_XINCREF(v);
        return v;
    }
    PyObject *v = PyObject_GetItem(map, key);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_KeyError)) PyErr_Clear();
    return v;
}

/* The key of a candidate (new reference), NULL without an error if it is none. */
static PyObject *key_of(PyObject *w, PyObject *moved_key, PyObject *keys, double *v) {
    PyObject *key = get_item(moved_key, w);
    if (key == NULL) {
        if (PyErr_Occurred()) return NULL;
        key = get_item(keys, w);
        if (key == NULL) return NULL;
        if (as_double(key, v) < 0) {
            Py_DECREF(key);
            return NULL;
        }
        return key;
    }
    if (as_double(key, v) < 0 || *v == Py_HUGE_VAL) { /* inf: full for the rest of the plan */
        Py_DECREF(key);
        return NULL;
    }
    return key;
}

static int group_one(PyObject *w, PyObject *blocks_of, PyObject *skip, PyObject *moved_key,
                     PyObject *keys, PyObject *groups) {
    if (skip != Py_None) {
        int in = PySequence_Contains(skip, w);
        if (in != 0) return in < 0 ? -1 : 0;
    }
    double v;
    PyObject *key = key_of(w, moved_key, keys, &v);
    if (key == NULL) return PyErr_Occurred() ? -1 : 0;
    PyObject *blocks = get_item(blocks_of, w);
    if (blocks == NULL) {
        if (PyErr_Occurred()) {
            Py_DECREF(key);
            return -1;
        }
        blocks = Py_NewRef(zero);
    }
    PyObject *pair = PyTuple_Pack(2, key, w);
    Py_DECREF(key);
    if (pair == NULL) {
        Py_DECREF(blocks);
        return -1;
    }
    PyObject *group = PyDict_GetItemWithError(groups, blocks); /* borrowed */
    int rc;
    if (group != NULL) {
        rc = PyList_Append(group, pair);
    } else if (PyErr_Occurred()) {
        rc = -1;
    } else {
        group = PyList_New(1);
        if (group == NULL) {
            rc = -1;
        } else {
            Py_INCREF(pair);
            PyList_SET_ITEM(group, 0, pair);
            rc = PyDict_SetItem(groups, blocks, group);
            Py_DECREF(group);
        }
    }
    Py_DECREF(pair);
    Py_DECREF(blocks);
    return rc;
}

static PyObject *group_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "group_keys() takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *workers = args[0], *blocks_of = args[1], *skip = args[2];
    PyObject *moved_key = args[3], *keys = args[4];
    PyObject *groups = PyDict_New();
    if (groups == NULL) return NULL;
    PyObject *it = PyObject_GetIter(workers);
    if (it == NULL) {
        Py_DECREF(groups);
        return NULL;
    }
    PyObject *w;
    while ((w = PyIter_Next(it)) != NULL) {
        int rc = group_one(w, blocks_of, skip, moved_key, keys, groups);
        Py_DECREF(w);
        if (rc < 0) break;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) {
        Py_DECREF(groups);
        return NULL;
    }
    return groups;
}

/* least_keys: sluice.dispatcher.scoring.least_keys_pure, the reference. Each group keeps its
 * m least (key, worker) in a sorted array (m is small: a shortlist's), compared as Python
 * compares the tuples (the key, then the worker id), and counts the rest. */
PyDoc_STRVAR(least_keys_doc,
             "least_keys(workers, blocks_of, skip, moved_key, keys, m, /) -> dict\n\n"
             "Per index entries held, the m least (load key, worker) of the candidates among "
             "workers, and how many there are (see sluice.dispatcher.scoring.least_keys_pure).");

#define LEAST_MAX 64

typedef struct {
    long long blocks;
    Py_ssize_t count;
    int n;
    double key[LEAST_MAX];
    PyObject *keyobj[LEAST_MAX]; /* owned */
    PyObject *w[LEAST_MAX];      /* owned */
} Least;

/* (k1, w1) < (k2, w2), as Python compares the tuples; -1 on error. */
static int pair_less(double k1, PyObject *w1, double k2, PyObject *w2) {
    if (k1 != k2) return k1 < k2;
    int c = PyUnicode_Compare(w1, w2);
    if (c == -1 && PyErr_Occurred()) return -1;
    return c < 0;
}

static int least_add(Least *g, int m, double key, PyObject *keyobj, PyObject *w) {
    g->count++;
    int at = g->n;
    while (at > 0) {
        int lt = pair_less(key, w, g->key[at - 1], g->w[at - 1]);
        if (lt < 0) return -1;
        if (!lt) break;
        at--;
    }
    if (at >= m) return 0; /* not among the m least */
    if (g->n == m) {       /* the largest leaves */
        Py_DECREF(g->keyobj[m - 1]);
        Py_DECREF(g->w[m - 1]);
        g->n--;
    }
    for (int i = g->n; i > at; i--) {
        g->key[i] = g->key[i - 1];
        g->keyobj[i] = g->keyobj[i - 1];
        g->w[i] = g->w[i - 1];
    }
    g->key[at] = key;
    g->keyobj[at] = Py_NewRef(keyobj);
    g->w[at] = Py_NewRef(w);
    g->n++;
    return 0;
}

static void least_free(Least *gs, int ng) {
    for (int i = 0; i < ng; i++)
        for (int j = 0; j < gs[i].n; j++) {
            Py_DECREF(gs[i].keyobj[j]);
            Py_DECREF(gs[i].w[j]);
        }
    PyMem_Free(gs);
}

static PyObject *least_result(Least *gs, int ng) {
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    for (int i = 0; i < ng; i++) {
        PyObject *list = PyList_New(gs[i].n);
        if (list == NULL) goto fail;
        for (int j = 0; j < gs[i].n; j++) {
            PyObject *pair = PyTuple_Pack(2, gs[i].keyobj[j], gs[i].w[j]);
            if (pair == NULL) {
                Py_DECREF(list);
                goto fail;
            }
            PyList_SET_ITEM(list, j, pair);
        }
        PyObject *entry = Py_BuildValue("(Nn)", list, gs[i].count);
        PyObject *blocks = entry ? PyLong_FromLongLong(gs[i].blocks) : NULL;
        int rc = blocks ? PyDict_SetItem(out, blocks, entry) : -1;
        Py_XDECREF(blocks);
        Py_XDECREF(entry);
        if (rc < 0) goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *least_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "least_keys() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *workers = args[0], *blocks_of = args[1], *skip = args[2];
    PyObject *moved_key = args[3], *keys = args[4];
    long long m;
    if (as_ll(args[5], &m) < 0) return NULL;
    if (m < 1 || m > LEAST_MAX) {
        PyErr_Format(PyExc_ValueError, "least_keys(): m must be within [1, %d]", LEAST_MAX);
        return NULL;
    }
    int cap = 8, ng = 0;
    Least *gs = PyMem_Malloc(sizeof(Least) * cap);
    if (gs == NULL) return PyErr_NoMemory();
    PyObject *it = PyObject_GetIter(workers);
    if (it == NULL) {
        PyMem_Free(gs);
        return NULL;
    }
    PyObject *w;
    while ((w = PyIter_Next(it)) != NULL) {
        int rc = 0;
        if (skip != Py_None) rc = PySequence_Contains(skip, w);
        double v;
        PyObject *key = rc == 0 ? key_of(w, moved_key, keys, &v) : NULL;
        if (key != NULL) {
            long long blocks = 0;
            PyObject *b = get_item(blocks_of, w);
            if (b != NULL) {
                rc = as_ll(b, &blocks);
                Py_DECREF(b);
            } else if (PyErr_Occurred()) {
                rc = -1;
            }
            int g = 0;
            while (rc == 0 && g < ng && gs[g].blocks != blocks) g++;
            if (rc == 0 && g == ng) {
                if (ng == cap) {
                    Least *more = PyMem_Realloc(gs, sizeof(Least) * cap * 2);
                    if (more == NULL) {
                        PyErr_NoMemory();
                        rc = -1;
                    } else {
                        gs = more;
                        cap *= 2;
                    }
                }
                if (rc == 0) {
                    gs[ng].blocks = blocks;
                    gs[ng].count = 0;
                    gs[ng].n = 0;
                    ng++;
                }
            }
            if (rc == 0) rc = least_add(&gs[g], (int)m, v, key, w);
            Py_DECREF(key);
        }
        Py_DECREF(w);
        if (rc < 0 || PyErr_Occurred()) break;
    }
    Py_DECREF(it);
    PyObject *out = PyErr_Occurred() ? NULL : least_result(gs, ng);
    least_free(gs, ng);
    return out;
}

/* held_at_least: sluice.dispatcher.scoring.held_at_least_pure, the reference. */
PyDoc_STRVAR(held_at_least_doc,
             "held_at_least(matches, need, exclude, /) -> list\n\n"
             "The workers of matches holding at least need index entries, but those in exclude "
             "(see sluice.dispatcher.scoring.held_at_least_pure).");

static PyObject *held_at_least(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "held_at_least() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *matches = args[0], *exclude = args[2];
    if (!PyDict_Check(matches)) {
        PyErr_SetString(PyExc_TypeError, "matches must be a dict");
        return NULL;
    }
    long long need;
    if (as_ll(args[1], &need) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    Py_ssize_t pos = 0, size = PyDict_GET_SIZE(matches);
    PyObject *w, *b;
    while (PyDict_Next(matches, &pos, &w, &b)) {
        long long held;
        if (as_ll(b, &held) < 0) goto fail;
        if (held < need) continue;
        /* exclude's __contains__ may run Python code that changes matches: the key is held
         * across it, and a changed dict is an error, as iterating it in Python is. */
        Py_INCREF(w);
        int in = exclude == Py_None ? 0 : PySequence_Contains(exclude, w);
        int rc = in < 0 ? -1 : in ? 0 : PyList_Append(out, w);
        Py_DECREF(w);
        if (rc < 0) goto fail;
        if (PyDict_GET_SIZE(matches) != size) {
            PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during iteration");
            goto fail;
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"held_at_least", (PyCFunction)(void (*)(void))held_at_least, METH_FASTCALL,
     held_at_least_doc},
    {"least_keys", (PyCFunction)(void (*)(void))least_keys, METH_FASTCALL, least_keys_doc},
    {"score_into", (PyCFunction)(void (*)(void))score_into, METH_FASTCALL, score_into_doc},
    {"group_keys", (PyCFunction)(void (*)(void))group_keys, METH_FASTCALL, group_keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_scoring", "Scoring a decision's candidates in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__scoring(void) {
    s_best = PyUnicode_InternFromString("best");
    s_sticky = PyUnicode_InternFromString("sticky");
    s_expand = PyUnicode_InternFromString("expand");
    s_prefill = PyUnicode_InternFromString("prefill_s_per_token");
    s_decode = PyUnicode_InternFromString("decode_s_per_token");
    two = PyLong_FromLong(2);
    zero = PyLong_FromLong(0);
    PyObject *builtins = PyEval_GetBuiltins(); /* borrowed */
    round_fn = builtins ? PyDict_GetItemString(builtins, "round") : NULL;
    if (!s_best || !s_sticky || !s_expand || !s_prefill || !s_decode || !two || !zero ||
        !round_fn) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ImportError, "_scoring: no builtins");
        return NULL;
    }
    Py_INCREF(round_fn);
    return PyModule_Create(&module);
}

/* The cluster cache index in C: sluice.dispatcher.cacheindex.PureCacheIndex's semantics, in
 * native data. PureCacheIndex is the reference: tests/test_cacheindex.py drives both with the
 * same random operations and compares every answer. Read that class first; this file says
 * only how the same thing is laid out.
 *
 * - Blocks live in an array of entries, found by an open-addressing table (linear probing,
 *   deletion by backward shift) keyed by the 64-bit block hash, and chained in recency order
 *   (head: least recently used) as the reference's OrderedDict is.
 * - A block's holds are (worker slot, until) pairs, the first one inline in the entry: most
 *   blocks of a large index have one holder. They are kept in slot order, so that a booking
 *   finds its worker's hold by binary search in a block the whole fleet holds (a system
 *   prompt: 10.2 -> 1.6 us to guess 32 such blocks at 1,024 holders); the answers do not
 *   depend on it (the reference's answers are sets, or dicts read by key).
 * - A worker is a slot: its name, its reports' block set (a Python set, as the reference's,
 *   so that a snapshot diffs in the same order), its digest number and staleness. A slot is
 *   freed by remove_worker, which drops everything that names it.
 * - A guess under a report (the reference's `_under`, a dict {(hash, worker): until}) is kept
 *   in its hold, beside the report: a worker's reports of blocks the dispatcher routed to it
 *   are not rare (every completion refreshes such guesses), and with the dict a completion
 *   cost 582 ns a block against 77 ns (docs/BENCHMARKS.md).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int32_t slot;
    double until;
    double under; /* while `until` is REPORTED: the guess beneath it, or NO_GUESS */
} Hold;

typedef struct {
    uint64_t hash;
    int32_t prev, next; /* recency chain; a free entry's next is the free list */
    uint32_t n, cap;    /* cap 1: the hold is `one` */
    uint64_t ver;       /* Index.vgen when its holds last changed but for a guess lengthened */
    union {
        Hold one;
        Hold *many;
    } h;
} Entry;

typedef struct {
    PyObject *name;     /* NULL: a free slot (next_free says the next one) */
    PyObject *reported; /* set of int, or NULL */
    PyObject *seq;      /* int, or NULL */
    int stale;
    int32_t next_free;
    uint64_t mark; /* match()'s scratch */
} Worker;

/* match_split()'s memo of a chain of entries that many workers hold (a system prompt every
 * worker caches): the workers alive through its `j` entries (a frozenset, and their slots),
 * those that left it earlier, and when it stops being true. It holds while none of its
 * entries changed holds (each entry's `ver` at most `vgen`), at times in [since, until): a
 * hold alive then expires at the earliest hold's time; a hold not alive then only comes back
 * by a change that moves its entry's `ver`. A chain shared by many requests is walked once
 * per change instead of once per request: walking it costs its entries times its holders.
 * The memos of chains that start with the same block (a system prompt, then one of several
 * prompts many workers hold each) share a set of MEMO_WAYS slots, the least recently used
 * made again. */
#define MEMO_SLOTS 64
#define MEMO_WAYS 4
typedef struct {
    uint64_t *hashes;
    Py_ssize_t j, cap;
    int32_t *alive;
    Py_ssize_t alive_n;
    PyObject *common;  /* frozenset of names, or NULL: an empty slot */
    PyObject *dropped; /* dict: name -> entries held, for those that left before j */
    uint64_t vgen;
    double since, until;
    uint64_t used; /* Index.memo_clock when last made or read */
} Memo;

typedef struct {
    PyObject_HEAD
    Py_ssize_t max_blocks;
    double guess_ttl_s;
    Entry *ent;
    int32_t ent_cap, ent_top, ent_free;
    Py_ssize_t count;
    int32_t head, tail;
    int32_t *table;
    uint64_t tmask;
    Worker *w;
    int32_t w_cap, w_top, w_free;
    PyObject *slots; /* name -> int slot */
    uint64_t *sweep;
    Py_ssize_t sweep_n, sweep_cap, sweep_at;
    uint64_t gen;
    int32_t *scratch; /* match()'s alive list */
    Py_ssize_t scratch_cap;
    uint64_t vgen;
    double since_max; /* the latest time a memo was made at */
    Py_ssize_t memo_min; /* holders a chain needs for a memo */
    Memo memo[MEMO_SLOTS];
    uint64_t memo_clock;
    int busy; /* a call runs: another one (re-entered from Python code) is refused */
} Index;

static const double REPORTED = INFINITY;
static const double NO_GUESS = -INFINITY;

static inline Hold *holds_of(Entry *e) { return e->cap <= 1 ? &e->h.one : e->h.many; }

/* The entry's holds changed (not by a guess lengthened under its time): memos through it are
 * stale. */
static inline void touch(Index *ix, Entry *E) { E->ver = ++ix->vgen; }

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static void memo_clear(Memo *m) {
    Py_CLEAR(m->common);
    Py_CLEAR(m->dropped);
    m->j = m->alive_n = 0;
}

static void memo_free(Memo *m) {
    memo_clear(m);
    PyMem_Free(m->hashes);
    PyMem_Free(m->alive);
    m->hashes = NULL;
    m->alive = NULL;
    m->cap = 0;
}

/* ------------------------------------------------------------------ hashes and names */

static int as_hash(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "a block hash must be an int, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "a block hash must be an int in [0, 2**64)");
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static PyObject *hash_obj(uint64_t h) { return PyLong_FromUnsignedLongLong((unsigned long long)h); }

/* The slot of a worker name; -1 (no error set) if unknown and !create; -2 on error. */
static int32_t slot_of(Index *ix, PyObject *name, int create) {
    if (!PyUnicode_CheckExact(name)) { /* a subclass's __hash__ or __eq__ would run Python */
        PyErr_Format(PyExc_TypeError, "a worker id must be a str, not %.100s", Py_TYPE(name)->tp_name);
        return -2;
    }
    PyObject *s = PyDict_GetItemWithError(ix->slots, name);
    if (s != NULL)
        return (int32_t)PyLong_AsLong(s);
    if (PyErr_Occurred())
        return -2;
    if (!create)
        return -1;
    int32_t slot;
    if (ix->w_free >= 0) {
        slot = ix->w_free;
        ix->w_free = ix->w[slot].next_free;
    } else {
        if (ix->w_top == ix->w_cap) {
            int32_t cap = ix->w_cap ? ix->w_cap * 2 : 16;
            Worker *nw = PyMem_Realloc(ix->w, (size_t)cap * sizeof(Worker));
            if (nw == NULL) {
                PyErr_NoMemory();
                return -2;
            }
            ix->w = nw;
            ix->w_cap = cap;
        }
        slot = ix->w_top++;
    }
    Worker *W = &ix->w[slot];
    memset(W, 0, sizeof(Worker));
    W->next_free = -1;
    PyObject *v = PyLong_FromLong(slot);
    if (v == NULL || PyDict_SetItem(ix->slots, name, v) < 0) {
        Py_XDECREF(v);
        W->next_free = ix->w_free;
        ix->w_free = slot;
        return -2;
    }
    Py_DECREF(v);
    Py_INCREF(name);
    W->name = name;
    return slot;
}

static int reported_discard(Worker *W, uint64_t h) {
    if (W->reported == NULL)
        return 0;
    PyObject *ho = hash_obj(h);
    if (ho == NULL)
        return -1;
    int rc = PySet_Discard(W->reported, ho);
    Py_DECREF(ho);
    return rc < 0 ? -1 : 0;
}

/* ------------------------------------------------------------------ the table */

static int32_t find(Index *ix, uint64_t h) {
    if (ix->table == NULL)
        return -1;
    uint64_t i = mix(h) & ix->tmask;
    for (;;) {
        int32_t e = ix->table[i];
        if (e < 0 || ix->ent[e].hash == h)
            return e;
        i = (i + 1) & ix->tmask;
    }
}

static int rehash(Index *ix, uint64_t size) {
    int32_t *t = PyMem_Malloc((size_t)size * sizeof(int32_t));
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(t, 0xff, (size_t)size * sizeof(int32_t));
    uint64_t mask = size - 1;
    for (int32_t e = ix->head; e >= 0; e = ix->ent[e].next) {
        uint64_t i = mix(ix->ent[e].hash) & mask;
        while (t[i] >= 0)
            i = (i + 1) & mask;
        t[i] = e;
    }
    PyMem_Free(ix->table);
    ix->table = t;
    ix->tmask = mask;
    return 0;
}

static void unlink_entry(Index *ix, int32_t e) {
    Entry *E = &ix->ent[e];
    if (E->prev >= 0)
        ix->ent[E->prev].next = E->next;
    else
        ix->head = E->next;
    if (E->next >= 0)
        ix->ent[E->next].prev = E->prev;
    else
        ix->tail = E->prev;
}

static void append_entry(Index *ix, int32_t e) {
    Entry *E = &ix->ent[e];
    E->prev = ix->tail;
    E->next = -1;
    if (ix->tail >= 0)
        ix->ent[ix->tail].next = e;
    else
        ix->head = e;
    ix->tail = e;
}

static inline void to_end(Index *ix, int32_t e) {
    if (ix->tail != e) {
        unlink_entry(ix, e);
        append_entry(ix, e);
    }
}

/* A new block, most recently used, with no holds yet; -1 on error. */
static int32_t insert(Index *ix, uint64_t h) {
    if (ix->table == NULL || (uint64_t)(ix->count + 1) * 2 > ix->tmask + 1) {
        uint64_t size = ix->table == NULL ? 64 : (ix->tmask + 1) * 2;
        if (rehash(ix, size) < 0)
            return -1;
    }
    int32_t e;
    if (ix->ent_free >= 0) {
        e = ix->ent_free;
        ix->ent_free = ix->ent[e].next;
    } else {
        if (ix->ent_top == ix->ent_cap) {
            if (ix->ent_cap >= INT32_MAX / 2) {
                PyErr_SetString(PyExc_MemoryError, "cache index: too many blocks");
                return -1;
            }
            int32_t cap = ix->ent_cap ? ix->ent_cap * 2 : 64;
            Entry *ne = PyMem_Realloc(ix->ent, (size_t)cap * sizeof(Entry));
            if (ne == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            ix->ent = ne;
            ix->ent_cap = cap;
        }
        e = ix->ent_top++;
    }
    Entry *E = &ix->ent[e];
    E->hash = h;
    E->n = 0;
    E->cap = 1;
    touch(ix, E);
    append_entry(ix, e);
    uint64_t i = mix(h) & ix->tmask;
    while (ix->table[i] >= 0)
        i = (i + 1) & ix->tmask;
    ix->table[i] = e;
    ix->count++;
    return e;
}

static void delete_entry(Index *ix, int32_t e) {
    Entry *E = &ix->ent[e];
    uint64_t mask = ix->tmask, i = mix(E->hash) & mask;
    while (ix->table[i] != e)
        i = (i + 1) & mask;
    ix->table[i] = -1;
    for (uint64_t j = (i + 1) & mask; ix->table[j] >= 0; j = (j + 1) & mask) {
        uint64_t k = mix(ix->ent[ix->table[j]].hash) & mask;
        /* Move the entry at j back to the hole at i unless its home k lies in (i, j]. */
        int home_between = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!home_between) {
            ix->table[i] = ix->table[j];
            ix->table[j] = -1;
            i = j;
        }
    }
    unlink_entry(ix, e);
    if (E->cap > 1)
        PyMem_Free(E->h.many);
    E->cap = 1;
    E->n = 0;
    E->next = ix->ent_free;
    ix->ent_free = e;
    ix->count--;
}

/* Where the worker's hold is in the entry's holds (kept in slot order, so that an entry a
 * whole fleet holds, a system prompt, is searched in log time by every booking), or where it
 * would go as -1 - that place. */
static int32_t hold_place(Entry *E, int32_t slot) {
    Hold *hs = holds_of(E);
    uint32_t lo = 0, hi = E->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (hs[mid].slot < slot)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < E->n && hs[lo].slot == slot ? (int32_t)lo : -1 - (int32_t)lo;
}

static int32_t hold_at(Entry *E, int32_t slot) {
    int32_t i = hold_place(E, slot);
    return i >= 0 ? i : -1;
}

static int add_hold(Index *ix, int32_t e, int32_t slot, double until) {
    Entry *E = &ix->ent[e];
    if (E->n == E->cap) {
        uint32_t cap = E->cap * 4;
        Hold *m = PyMem_Malloc((size_t)cap * sizeof(Hold));
        if (m == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(m, holds_of(E), (size_t)E->n * sizeof(Hold));
        if (E->cap > 1)
            PyMem_Free(E->h.many);
        E->h.many = m;
        E->cap = cap;
    }
    Hold *hs = holds_of(E);
    int32_t at = hold_place(E, slot);
    uint32_t i = at >= 0 ? (uint32_t)at : (uint32_t)(-1 - at); /* (callers add no hold twice) */
    memmove(&hs[i + 1], &hs[i], (size_t)(E->n - i) * sizeof(Hold));
    hs[i].slot = slot;
    hs[i].until = until;
    hs[i].under = NO_GUESS;
    E->n++;
    touch(ix, E);
    return 0;
}

static void drop_hold(Index *ix, Entry *E, uint32_t i) {
    Hold *hs = holds_of(E);
    memmove(&hs[i], &hs[i + 1], (size_t)(E->n - i - 1) * sizeof(Hold));
    E->n--;
    touch(ix, E);
}

/* ------------------------------------------------------------------ the reference's helpers */

static int trim(Index *ix) {
    while (ix->count > ix->max_blocks) {
        int32_t e = ix->head;
        Entry *E = &ix->ent[e];
        Hold *hs = holds_of(E);
        for (uint32_t i = 0; i < E->n; i++) {
            if (hs[i].until == REPORTED) {
                Worker *W = &ix->w[hs[i].slot];
                if (reported_discard(W, E->hash) < 0)
                    return -1;
            }
        }
        delete_entry(ix, e);
    }
    return 0;
}

static int report(Index *ix, uint64_t h, int32_t slot) {
    int32_t e = find(ix, h);
    if (e < 0) {
        if ((e = insert(ix, h)) < 0)
            return -1;
    } else {
        to_end(ix, e);
    }
    Entry *E = &ix->ent[e];
    int32_t i = hold_at(E, slot);
    double hold = i < 0 ? NO_GUESS : holds_of(E)[i].until;
    if (hold != REPORTED) {
        if (i < 0)
            return add_hold(ix, e, slot, REPORTED);
        holds_of(E)[i].under = hold;
        holds_of(E)[i].until = REPORTED;
        touch(ix, E); /* a guess past its time held again */
    }
    return 0;
}

static int unreport(Index *ix, int32_t slot, uint64_t h, int forget_guess) {
    int32_t e = find(ix, h);
    if (e < 0)
        return 0;
    Entry *E = &ix->ent[e];
    int32_t i = hold_at(E, slot);
    if (i < 0)
        return 0;
    if (reported_discard(&ix->w[slot], h) < 0)
        return -1;
    Hold *hd = &holds_of(E)[i];
    double under = hd->until == REPORTED ? hd->under : hd->until;
    if (forget_guess || under == NO_GUESS) {
        drop_hold(ix, E, (uint32_t)i);
    } else {
        hd->until = under;
        touch(ix, E);
    }
    if (E->n == 0)
        delete_entry(ix, e);
    return 0;
}

/* ------------------------------------------------------------------ the type */

static int Index_init(Index *ix, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"max_blocks", "guess_ttl_s", "memo_min_holders", NULL};
    Py_ssize_t max_blocks = 0, memo_min = 0;
    double ttl = 0.0;
    PyObject *dflt = PyImport_ImportModule("sluice.dispatcher.defaults");
    if (dflt == NULL)
        return -1;
    PyObject *mb = PyObject_GetAttrString(dflt, "INDEX_MAX_BLOCKS");
    PyObject *gt = mb ? PyObject_GetAttrString(dflt, "GUESS_TTL_S") : NULL;
    PyObject *mm = gt ? PyObject_GetAttrString(dflt, "INDEX_MEMO_MIN_HOLDERS") : NULL;
    Py_DECREF(dflt);
    if (mm == NULL) {
        Py_XDECREF(mb);
        Py_XDECREF(gt);
        return -1;
    }
    max_blocks = PyLong_AsSsize_t(mb);
    ttl = PyFloat_AsDouble(gt);
    memo_min = PyLong_AsSsize_t(mm);
    Py_DECREF(mb);
    Py_DECREF(gt);
    Py_DECREF(mm);
    if (PyErr_Occurred())
        return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$ndn", kw, &max_blocks, &ttl, &memo_min))
        return -1;
    if (max_blocks < 1 || !(ttl > 0)) {
        PyErr_SetString(PyExc_ValueError, "max_blocks must be >= 1 and guess_ttl_s > 0");
        return -1;
    }
    if (memo_min < 1) {
        PyErr_SetString(PyExc_ValueError, "memo_min_holders must be >= 1");
        return -1;
    }
    if (ix->slots != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "CacheIndex is initialised once");
        return -1;
    }
    ix->max_blocks = max_blocks;
    ix->guess_ttl_s = ttl;
    ix->ent_free = ix->w_free = ix->head = ix->tail = -1;
    ix->since_max = -INFINITY;
    ix->memo_min = memo_min;
    ix->slots = PyDict_New();
    return ix->slots ? 0 : -1;
}

static void Index_dealloc(Index *ix) {
    for (int32_t e = 0; e < ix->ent_top; e++)
        if (ix->ent[e].cap > 1)
            PyMem_Free(ix->ent[e].h.many);
    for (int32_t s = 0; s < ix->w_top; s++) {
        Py_XDECREF(ix->w[s].name);
        Py_XDECREF(ix->w[s].reported);
        Py_XDECREF(ix->w[s].seq);
    }
    PyMem_Free(ix->ent);
    PyMem_Free(ix->table);
    PyMem_Free(ix->w);
    PyMem_Free(ix->sweep);
    PyMem_Free(ix->scratch);
    for (int k = 0; k < MEMO_SLOTS; k++)
        memo_free(&ix->memo[k]);
    Py_XDECREF(ix->slots);
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static int ready(Index *ix) {
    if (ix->slots == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "CacheIndex.__init__ was not called");
        return 0;
    }
    return 1;
}

static Py_ssize_t Index_len(Index *ix) { return ix->count; }

/* guess(worker_id, hashes, now_s) */
static int parse3(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *fn,
                  PyObject **a, PyObject **b, double *now) {
    static const char *names[] = {"worker_id", "hashes", "now_s"};
    PyObject *got[3] = {NULL, NULL, NULL};
    if (nargs > 3) {
        PyErr_Format(PyExc_TypeError, "%s() takes 3 arguments", fn);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        got[i] = args[i];
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nk; k++) {
        const char *key = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
        int found = 0;
        for (int i = 0; key && i < 3; i++) {
            if (strcmp(key, names[i]) == 0) {
                if (got[i] != NULL) {
                    PyErr_Format(PyExc_TypeError, "%s() got multiple values for %s", fn, key);
                    return -1;
                }
                got[i] = args[nargs + k];
                found = 1;
            }
        }
        if (!found) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument", fn);
            return -1;
        }
    }
    if (!got[0] || !got[1] || !got[2]) {
        PyErr_Format(PyExc_TypeError, "%s() takes worker_id, hashes and now_s", fn);
        return -1;
    }
    *a = got[0];
    *b = got[1];
    *now = PyFloat_AsDouble(got[2]);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *guess_impl(Index *ix, PyObject *name, PyObject *hashes, double now) {
    double until = now + ix->guess_ttl_s;
    /* The hashes first: consuming an iterable runs Python code, which must find no slot of
     * this call's taken yet. */
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    int32_t slot = slot_of(ix, name, 1);
    if (slot < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t h;
        if (as_hash(items[k], &h) < 0)
            goto fail;
        int32_t e = find(ix, h);
        if (e < 0) {
            if ((e = insert(ix, h)) < 0 || add_hold(ix, e, slot, until) < 0)
                goto fail;
            continue;
        }
        to_end(ix, e);
        Entry *E = &ix->ent[e];
        int32_t i = hold_at(E, slot);
        if (i < 0) {
            if (add_hold(ix, e, slot, until) < 0)
                goto fail;
        } else {
            Hold *hd = &holds_of(E)[i];
            if (hd->until < until) {
                /* A guess past its time (for a memo that may have been made later, too) comes
                 * back to life: memos through it are stale. One lengthened before its time
                 * changes nothing a memo says (its `until` is the earliest hold's). */
                if (hd->until <= now || now < ix->since_max)
                    touch(ix, E);
                hd->until = until;
            } else if (hd->until == REPORTED && hd->under < until) {
                hd->under = until;
            }
        }
    }
    Py_DECREF(seq);
    if (ix->count > ix->max_blocks && trim(ix) < 0)
        return NULL;
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *Index_guess(Index *ix, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *name, *hashes;
    double now;
    if (!ready(ix) || parse3(args, nargs, kwnames, "guess", &name, &hashes, &now) < 0)
        return NULL;
    return guess_impl(ix, name, hashes, now);
}

static PyObject *Index_completed(Index *ix, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *name, *hashes;
    double now;
    if (!ready(ix) || parse3(args, nargs, kwnames, "completed", &name, &hashes, &now) < 0)
        return NULL;
    return guess_impl(ix, name, hashes, now);
}

/* ------------------------------------------------------------------ match_split and its memo */

/* Whether `o` is the block hash `h`, raising nothing (a bad item is for the walk, which
 * reads the items in order, to refuse when it reaches it). */
static int is_hash(PyObject *o, uint64_t h) {
    if (!PyLong_Check(o))
        return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return (uint64_t)v == h;
}

/* Whether the memo holds for a prompt whose first hashes are `items` (n of them) at `now`:
 * 1, or 2 if it is a memo of the prompt's chain that no longer holds (its way is the one to
 * make again), 0 if it is another chain's (or none). */
static int memo_holds(Index *ix, Memo *m, PyObject **items, Py_ssize_t n, double now) {
    if (m->common == NULL || m->j > n)
        return 0;
    for (Py_ssize_t k = m->j - 1; k >= 0; k--) /* from the end: chains that start alike differ there */
        if (!is_hash(items[k], m->hashes[k]))
            return 0;
    if (!(now >= m->since && now < m->until)) /* (NaN: no) */
        return 2;
    for (Py_ssize_t k = 0; k < m->j; k++) {
        int32_t e = find(ix, m->hashes[k]);
        if (e < 0 || ix->ent[e].ver > m->vgen)
            return 2;
    }
    return 1;
}

/* Make the memo of the chain's first j entries (`alive`: the workers alive through them,
 * `dropped`: those that left it before), true from `now` until `until`. */
static int memo_make(Index *ix, Memo *m, PyObject **items, Py_ssize_t j, const int32_t *alive,
                     Py_ssize_t alive_n, PyObject *dropped, double now, double until) {
    memo_clear(m);
    if (j > m->cap || alive_n > m->cap) {
        Py_ssize_t cap = j > alive_n ? j : alive_n;
        uint64_t *hs = PyMem_Realloc(m->hashes, (size_t)cap * sizeof(uint64_t));
        if (hs == NULL)
            goto nomem;
        m->hashes = hs;
        int32_t *al = PyMem_Realloc(m->alive, (size_t)cap * sizeof(int32_t));
        if (al == NULL)
            goto nomem;
        m->alive = al;
        m->cap = cap;
    }
    for (Py_ssize_t k = 0; k < j; k++)
        if (as_hash(items[k], &m->hashes[k]) < 0)
            return -1;
    PyObject *common = PyFrozenSet_New(NULL);
    if (common == NULL)
        return -1;
    for (Py_ssize_t k = 0; k < alive_n; k++) {
        if (PySet_Add(common, ix->w[alive[k]].name) < 0) {
            Py_DECREF(common);
            return -1;
        }
    }
    PyObject *d = PyDict_Copy(dropped);
    if (d == NULL) {
        Py_DECREF(common);
        return -1;
    }
    memcpy(m->alive, alive, (size_t)alive_n * sizeof(int32_t));
    m->alive_n = alive_n;
    m->common = common;
    m->dropped = d;
    m->j = j;
    m->vgen = ix->vgen;
    m->since = now;
    m->until = until;
    m->used = ++ix->memo_clock;
    if (now > ix->since_max)
        ix->since_max = now;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

static int scratch_for(Index *ix, Py_ssize_t n) {
    if (n <= ix->scratch_cap)
        return 0;
    int32_t *s = PyMem_Realloc(ix->scratch, (size_t)n * 2 * sizeof(int32_t));
    if (s == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ix->scratch = s;
    ix->scratch_cap = n * 2;
    return 0;
}

static PyObject *empty_set; /* the `common` of a match without a memo */

/* match(hashes, now_s) -> {worker: leading entries held}, and (with `split`)
 * match_split(hashes, now_s) -> (common, common_blocks, own): the same answer as the workers
 * of `own` with their counts, and every other worker of `common` holding `common_blocks`.
 * `common` is a memo's frozenset (the same object while the memo holds) or empty: a chain
 * that many workers hold is walked once per change of its holds, and a decision never lists
 * its holders. Without `split` no memo is read or made. */
static PyObject *match_impl(Index *ix, PyObject *const *args, Py_ssize_t nargs, int split) {
    if (!ready(ix))
        return NULL;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes hashes and now_s", split ? "match_split" : "match");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[1]);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "hashes must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *own = NULL, *common = NULL;
    Py_ssize_t cb = 0, i = 0, alive_n = 0;
    int32_t *alive = NULL;
    uint64_t cur = 0;
    double until = INFINITY; /* the earliest time of a hold alive so far */
    Memo *m = NULL;
    if (n > 0 && split) {
        uint64_t h0;
        if (as_hash(items[0], &h0) < 0)
            goto fail;
        Memo *set = &ix->memo[(mix(h0 ^ 0x5bd1e9955bd1e995ULL) * MEMO_WAYS) & (MEMO_SLOTS - 1)];
        int held = 0;
        Memo *stale = NULL;
        for (int w = 0; w < MEMO_WAYS && held != 1; w++) {
            m = &set[w];
            held = memo_holds(ix, m, items, n, now);
            if (held == 2 && stale == NULL)
                stale = m;
        }
        if (held != 1) {
            held = 0;
            /* The way a new memo goes to: the one of this chain that no longer holds (else a
             * chain asked for often and changing often would push the others out), else an
             * empty one, else the least recently used. */
            m = stale;
            if (m == NULL) {
                m = &set[0];
                for (int w = 1; w < MEMO_WAYS && m->common != NULL; w++)
                    if (set[w].common == NULL || set[w].used < m->used)
                        m = &set[w];
            }
        }
        if (held) {
            m->used = ++ix->memo_clock;
            /* Only the memo's survivors through its entries, from the holders of the next. */
            if ((own = PyDict_Copy(m->dropped)) == NULL)
                goto fail;
            common = m->common;
            Py_INCREF(common);
            cb = i = m->j;
            cur = ++ix->gen;
            for (Py_ssize_t k = 0; k < m->alive_n; k++)
                ix->w[m->alive[k]].mark = cur;
            if (i < n) {
                uint64_t h;
                if (as_hash(items[i], &h) < 0)
                    goto fail;
                int32_t e = find(ix, h);
                uint64_t next = ++ix->gen;
                if (e >= 0) {
                    Entry *E = &ix->ent[e];
                    if (scratch_for(ix, (Py_ssize_t)E->n) < 0)
                        goto fail;
                    alive = ix->scratch;
                    Hold *hs = holds_of(E);
                    for (uint32_t k = 0; k < E->n; k++) {
                        Worker *W = &ix->w[hs[k].slot];
                        if (W->mark == cur && hs[k].until > now) {
                            W->mark = next;
                            alive[alive_n++] = hs[k].slot;
                        }
                    }
                }
                cur = next;
                i++;
            }
            m = NULL; /* no memo to make */
        }
    }
    if (own == NULL && (own = PyDict_New()) == NULL)
        goto fail;
    for (; i < n && (i == 0 || alive_n > 0); i++) {
        uint64_t h;
        if (as_hash(items[i], &h) < 0)
            goto fail;
        int32_t e = find(ix, h);
        uint64_t next = ++ix->gen;
        Entry *E = e >= 0 ? &ix->ent[e] : NULL;
        if (i == 0) {
            if (E == NULL)
                break;
            if (scratch_for(ix, (Py_ssize_t)E->n) < 0)
                goto fail;
            alive = ix->scratch;
            Hold *hs = holds_of(E);
            for (uint32_t k = 0; k < E->n; k++) {
                if (hs[k].until > now) {
                    ix->w[hs[k].slot].mark = next;
                    alive[alive_n++] = hs[k].slot;
                    if (hs[k].until < until)
                        until = hs[k].until;
                }
            }
            cur = next;
            continue;
        }
        Py_ssize_t kept = 0;
        double until_here = INFINITY;
        if (E != NULL) {
            Hold *hs = holds_of(E);
            for (uint32_t k = 0; k < E->n; k++) {
                Worker *W = &ix->w[hs[k].slot];
                if (W->mark == cur && hs[k].until > now) {
                    W->mark = next;
                    kept++;
                    if (hs[k].until < until_here)
                        until_here = hs[k].until;
                }
            }
        }
        int memoized = 0;
        if (m != NULL && alive_n >= ix->memo_min && kept < ix->memo_min) {
            /* The chain's first i entries are what many workers hold: the memo. */
            if (memo_make(ix, m, items, i, alive, alive_n, own, now, until) < 0)
                goto fail;
            common = m->common;
            Py_INCREF(common);
            cb = i;
            m = NULL;
            memoized = 1;
        }
        if (until_here < until)
            until = until_here;
        Py_ssize_t kk = 0;
        for (Py_ssize_t k = 0; k < alive_n; k++) {
            Worker *W = &ix->w[alive[k]];
            if (W->mark == next) {
                alive[kk++] = alive[k];
                continue;
            }
            if (memoized)
                continue; /* in `common`, holding cb */
            PyObject *v = PyLong_FromSsize_t(i);
            if (v == NULL || PyDict_SetItem(own, W->name, v) < 0) {
                Py_XDECREF(v);
                goto fail;
            }
            Py_DECREF(v);
        }
        alive_n = kk;
        cur = next;
    }
    if (alive_n > 0 && m != NULL && alive_n >= ix->memo_min && i == n) {
        /* The whole prompt is what many workers hold. */
        if (memo_make(ix, m, items, n, alive, alive_n, own, now, until) < 0)
            goto fail;
        common = m->common;
        Py_INCREF(common);
        cb = n;
        alive_n = 0;
    }
    if (alive_n > 0) {
        PyObject *v = PyLong_FromSsize_t(i);
        if (v == NULL)
            goto fail;
        for (Py_ssize_t k = 0; k < alive_n; k++) {
            if (PyDict_SetItem(own, ix->w[alive[k]].name, v) < 0) {
                Py_DECREF(v);
                goto fail;
            }
        }
        Py_DECREF(v);
    }
    Py_DECREF(seq);
    if (!split)
        return own; /* (no memo: common is NULL) */
    if (common == NULL) {
        common = empty_set;
        Py_INCREF(common);
    }
    return Py_BuildValue("(NnN)", common, cb, own);
fail:
    Py_DECREF(seq);
    Py_XDECREF(own);
    Py_XDECREF(common);
    return NULL;
}

static PyObject *Index_match(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    return match_impl(ix, args, nargs, 0);
}

static PyObject *Index_match_split(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    return match_impl(ix, args, nargs, 1);
}

/* Whether seq != last + 1 (Python ints: a digest number has no bound); -1 on error. */
static int not_next(PyObject *last, PyObject *seq) {
    PyObject *one = PyLong_FromLong(1);
    PyObject *want = one ? PyNumber_Add(last, one) : NULL;
    Py_XDECREF(one);
    if (want == NULL)
        return -1;
    int ne = PyObject_RichCompareBool(seq, want, Py_NE);
    Py_DECREF(want);
    return ne;
}

/* apply_delta(worker_id, seq, stored, evicted, now_s) */
static PyObject *Index_apply_delta(Index *ix, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"worker_id", "seq", "stored", "evicted", "now_s", NULL};
    PyObject *name, *seqno, *stored, *evicted;
    double now;
    if (!ready(ix) ||
        !PyArg_ParseTupleAndKeywords(args, kwds, "UOOOd", kw, &name, &seqno, &stored, &evicted, &now))
        return NULL;
    /* Every sequence first (consuming one runs Python code), then the slot. */
    PyObject *ev = PySequence_Fast(evicted, "evicted must be a sequence of ints");
    if (ev == NULL)
        return NULL;
    PyObject *st = PySequence_Fast(stored, "stored must be a sequence of ints");
    if (st == NULL) {
        Py_DECREF(ev);
        return NULL;
    }
    int32_t slot = slot_of(ix, name, 1);
    int differs = 0;
    if (slot >= 0 && !ix->w[slot].stale && ix->w[slot].seq != NULL) {
        PyObject *last = ix->w[slot].seq;
        Py_INCREF(last);
        differs = not_next(last, seqno); /* runs Python code: no Worker pointer is held */
        Py_DECREF(last);
    }
    if (slot < 0 || differs < 0) {
        Py_DECREF(ev);
        Py_DECREF(st);
        return NULL;
    }
    Worker *W = &ix->w[slot];
    if (W->stale || differs) {
        W->stale = 1;
        Py_DECREF(ev);
        Py_DECREF(st);
        Py_RETURN_FALSE;
    }
    Py_INCREF(seqno);
    Py_XSETREF(W->seq, seqno);
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(ev); k++) {
        uint64_t h;
        if (as_hash(PySequence_Fast_GET_ITEM(ev, k), &h) < 0 || unreport(ix, slot, h, 1) < 0) {
            Py_DECREF(ev);
            Py_DECREF(st);
            return NULL;
        }
    }
    Py_DECREF(ev);
    W = &ix->w[slot];
    if (W->reported == NULL && (W->reported = PySet_New(NULL)) == NULL) {
        Py_DECREF(st);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(st); k++) {
        PyObject *o = PySequence_Fast_GET_ITEM(st, k);
        uint64_t h;
        if (as_hash(o, &h) < 0 || report(ix, h, slot) < 0 || PySet_Add(ix->w[slot].reported, o) < 0) {
            Py_DECREF(st);
            return NULL;
        }
    }
    Py_DECREF(st);
    if (trim(ix) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* apply_snapshot(worker_id, seq, blocks, now_s) */
static PyObject *Index_apply_snapshot(Index *ix, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"worker_id", "seq", "blocks", "now_s", NULL};
    PyObject *name, *seqno, *blocks;
    double now;
    if (!ready(ix) || !PyArg_ParseTupleAndKeywords(args, kwds, "UOOd", kw, &name, &seqno, &blocks, &now))
        return NULL;
    PyObject *keep = PySet_New(blocks);
    if (keep == NULL)
        return NULL;
    /* Every hash checked before anything changes: one bad item must leave the worker's
     * reports as they were (not half replaced, its old blocks held with nothing to drop them). */
    PyObject *all = PyObject_GetIter(keep), *item;
    uint64_t checked;
    while (all != NULL && (item = PyIter_Next(all)) != NULL) {
        int rc = as_hash(item, &checked);
        Py_DECREF(item);
        if (rc < 0)
            break;
    }
    Py_XDECREF(all);
    if (PyErr_Occurred()) {
        Py_DECREF(keep);
        return NULL;
    }
    int32_t slot = slot_of(ix, name, 1);
    if (slot < 0) {
        Py_DECREF(keep);
        return NULL;
    }
    PyObject *old = ix->w[slot].reported;
    if (old == NULL && (old = PySet_New(NULL)) == NULL) {
        Py_DECREF(keep);
        return NULL;
    }
    if (ix->w[slot].reported == NULL)
        ix->w[slot].reported = old; /* so that unreport() discards from it, as the reference */
    PyObject *gone = PyNumber_Subtract(old, keep);
    PyObject *it = gone ? PyObject_GetIter(gone) : NULL;
    PyObject *o;
    uint64_t h;
    while (it && (o = PyIter_Next(it)) != NULL) {
        int rc = as_hash(o, &h) < 0 ? -1 : unreport(ix, slot, h, 0);
        Py_DECREF(o);
        if (rc < 0)
            break;
    }
    Py_XDECREF(it);
    Py_XDECREF(gone);
    if (PyErr_Occurred()) {
        Py_DECREF(keep);
        return NULL;
    }
    PyObject *fresh = PyNumber_Subtract(keep, ix->w[slot].reported);
    it = fresh ? PyObject_GetIter(fresh) : NULL;
    while (it && (o = PyIter_Next(it)) != NULL) {
        int rc = as_hash(o, &h) < 0 ? -1 : report(ix, h, slot);
        Py_DECREF(o);
        if (rc < 0)
            break;
    }
    Py_XDECREF(it);
    Py_XDECREF(fresh);
    if (PyErr_Occurred()) {
        Py_DECREF(keep);
        return NULL;
    }
    Worker *W = &ix->w[slot];
    Py_XSETREF(W->reported, keep);
    Py_INCREF(seqno);
    Py_XSETREF(W->seq, seqno);
    W->stale = 0;
    if (trim(ix) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Index_needs_snapshot(Index *ix, PyObject *name) {
    if (!ready(ix))
        return NULL;
    int32_t slot = slot_of(ix, name, 0);
    if (slot == -2)
        return NULL;
    return PyBool_FromLong(slot >= 0 && ix->w[slot].stale);
}

static PyObject *Index_reported_blocks(Index *ix, PyObject *name) {
    if (!ready(ix))
        return NULL;
    int32_t slot = slot_of(ix, name, 0);
    if (slot == -2)
        return NULL;
    PyObject *r = slot >= 0 ? ix->w[slot].reported : NULL;
    return PyLong_FromSsize_t(r ? PySet_GET_SIZE(r) : 0);
}

static PyObject *Index_holders(Index *ix, PyObject *const *args, Py_ssize_t nargs) {
    if (!ready(ix))
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "holders() takes block_hash and now_s");
        return NULL;
    }
    uint64_t h;
    double now = PyFloat_AsDouble(args[1]);
    if ((now == -1.0 && PyErr_Occurred()) || as_hash(args[0], &h) < 0)
        return NULL;
    PyObject *out = PySet_New(NULL);
    int32_t e = find(ix, h);
    if (out == NULL || e < 0)
        return out;
    Entry *E = &ix->ent[e];
    Hold *hs = holds_of(E);
    for (uint32_t k = 0; k < E->n; k++) {
        if (hs[k].until > now && PySet_Add(out, ix->w[hs[k].slot].name) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *Index_blocks_of(Index *ix, PyObject *name) {
    if (!ready(ix))
        return NULL;
    int32_t slot = slot_of(ix, name, 0);
    if (slot == -2)
        return NULL;
    Py_ssize_t n = 0;
    for (int32_t e = ix->head; slot >= 0 && e >= 0; e = ix->ent[e].next)
        n += hold_at(&ix->ent[e], slot) >= 0;
    return PyLong_FromSsize_t(n);
}

static PyObject *Index_remove_worker(Index *ix, PyObject *name) {
    if (!ready(ix))
        return NULL;
    int32_t slot = slot_of(ix, name, 0);
    if (slot == -2)
        return NULL;
    if (slot < 0)
        Py_RETURN_NONE;
    for (int32_t e = ix->head; e >= 0;) {
        Entry *E = &ix->ent[e];
        int32_t next = E->next;
        int32_t i = hold_at(E, slot);
        if (i >= 0) {
            drop_hold(ix, E, (uint32_t)i);
            if (E->n == 0)
                delete_entry(ix, e);
        }
        e = next;
    }
    if (PyDict_DelItem(ix->slots, name) < 0)
        return NULL;
    Worker *W = &ix->w[slot];
    Py_CLEAR(W->name);
    Py_CLEAR(W->reported);
    Py_CLEAR(W->seq);
    W->stale = 0;
    W->next_free = ix->w_free;
    ix->w_free = slot;
    Py_RETURN_NONE;
}

static int expire_one(Index *ix, uint64_t h, double now) {
    int32_t e = find(ix, h);
    if (e < 0)
        return 0;
    Entry *E = &ix->ent[e];
    Hold *hs = holds_of(E);
    double least = NO_GUESS;
    for (uint32_t k = 0; k < E->n; k++)
        if (k == 0 || hs[k].until < least)
            least = hs[k].until;
    if (E->n > 0 && least > now)
        return 0;
    for (uint32_t k = 0; k < E->n;) {
        if (hs[k].until <= now)
            drop_hold(ix, E, k);
        else
            k++;
    }
    if (E->n == 0) {
        delete_entry(ix, e);
        return 1;
    }
    return 0;
}

/* expire(now_s, max_blocks=None) */
static PyObject *Index_expire(Index *ix, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"now_s", "max_blocks", NULL};
    double now;
    PyObject *mb = Py_None;
    if (!ready(ix) || !PyArg_ParseTupleAndKeywords(args, kwds, "d|O", kw, &now, &mb))
        return NULL;
    Py_ssize_t freed = 0;
    if (mb == Py_None) {
        for (int32_t e = ix->head; e >= 0;) {
            int32_t next = ix->ent[e].next;
            freed += expire_one(ix, ix->ent[e].hash, now);
            e = next;
        }
        return PyLong_FromSsize_t(freed);
    }
    if (!PyLong_Check(mb)) {
        PyErr_Format(PyExc_TypeError, "max_blocks must be an int or None, not %.100s", Py_TYPE(mb)->tp_name);
        return NULL;
    }
    int overflow = 0;
    long long m_ll = PyLong_AsLongLongAndOverflow(mb, &overflow);
    if (m_ll == -1 && PyErr_Occurred())
        return NULL;
    if (overflow < 0 || (overflow == 0 && m_ll < 0)) {
        PyErr_SetString(PyExc_ValueError, "max_blocks must be >= 0");
        return NULL;
    }
    /* A bound past every block is every block (the reference slices a list). */
    Py_ssize_t m = overflow > 0 || m_ll > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : (Py_ssize_t)m_ll;
    if (ix->sweep_at >= ix->sweep_n) {
        if (ix->count > ix->sweep_cap) {
            uint64_t *s = PyMem_Realloc(ix->sweep, (size_t)ix->count * sizeof(uint64_t));
            if (s == NULL)
                return PyErr_NoMemory();
            ix->sweep = s;
            ix->sweep_cap = ix->count;
        }
        ix->sweep_n = 0;
        for (int32_t e = ix->head; e >= 0; e = ix->ent[e].next)
            ix->sweep[ix->sweep_n++] = ix->ent[e].hash;
        ix->sweep_at = 0;
    }
    Py_ssize_t end = m < ix->sweep_n - ix->sweep_at ? ix->sweep_at + m : ix->sweep_n;
    for (Py_ssize_t k = ix->sweep_at; k < end; k++)
        freed += expire_one(ix, ix->sweep[k], now);
    ix->sweep_at = end;
    return PyLong_FromSsize_t(freed);
}

/* ------------------------------------------------------------------ one call at a time */

/* A call may run Python code midway (consuming an iterable, a collection's callbacks or a
 * finaliser when it allocates): code that called the index again there would change the
 * arrays and memos the call is working on. It is refused instead (RuntimeError). */
static int enter(Index *ix) {
    if (ix->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "CacheIndex called while another of its calls runs (from Python code "
                        "that call ran: an iterable, a finaliser, a garbage collection's callback)");
        return -1;
    }
    ix->busy = 1;
    return 0;
}

#define ONE_FASTKW(f)                                                                      \
    static PyObject *f##_one(Index *ix, PyObject *const *a, Py_ssize_t n, PyObject *k) { \
        if (enter(ix) < 0)                                                                 \
            return NULL;                                                                   \
        PyObject *r = f(ix, a, n, k);                                                      \
        ix->busy = 0;                                                                      \
        return r;                                                                          \
    }
#define ONE_FAST(f)                                                          \
    static PyObject *f##_one(Index *ix, PyObject *const *a, Py_ssize_t n) { \
        if (enter(ix) < 0)                                                   \
            return NULL;                                                     \
        PyObject *r = f(ix, a, n);                                           \
        ix->busy = 0;                                                        \
        return r;                                                            \
    }
#define ONE_KW(f)                                                         \
    static PyObject *f##_one(Index *ix, PyObject *a, PyObject *k) {      \
        if (enter(ix) < 0)                                                \
            return NULL;                                                  \
        PyObject *r = f(ix, a, k);                                        \
        ix->busy = 0;                                                     \
        return r;                                                         \
    }
#define ONE_O(f)                                         \
    static PyObject *f##_one(Index *ix, PyObject *o) {  \
        if (enter(ix) < 0)                               \
            return NULL;                                 \
        PyObject *r = f(ix, o);                          \
        ix->busy = 0;                                    \
        return r;                                        \
    }

ONE_FASTKW(Index_guess)
ONE_FASTKW(Index_completed)
ONE_FAST(Index_match)
ONE_FAST(Index_match_split)
ONE_KW(Index_apply_delta)
ONE_KW(Index_apply_snapshot)
ONE_O(Index_needs_snapshot)
ONE_O(Index_reported_blocks)
ONE_FAST(Index_holders)
ONE_O(Index_blocks_of)
ONE_O(Index_remove_worker)
ONE_KW(Index_expire)

static PyMethodDef Index_methods[] = {
    {"guess", (PyCFunction)(void (*)(void))Index_guess_one, METH_FASTCALL | METH_KEYWORDS,
     "guess(worker_id, hashes, now_s): the dispatcher routed these prefix blocks to the worker."},
    {"completed", (PyCFunction)(void (*)(void))Index_completed_one, METH_FASTCALL | METH_KEYWORDS,
     "completed(worker_id, hashes, now_s): a request with these blocks finished on the worker."},
    {"match", (PyCFunction)(void (*)(void))Index_match_one, METH_FASTCALL,
     "match(hashes, now_s) -> {worker: leading blocks held}."},
    {"match_split", (PyCFunction)(void (*)(void))Index_match_split_one, METH_FASTCALL,
     "match_split(hashes, now_s) -> (common, common_blocks, own): match() as a set of workers "
     "holding common_blocks and the others' counts."},
    {"apply_delta", (PyCFunction)(void (*)(void))Index_apply_delta_one, METH_VARARGS | METH_KEYWORDS,
     "apply_delta(worker_id, seq, stored, evicted, now_s) -> False if a delta was missed."},
    {"apply_snapshot", (PyCFunction)(void (*)(void))Index_apply_snapshot_one, METH_VARARGS | METH_KEYWORDS,
     "apply_snapshot(worker_id, seq, blocks, now_s): replace what the worker reported."},
    {"needs_snapshot", (PyCFunction)Index_needs_snapshot_one, METH_O, "True after a missed delta."},
    {"reported_blocks", (PyCFunction)Index_reported_blocks_one, METH_O,
     "How many of the index's blocks the worker's own reports list."},
    {"holders", (PyCFunction)(void (*)(void))Index_holders_one, METH_FASTCALL,
     "holders(block_hash, now_s) -> the workers holding the block."},
    {"blocks_of", (PyCFunction)Index_blocks_of_one, METH_O,
     "How many blocks hold anything of the worker (alive or not)."},
    {"remove_worker", (PyCFunction)Index_remove_worker_one, METH_O, "Forget everything about a worker."},
    {"expire", (PyCFunction)(void (*)(void))Index_expire_one, METH_VARARGS | METH_KEYWORDS,
     "expire(now_s, max_blocks=None) -> blocks freed."},
    {NULL, NULL, 0, NULL},
};

static PyObject *Index_get_max_blocks(Index *ix, void *c) { return PyLong_FromSsize_t(ix->max_blocks); }
static PyObject *Index_get_ttl(Index *ix, void *c) { return PyFloat_FromDouble(ix->guess_ttl_s); }
static PyObject *Index_get_memo_min(Index *ix, void *c) { return PyLong_FromSsize_t(ix->memo_min); }

static PyGetSetDef Index_getset[] = {
    {"max_blocks", (getter)Index_get_max_blocks, NULL, "Most block hashes kept.", NULL},
    {"guess_ttl_s", (getter)Index_get_ttl, NULL, "How long a guess holds.", NULL},
    {"memo_min_holders", (getter)Index_get_memo_min, NULL, "Holders a chain needs for a memo.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Index_as_sequence = {.sq_length = (lenfunc)Index_len};

static PyTypeObject IndexType = {
    .ob_base = PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sluice.dispatcher._cacheindex.CacheIndex",
    .tp_doc = "The cluster cache index in native data (PureCacheIndex's semantics).",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Index_init,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
    .tp_getset = Index_getset,
    .tp_as_sequence = &Index_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cacheindex", "The cluster cache index in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit__cacheindex(void) {
    if (PyType_Ready(&IndexType) < 0)
        return NULL;
    if (empty_set == NULL && (empty_set = PyFrozenSet_New(NULL)) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(m, "CacheIndex", (PyObject *)&IndexType) < 0) {
        Py_DECREF(&IndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

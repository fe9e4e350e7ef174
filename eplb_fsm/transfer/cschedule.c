/* A rearrangement's schedule for some local ranks, every layer in one call (optional C path).
 *
 * maps_valid(old, new, layers, slots) -> bool: plan_all.maps_valid's rules.
 *
 * rank_layers(old, new, layers, slots, world, ranks)
 *     old, new   (layers, slots) int64 phy2log, validated (ids in [-1, slots), every
 *                needed expert held); slots = world * S
 *     ranks      tuple of local ranks
 *   -> list over layers of (pairs, bounds, {rank: layer_tuple})
 *     pairs      ((src, dst), ...) every directed pair with a transfer, ascending
 *     bounds     (b0, ..., bn): pair i holds the layer's sorted transfers [b_i, b_{i+1})
 *     layer_tuple (sends, recvs, local_runs, direct_runs, direct_reads, commit_dst,
 *                 commit_src, commit_runs, staged_rows, split)
 *       sends ((peer, row), ...), recvs ((peer, row), ...): the rank's messages in
 *       posting order; runs ((dst, src, n), ...); split None on the last layer, else
 *       (direct_early, early_dst, early_src, early_runs, late_dst, late_src, late_runs)
 *       against the next layer.
 *
 * Every rule is the Python planner's (transfer/plan.py, plan_all.py, local_copies.py,
 * schedule.py): the same pairing, the same copy order, the same runs. The Python code
 * defines the result; tests/test_transfer_native_schedule.py compares both on random
 * maps. It exists because planning is on a cold rearrangement's critical path, where
 * the Python planner's few hundred small numpy calls took three to six times as long
 * (docs/transfer.md, "Planning in C"). This file builds the Python results; the
 * planning itself is in cschedule_plan.c.
 */
#include "cschedule.h"

#include <stdlib.h>
#include <string.h>

/* ---- Python object builders (NULL on failure, with the exception set) ---- */

static PyObject *ints(const int64_t *v, Py_ssize_t n)
{
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t != NULL && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (x == NULL) { Py_CLEAR(t); break; }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

static PyObject *pairs_of(const int64_t *a, const int64_t *b, Py_ssize_t n)
{
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t != NULL && i < n; i++) {
        PyObject *p = Py_BuildValue("(LL)", (long long)a[i], (long long)b[i]);
        if (p == NULL) { Py_CLEAR(t); break; }
        PyTuple_SET_ITEM(t, i, p);
    }
    return t;
}

/* schedule.row_runs: (dst, src, n) runs where both rows advance by one; with same_tensor
 * a run grows only while its dst and src ranges stay disjoint */
static PyObject *runs_of(const int64_t *dst, const int64_t *src, Py_ssize_t n, int same_tensor)
{
    int64_t *ra = malloc(sizeof(int64_t) * 3 * (size_t)(n + 1));
    if (ra == NULL) return PyErr_NoMemory();
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (m) {
            int64_t *r = ra + 3 * (m - 1);
            int64_t gap = r[0] - r[1];
            if (r[0] + r[2] == dst[i] && r[1] + r[2] == src[i] && (!same_tensor || (gap < 0 ? -gap : gap) > r[2])) {
                r[2]++;
                continue;
            }
        }
        ra[3 * m] = dst[i];
        ra[3 * m + 1] = src[i];
        ra[3 * m + 2] = 1;
        m++;
    }
    PyObject *t = PyTuple_New(m);
    for (Py_ssize_t i = 0; t != NULL && i < m; i++) {
        PyObject *x = Py_BuildValue("(LLL)", (long long)ra[3 * i], (long long)ra[3 * i + 1], (long long)ra[3 * i + 2]);
        if (x == NULL) { Py_CLEAR(t); break; }
        PyTuple_SET_ITEM(t, i, x);
    }
    free(ra);
    return t;
}

/* the split against the next layer as Python tuples (see the module comment) */
static PyObject *split_of(const RankLayer *prev, const RankLayer *nxt, int64_t *work)
{
    Py_ssize_t n = prev->n_commit, ne, nl;
    int64_t *e_dst = work, *e_src = work + n, *l_dst = work + 2 * n, *l_src = work + 3 * n;
    int direct_early = split_rows(prev, nxt, e_dst, e_src, &ne, l_dst, l_src, &nl);
    PyObject *ed = ints(e_dst, ne), *es = ints(e_src, ne), *er = runs_of(e_dst, e_src, ne, 0);
    PyObject *ld = ints(l_dst, nl), *ls = ints(l_src, nl), *lr = runs_of(l_dst, l_src, nl, 0);
    PyObject *res = NULL;
    if (ed && es && er && ld && ls && lr)
        res = Py_BuildValue("(OOOOOOO)", direct_early ? Py_True : Py_False, ed, es, er, ld, ls, lr);
    Py_XDECREF(ed); Py_XDECREF(es); Py_XDECREF(er); Py_XDECREF(ld); Py_XDECREF(ls); Py_XDECREF(lr);
    return res;
}

static PyObject *rank_tuple(const RankLayer *x, const Transfer *t, Py_ssize_t nt, int64_t r, PyObject *split,
                            int64_t *work)
{
    int64_t *a = work, *b = work + nt;
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < nt; i++)
        if (t[i].src == r) { a[m] = t[i].dst; b[m++] = t[i].src_row; }
    PyObject *sends = pairs_of(a, b, m);
    m = 0;
    for (Py_ssize_t i = 0; i < nt; i++)
        if (t[i].dst == r) { a[m] = t[i].src; b[m++] = t[i].dst_row; }
    PyObject *recvs = pairs_of(a, b, m);
    PyObject *items[9] = {
        sends, recvs,
        runs_of(x->staged_dst, x->staged_src, x->n_staged, 0),
        runs_of(x->direct_dst, x->direct_src, x->n_direct, 1),
        ints(x->direct_src, x->n_direct),
        ints(x->dst, x->n_commit),
        ints(x->src, x->n_commit),
        runs_of(x->dst, x->src, x->n_commit, 0),
        ints(x->staged_dst, x->n_staged),
    };
    PyObject *res = NULL;
    int ok = 1;
    for (int i = 0; i < 9; i++) ok &= items[i] != NULL;
    if (ok)
        res = Py_BuildValue("(OOOOOOOOOO)", items[0], items[1], items[2], items[3], items[4], items[5], items[6],
                            items[7], items[8], split);
    for (int i = 0; i < 9; i++) Py_XDECREF(items[i]);
    return res;
}

static PyObject *rank_layers(PyObject *self, PyObject *args)
{
    Py_buffer ob, nb;
    Py_ssize_t layers, p, g;
    PyObject *ranks;
    if (!PyArg_ParseTuple(args, "y*y*nnnO!", &ob, &nb, &layers, &p, &g, &PyTuple_Type, &ranks)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t nr = PyTuple_GET_SIZE(ranks), s = g > 0 ? p / g : 0;
    if (layers < 0 || p < 1 || g < 1 || p % g || nr < 1 || ob.len != layers * p * (Py_ssize_t)sizeof(int64_t)
        || nb.len != ob.len) {
        PyErr_SetString(PyExc_ValueError, "rank_layers: buffer sizes do not match (layers, slots, world, ranks)");
        PyBuffer_Release(&ob);
        PyBuffer_Release(&nb);
        return NULL;
    }
    int64_t *rank_ids = malloc(sizeof(int64_t) * (size_t)nr);
    Transfer *t = malloc(sizeof(Transfer) * (size_t)p);
    int64_t *ints_work = malloc(sizeof(int64_t) * (size_t)(2 * g * p + 4 * p + 8 * s + 8));
    RankLayer *rl = calloc((size_t)(2 * nr), sizeof(RankLayer)); /* this layer's and the previous one's */
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)(2 * nr) * (size_t)(8 * s + 1));
    char *marks = malloc((size_t)(2 * nr) * (size_t)(s + 1));
    Transfer *prev_t = malloc(sizeof(Transfer) * (size_t)p); /* the previous layer's, emitted one layer late */
    int64_t *msg_work = malloc(sizeof(int64_t) * (size_t)(4 * p + 8));
    PyObject *out = PyList_New(0), **pair_cache = calloc((size_t)(g * g), sizeof(PyObject *));
    if (!rank_ids || !t || !ints_work || !rl || !rows || !marks || !prev_t || !msg_work || !out || !pair_cache) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nr; i++) {
        rank_ids[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(ranks, i));
        if (rank_ids[i] < 0 || rank_ids[i] >= g) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "rank_layers: a rank is outside the group");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < 2 * nr; i++) {
        int64_t *base = rows + i * (8 * s + 1);
        rl[i] = (RankLayer){base, base + s, 0, base + 2 * s, base + 3 * s, 0, base + 4 * s, base + 5 * s, 0,
                            marks + i * (s + 1)};
    }
    int64_t *old_first = ints_work, *new_first = old_first + g * p, *n_hold = new_first + g * p;
    int64_t *n_recv = n_hold + p, *hold_at = n_recv + p, *holders = hold_at + p, *scratch = holders + p;
    for (Py_ssize_t i = 0; i < 2 * g * p; i++) old_first[i] = -1; /* new_first follows it */
    const int64_t *old = ob.buf, *nw = nb.buf;
    Py_ssize_t prev_nt = 0;
    /* layer l is emitted once layer l+1 is planned (its split needs it) */
    for (Py_ssize_t l = 0; l <= layers; l++) {
        RankLayer *cur = rl + (l % 2) * nr, *prv = rl + ((l + 1) % 2) * nr;
        Py_ssize_t nt = 0;
        if (l < layers) {
            const int64_t *o = old + l * p, *n = nw + l * p;
            nt = layer_transfers(o, n, p, g, s, t, old_first, new_first, n_hold, n_recv, hold_at, holders);
            for (Py_ssize_t i = 0; i < nr; i++)
                plan_rank(o + rank_ids[i] * s, n + rank_ids[i] * s, s, t, nt, rank_ids[i], cur + i, scratch);
        }
        if (l > 0) { /* emit layer l - 1 */
            PyObject *per_rank = PyDict_New(), *item = NULL;
            int64_t *a = msg_work, *b = msg_work + p;
            Py_ssize_t m = 0;
            for (Py_ssize_t i = 0; i < prev_nt; i++)
                if (i == 0 || prev_t[i].src != prev_t[i - 1].src || prev_t[i].dst != prev_t[i - 1].dst) {
                    a[m] = prev_t[i].src;
                    b[m] = prev_t[i].dst;
                    msg_work[2 * p + m++] = i;
                }
            msg_work[2 * p + m] = prev_nt;
            PyObject *pairs = PyTuple_New(m), *bounds = ints(msg_work + 2 * p, prev_nt ? m + 1 : 0);
            for (Py_ssize_t i = 0; pairs != NULL && i < m; i++) {
                /* one (src, dst) tuple per pair for the whole call: DeepSeek-V3 EP32 has ~250
                 * pairs a layer, and 14k fresh tuples would push the GC toward a full pass */
                PyObject **cached = pair_cache + a[i] * g + b[i];
                if (*cached == NULL) *cached = Py_BuildValue("(LL)", (long long)a[i], (long long)b[i]);
                if (*cached == NULL) { Py_CLEAR(pairs); break; }
                Py_INCREF(*cached);
                PyTuple_SET_ITEM(pairs, i, *cached);
            }
            int ok = per_rank && pairs && bounds;
            for (Py_ssize_t i = 0; ok && i < nr; i++) {
                PyObject *split = l < layers ? split_of(prv + i, cur + i, msg_work) : (Py_INCREF(Py_None), Py_None);
                PyObject *rt = split ? rank_tuple(prv + i, prev_t, prev_nt, rank_ids[i], split, msg_work) : NULL;
                PyObject *key = PyLong_FromLongLong(rank_ids[i]);
                ok = rt && key && PyDict_SetItem(per_rank, key, rt) == 0;
                Py_XDECREF(split); Py_XDECREF(rt); Py_XDECREF(key);
            }
            if (ok) item = Py_BuildValue("(OOO)", pairs, bounds, per_rank);
            ok = item && PyList_Append(out, item) == 0;
            Py_XDECREF(pairs); Py_XDECREF(bounds); Py_XDECREF(per_rank); Py_XDECREF(item);
            if (!ok) goto done;
        }
        memcpy(prev_t, t, sizeof(Transfer) * (size_t)nt);
        prev_nt = nt;
    }
    result = out;
    out = NULL;
done:
    for (Py_ssize_t i = 0; pair_cache != NULL && i < g * g; i++) Py_XDECREF(pair_cache[i]);
    free(pair_cache);
    free(rank_ids); free(t); free(ints_work); free(rl); free(rows); free(marks); free(prev_t); free(msg_work);
    Py_XDECREF(out);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&nb);
    return result;
}

/* plan_all.maps_valid: ids in [-1, P) and every needed expert held in its layer */
static PyObject *maps_valid(PyObject *self, PyObject *args)
{
    Py_buffer ob, nb;
    Py_ssize_t layers, p;
    if (!PyArg_ParseTuple(args, "y*y*nn", &ob, &nb, &layers, &p)) return NULL;
    if (layers < 0 || p < 1 || ob.len != layers * p * (Py_ssize_t)sizeof(int64_t) || nb.len != ob.len) {
        PyBuffer_Release(&ob);
        PyBuffer_Release(&nb);
        PyErr_SetString(PyExc_ValueError, "maps_valid: buffer sizes do not match (layers, slots)");
        return NULL;
    }
    const int64_t *old = ob.buf, *nw = nb.buf;
    int64_t *held_in = malloc(sizeof(int64_t) * (size_t)p); /* layer + 1 where the layer holds the expert */
    int ok = held_in != NULL;
    for (Py_ssize_t e = 0; ok && e < p; e++) held_in[e] = 0;
    for (Py_ssize_t l = 0; ok && l < layers; l++) {
        for (Py_ssize_t i = 0; ok && i < p; i++) {
            int64_t e = old[l * p + i];
            if (e < -1 || e >= p) ok = 0;
            else if (e >= 0) held_in[e] = l + 1;
        }
        for (Py_ssize_t i = 0; ok && i < p; i++) {
            int64_t e = nw[l * p + i];
            if (e < -1 || e >= p || (e >= 0 && held_in[e] != l + 1)) ok = 0;
        }
    }
    int no_memory = held_in == NULL;
    free(held_in);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&nb);
    if (no_memory) return PyErr_NoMemory();
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"maps_valid", maps_valid, METH_VARARGS, "Whether (L, P) int64 maps pass the schedule's checks."},
    {"rank_layers", rank_layers, METH_VARARGS, "Every layer's schedule for some local ranks (see the module comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cschedule", NULL, -1, methods};

PyMODINIT_FUNC PyInit_cschedule(void) { return PyModule_Create(&module); }

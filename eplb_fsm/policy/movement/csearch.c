/* The movement-aware search in C: the Python module (eplb_fsm/policy/movement/native.py
 * is its Python face; csearch.h says how the loops follow the numpy code).
 *
 * `state` is a tuple of SearchState's arrays, in this order (flat, C order, numpy's own
 * arrays: run() updates them in place):
 *     w (A*N) float64, count (A*N) int64, cur (A*P) int64, slot_load (A*P) float64,
 *     rank_load (A*G) float64, on_rank (A*N*G) int8, held (A*N*G) int8, moved (A*P) int8,
 *     node (A*N) int64, moves (A) int64, limit (A) int64, goal (A) float64
 * and `dims` the tuple (A, N, P, G, nodes).
 *
 * run(state, dims, budget, fixed_max, max_rounds, rounds) -> rounds
 *     SearchState.run: the whole local search, in place.
 * rebalance_counts(state, dims, cap)
 *     search.rebalance_counts, in place; cap (A) float64.
 * repoints(state, dims, lr, eff, rank, new, donor, cost, after)
 *     moves.repoints for the live layers lr (n) int64 (rows of A), their rank loads and
 *     goals read from the state: writes eff (n) float64, rank / new / donor / cost (n)
 *     int64, after (n*G) float64.
 * pair_swaps(state, dims, lr, pr, eff, slot_a, slot_b, o, u, cost, delta) -> M
 *     moves.pair_swaps: the M pairs in the first M entries of the eight outputs (room
 *     for n * nodes * (G / nodes / 2)); pr indexes lr.
 * widened_choice(state, dims, lr, found, slot_a, slot_b)
 *     the swap moves.widened_swap would apply to each layer (found (n) int8, slots (n)
 *     int64); applies nothing.
 * lagrange_levels(rank_loads, floor, budget, goal, n, G)
 *     targets.lagrange_levels: rank_loads (n*G), floor (n) float64; writes goal (n).
 * rank_counts(phy2log, out, L, N, P, G)
 *     placement.rank_counts for fewer than 128 slots per rank: phy2log (L*P) int64 (-1
 *     empty, ignored); writes out (L*N*G) int8, the slots of expert e on rank g.
 * renumber_default(old, held, new, out, moved, L, N, P, G, nodes)
 *     targets.renumbered_default: old / new (L*P) int64 (-1 empty), held (L*N*G) bool
 *     the old membership; writes out (L*P) int64 and moved (L) int64.
 *
 * All release the GIL while they run. Built without -ffast-math and without contraction
 * into fused multiply-adds: every operation must round as numpy's does.
 */
#include "csearch.h"

#include <stdlib.h>

typedef struct {
    Py_buffer b[24];
    int n;
} Bufs;

static int take(Bufs *bs, PyObject *obj, Py_ssize_t count, Py_ssize_t itemsize, int writable, const char *name,
                void **out)
{
    Py_buffer *b = &bs->b[bs->n];
    if (PyObject_GetBuffer(obj, b, writable ? (PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) : PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    bs->n++;
    if (b->len != count * itemsize) {
        PyErr_Format(PyExc_ValueError, "csearch: %s has %zd bytes, expected %zd", name, b->len, count * itemsize);
        return -1;
    }
    *out = b->buf;
    return 0;
}

static void release(Bufs *bs)
{
    for (int i = 0; i < bs->n; i++)
        PyBuffer_Release(&bs->b[i]);
}

/* The wrappers' common ending: release the buffers; NULL when an error is set, MemoryError
 * when the kernel ran out of memory (status < 0), else None. */
static PyObject *finish(Bufs *bs, int status)
{
    release(bs);
    if (PyErr_Occurred())
        return NULL;
    if (status < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static int check_dims(Py_ssize_t A, Py_ssize_t N, Py_ssize_t P, Py_ssize_t G, Py_ssize_t nodes)
{
    if (A < 0 || N < 1 || G < 1 || P < G || P % G || nodes < 1 || G % nodes) {
        PyErr_SetString(PyExc_ValueError, "csearch: needs A >= 0, N >= 1, G dividing P, nodes dividing G");
        return -1;
    }
    return 0;
}

/* The state tuple and dims into s (buffers held in bs until released). */
static int take_state(Bufs *bs, PyObject *state, PyObject *dims, EsState *s)
{
    if (!PyArg_ParseTuple(dims, "nnnnn", &s->A, &s->N, &s->P, &s->G, &s->nodes))
        return -1;
    if (check_dims(s->A, s->N, s->P, s->G, s->nodes) < 0)
        return -1;
    const Py_ssize_t A = s->A, N = s->N, P = s->P, G = s->G;
    s->S = P / G;
    s->Gn = G / s->nodes;
    if (!PyTuple_Check(state) || PyTuple_GET_SIZE(state) != 12) {
        PyErr_SetString(PyExc_ValueError, "csearch: state must be a tuple of 12 arrays");
        return -1;
    }
    static const char *names[12] = {"w", "count", "cur", "slot_load", "rank_load", "on_rank",
                                    "held", "moved", "node", "moves", "limit", "goal"};
    const Py_ssize_t counts[12] = {A * N, A * N, A * P, A * P, A * G, A * N * G, A * N * G, A * P, A * N, A, A, A};
    const Py_ssize_t sizes[12] = {8, 8, 8, 8, 8, 1, 1, 1, 8, 8, 8, 8};
    static const int writable[12] = {0, 1, 1, 1, 1, 1, 0, 1, 0, 1, 0, 0};
    void *p[12];
    for (int k = 0; k < 12; k++)
        if (take(bs, PyTuple_GET_ITEM(state, k), counts[k], sizes[k], writable[k], names[k], &p[k]) < 0)
            return -1;
    s->w = p[0], s->count = p[1], s->cur = p[2], s->slot_load = p[3], s->rank_load = p[4], s->on_rank = p[5];
    s->held = p[6], s->moved = p[7], s->node = p[8], s->moves = p[9], s->limit = p[10], s->goal = p[11];
    for (Py_ssize_t i = 0; i < A * P; i++)
        if (s->cur[i] < 0 || s->cur[i] >= N) {
            PyErr_SetString(PyExc_ValueError, "csearch: cur must hold experts in [0, N) (no empty slot)");
            return -1;
        }
    return 0;
}

static int take_rows(Bufs *bs, PyObject *obj, const EsState *s, Py_ssize_t *n, const int64_t **lr)
{
    *n = PyObject_Length(obj);
    if (*n < 0)
        return -1;
    void *p;
    if (take(bs, obj, *n, 8, 0, "lr", &p) < 0)
        return -1;
    *lr = p;
    for (Py_ssize_t i = 0; i < *n; i++)
        if ((*lr)[i] < 0 || (*lr)[i] >= s->A) {
            PyErr_SetString(PyExc_ValueError, "csearch: lr must index the searched layers [0, A)");
            return -1;
        }
    return 0;
}

static PyObject *run(PyObject *self, PyObject *args)
{
    PyObject *state, *dims;
    double budget, fixed_max;
    Py_ssize_t max_rounds, rounds;
    if (!PyArg_ParseTuple(args, "O!O!ddnn", &PyTuple_Type, &state, &PyTuple_Type, &dims, &budget, &fixed_max,
                          &max_rounds, &rounds))
        return NULL;
    Bufs bs = {.n = 0};
    EsState s;
    PyObject *result = NULL;
    if (take_state(&bs, state, dims, &s) < 0)
        goto done;
    Py_ssize_t out;
    Py_BEGIN_ALLOW_THREADS
    out = es_run(&s, budget, fixed_max, max_rounds, rounds);
    Py_END_ALLOW_THREADS
    result = out < 0 ? PyErr_NoMemory() : PyLong_FromSsize_t(out);
done:
    release(&bs);
    return result;
}

static PyObject *rebalance_counts(PyObject *self, PyObject *args)
{
    PyObject *state, *dims, *cap_obj;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyTuple_Type, &state, &PyTuple_Type, &dims, &cap_obj))
        return NULL;
    Bufs bs = {.n = 0};
    EsState s;
    void *cap;
    int status = 0;
    if (take_state(&bs, state, dims, &s) < 0 || take(&bs, cap_obj, s.A, 8, 0, "cap", &cap) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    status = es_rebalance_counts(&s, cap);
    Py_END_ALLOW_THREADS
done:
    return finish(&bs, status);
}

static PyObject *repoints(PyObject *self, PyObject *args)
{
    PyObject *state, *dims, *o[7];
    if (!PyArg_ParseTuple(args, "O!O!OOOOOOO", &PyTuple_Type, &state, &PyTuple_Type, &dims, &o[0], &o[1], &o[2],
                          &o[3], &o[4], &o[5], &o[6]))
        return NULL;
    Bufs bs = {.n = 0};
    EsState s;
    Py_ssize_t n;
    const int64_t *lr;
    void *p[6];
    int status = 0;
    if (take_state(&bs, state, dims, &s) < 0 || take_rows(&bs, o[0], &s, &n, &lr) < 0)
        goto done;
    static const char *names[5] = {"eff", "rank", "new", "donor", "cost"};
    for (int k = 0; k < 5; k++)
        if (take(&bs, o[1 + k], n, 8, 1, names[k], &p[k]) < 0)
            goto done;
    if (take(&bs, o[6], n * s.G, 8, 1, "after", &p[5]) < 0)
        goto done;
    double *scratch = malloc(sizeof(double) * es_scratch_doubles(&s));
    if (!scratch) {
        status = -1;
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        EsRepoint r;
        es_repoint(&s, lr[i], s.rank_load + lr[i] * s.G, s.goal[lr[i]], scratch, &r, (double *)p[5] + i * s.G);
        ((double *)p[0])[i] = r.eff;
        ((int64_t *)p[1])[i] = r.rank;
        ((int64_t *)p[2])[i] = r.new_;
        ((int64_t *)p[3])[i] = r.donor;
        ((int64_t *)p[4])[i] = r.cost;
    }
    Py_END_ALLOW_THREADS
    free(scratch);
done:
    return finish(&bs, status);
}

static PyObject *pair_swaps(PyObject *self, PyObject *args)
{
    PyObject *state, *dims, *o[9];
    if (!PyArg_ParseTuple(args, "O!O!OOOOOOOOO", &PyTuple_Type, &state, &PyTuple_Type, &dims, &o[0], &o[1], &o[2],
                          &o[3], &o[4], &o[5], &o[6], &o[7], &o[8]))
        return NULL;
    Bufs bs = {.n = 0};
    EsState s;
    PyObject *result = NULL;
    Py_ssize_t n;
    const int64_t *lr;
    void *p[8];
    if (take_state(&bs, state, dims, &s) < 0 || take_rows(&bs, o[0], &s, &n, &lr) < 0)
        goto done;
    const Py_ssize_t cap = n * s.nodes * (s.Gn / 2);
    static const char *names[8] = {"pr", "eff", "slot_a", "slot_b", "o", "u", "cost", "delta"};
    for (int k = 0; k < 8; k++)
        if (take(&bs, o[1 + k], cap, 8, 1, names[k], &p[k]) < 0)
            goto done;
    double *scratch = malloc(sizeof(double) * es_scratch_doubles(&s));
    EsPair *pairs = malloc(sizeof(EsPair) * (cap + 1));
    if (!scratch || !pairs) {
        free(scratch);
        free(pairs);
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t M = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        M += es_pairs(&s, lr[i], i, s.rank_load + lr[i] * s.G, s.goal[lr[i]], scratch, pairs + M);
    for (Py_ssize_t m = 0; m < M; m++) {
        ((int64_t *)p[0])[m] = pairs[m].layer;
        ((double *)p[1])[m] = pairs[m].eff;
        ((int64_t *)p[2])[m] = pairs[m].slot_a;
        ((int64_t *)p[3])[m] = pairs[m].slot_b;
        ((int64_t *)p[4])[m] = pairs[m].o;
        ((int64_t *)p[5])[m] = pairs[m].u;
        ((int64_t *)p[6])[m] = pairs[m].cost;
        ((double *)p[7])[m] = pairs[m].delta;
    }
    Py_END_ALLOW_THREADS
    free(scratch);
    free(pairs);
    result = PyLong_FromSsize_t(M);
done:
    release(&bs);
    return result;
}

static PyObject *widened_choice(PyObject *self, PyObject *args)
{
    PyObject *state, *dims, *o[4];
    if (!PyArg_ParseTuple(args, "O!O!OOOO", &PyTuple_Type, &state, &PyTuple_Type, &dims, &o[0], &o[1], &o[2], &o[3]))
        return NULL;
    Bufs bs = {.n = 0};
    EsState s;
    Py_ssize_t n;
    const int64_t *lr;
    void *p[3];
    int status = 0;
    if (take_state(&bs, state, dims, &s) < 0 || take_rows(&bs, o[0], &s, &n, &lr) < 0
        || take(&bs, o[1], n, 1, 1, "found", &p[0]) < 0 || take(&bs, o[2], n, 8, 1, "slot_a", &p[1]) < 0
        || take(&bs, o[3], n, 8, 1, "slot_b", &p[2]) < 0)
        goto done;
    double *scratch = malloc(sizeof(double) * es_scratch_doubles(&s));
    if (!scratch) {
        status = -1;
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        ((int8_t *)p[0])[i] = (int8_t)es_widened(&s, lr[i], scratch, (int64_t *)p[1] + i, (int64_t *)p[2] + i);
    Py_END_ALLOW_THREADS
    free(scratch);
done:
    return finish(&bs, status);
}

static PyObject *lagrange_levels(PyObject *self, PyObject *args)
{
    PyObject *o[3];
    double budget;
    Py_ssize_t n, G;
    if (!PyArg_ParseTuple(args, "OOdOnn", &o[0], &o[1], &budget, &o[2], &n, &G))
        return NULL;
    Bufs bs = {.n = 0};
    void *p[3];
    int status = 0;
    if (n < 0 || G < 1) {
        PyErr_SetString(PyExc_ValueError, "csearch: needs n >= 0 and G >= 1");
        goto done;
    }
    if (take(&bs, o[0], n * G, 8, 0, "rank_loads", &p[0]) < 0 || take(&bs, o[1], n, 8, 0, "floor", &p[1]) < 0
        || take(&bs, o[2], n, 8, 1, "goal", &p[2]) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    status = es_lagrange_levels(p[0], p[1], budget, p[2], n, G);
    Py_END_ALLOW_THREADS
done:
    return finish(&bs, status);
}

static PyObject *rank_counts(PyObject *self, PyObject *args)
{
    PyObject *o[2];
    Py_ssize_t L, N, P, G;
    if (!PyArg_ParseTuple(args, "OOnnnn", &o[0], &o[1], &L, &N, &P, &G))
        return NULL;
    Bufs bs = {.n = 0};
    void *p[2];
    if (check_dims(L, N, P, G, 1) < 0)
        goto done;
    if (P / G >= 128) {
        PyErr_SetString(PyExc_ValueError, "csearch: rank_counts needs fewer than 128 slots per rank (int8 counts)");
        goto done;
    }
    if (take(&bs, o[0], L * P, 8, 0, "phy2log", &p[0]) < 0 || take(&bs, o[1], L * N * G, 1, 1, "out", &p[1]) < 0)
        goto done;
    const int64_t *phy = p[0];
    int8_t *out = p[1];
    for (Py_ssize_t i = 0; i < L * P; i++)
        if (phy[i] < -1 || phy[i] >= N) {
            PyErr_SetString(PyExc_ValueError, "csearch: phy2log must hold experts in [-1, N)");
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
    es_rank_counts(phy, out, L, N, P, G);
    Py_END_ALLOW_THREADS
done:
    return finish(&bs, 0);
}

static PyObject *renumber_default(PyObject *self, PyObject *args)
{
    PyObject *o[5];
    Py_ssize_t L, N, P, G, nodes;
    if (!PyArg_ParseTuple(args, "OOOOOnnnnn", &o[0], &o[1], &o[2], &o[3], &o[4], &L, &N, &P, &G, &nodes))
        return NULL;
    Bufs bs = {.n = 0};
    void *p[5];
    int status = 0;
    if (check_dims(L, N, P, G, nodes) < 0)
        goto done;
    if (take(&bs, o[0], L * P, 8, 0, "old", &p[0]) < 0 || take(&bs, o[1], L * N * G, 1, 0, "held", &p[1]) < 0
        || take(&bs, o[2], L * P, 8, 0, "new", &p[2]) < 0 || take(&bs, o[3], L * P, 8, 1, "out", &p[3]) < 0
        || take(&bs, o[4], L, 8, 1, "moved", &p[4]) < 0)
        goto done;
    const int64_t *old = p[0], *new_ = p[2];
    for (Py_ssize_t i = 0; i < L * P; i++)
        if (old[i] < -1 || old[i] >= N || new_[i] < -1 || new_[i] >= N) {
            PyErr_SetString(PyExc_ValueError, "csearch: placements must hold experts in [-1, N)");
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
    status = es_renumber_default(old, p[1], new_, p[3], p[4], L, N, P, G, nodes);
    Py_END_ALLOW_THREADS
done:
    return finish(&bs, status);
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS, "SearchState.run, in place (see the module comment)."},
    {"rebalance_counts", rebalance_counts, METH_VARARGS, "search.rebalance_counts, in place (see the module comment)."},
    {"repoints", repoints, METH_VARARGS, "The best re-point of every live layer (see the module comment)."},
    {"pair_swaps", pair_swaps, METH_VARARGS, "The best swap of every rank pair (see the module comment)."},
    {"widened_choice", widened_choice, METH_VARARGS, "The widened swap of every layer (see the module comment)."},
    {"lagrange_levels", lagrange_levels, METH_VARARGS, "Per-layer goals in flat mode (see the module comment)."},
    {"rank_counts", rank_counts, METH_VARARGS, "Slots of every expert on every rank, int8 (see the module comment)."},
    {"renumber_default", renumber_default, METH_VARARGS, "The renumbered default placement (see the module comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "csearch", "The movement-aware search in C.", -1, methods};

PyMODINIT_FUNC PyInit_csearch(void) { return PyModule_Create(&module); }

/* The movement-aware search's candidate scoring in C, one layer at a time.
 *
 * eplb_fsm/policy/movement/native.py is the Python face of this module; the numpy
 * functions of moves.py (repoints, pair_swaps, widened_swap) define the results, and the
 * loops here follow their arithmetic operation for operation: float64 where they use
 * float64, float32 where pair_swaps scores in float32, and every sum over the G ranks of
 * a layer as numpy's pairwise summation adds a contiguous row (pairwise_sum below). Ties
 * go to the first candidate in numpy's flattened order, as argmax does, and the orders
 * numpy takes from a stable argsort are rebuilt as stable insertion sorts. So both give
 * the same choices (the tests compare them). Nothing here changes the search state: the
 * Python side applies what the scores choose.
 *
 * Arrays (flat, C order; A searched layers, N experts, P slots, G ranks, S = P / G):
 *     w (A*N) float64 loads, count (A*N) int64 replica counts, cur (A*P) int64 placement,
 *     slot_load (A*P) float64, rank_load (A*G) float64, on_rank (A*N*G) int8 slots of
 *     expert e on rank g, held (A*N*G) int8 old membership, moved (A*P) int8, node
 *     (A*N) int64 node of each expert, moves / limit (A) int64, goal (A) float64.
 *     lr (n) int64 the live layers (rows of A), RL (n*G) float64 their rank loads, T (n)
 *     float64 their goals.
 *
 * repoints(w, count, cur, on_rank, held, node, moves, limit, lr, RL, T,
 *          eff, rank, new, donor, cost, after, A, N, P, G, nodes)
 *     writes per live layer: eff (n) float64, rank / new / donor / cost (n) int64,
 *     after (n*G) float64; as moves.repoints.
 * pair_swaps(cur, slot_load, held, moved, moves, limit, lr, RL, T,
 *            pr, eff, slot_a, slot_b, o, u, cost, delta, A, N, P, G, nodes) -> M
 *     writes the M pairs (M <= n * nodes * (G / nodes / 2)) into the first M entries of
 *     its eight outputs, as moves.pair_swaps (pr int64 indexes lr, eff / delta float64,
 *     the rest int64).
 * widened_choice(cur, slot_load, rank_load, goal, held, moved, moves, limit, lr,
 *                found, slot_a, slot_b, A, N, P, G, nodes)
 *     writes found (n) int8 and the chosen slot_a / slot_b (n) int64: the swap
 *     moves.widened_swap would apply (this function applies nothing).
 *
 * renumber_default(old, held, new, out, moved, L, N, P, G, nodes)
 *     old / new (L*P) int64 placements (-1: empty slot), held (L*N*G) bool the old
 *     membership; writes out (L*P) int64 and moved (L) int64: targets.renumbered_default
 *     (ranks renumbered by the greedy matching of targets._greedy_assignment, nodes
 *     first when nodes > 1, the plain numbering where that moves less, then the rows of
 *     every rank aligned with the old ones as targets.align_rows).
 *
 * All four release the GIL while they run. No -ffast-math and no contraction into fused
 * multiply-adds: every operation must round as numpy's does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* moves.py's constants (the tests compare both paths, so a drift shows there) */
#define FREE_COST 0.5
#define HOT_CANDIDATES 2
#define DONOR_CANDIDATES 6
#define WIDE_PARTNERS 8
#define TIE 1e-4
#define SWAP_TOL 1e-5
#define TOL 1e-9

/* numpy's pairwise summation of n contiguous float64 (the order np.add.reduce adds a row in) */
static double pairwise_sum(const double *a, Py_ssize_t n)
{
    if (n < 8) {
        double res = 0.;
        for (Py_ssize_t i = 0; i < n; i++)
            res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; j++)
            r[j] = a[j];
        Py_ssize_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++)
                r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += a[i];
        return res;
    }
    Py_ssize_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

static inline double max0(double x) { return x >= 0.0 ? x : 0.0; }
static inline float max0f(float x) { return x >= 0.0f ? x : 0.0f; }

static Py_ssize_t argmax(const double *a, Py_ssize_t n)
{
    Py_ssize_t best = 0;
    for (Py_ssize_t i = 1; i < n; i++)
        if (a[i] > a[best])
            best = i;
    return best;
}

/* The first k indices of a stable argsort of key[0..n) (ascending), into idx (k). */
static void smallest_stable(const double *key, Py_ssize_t n, Py_ssize_t k, int64_t *idx)
{
    Py_ssize_t have = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double v = key[i];
        if (have == k && !(v < key[idx[k - 1]]))
            continue;
        Py_ssize_t at = have < k ? have++ : k - 1;
        while (at > 0 && v < key[idx[at - 1]]) {
            idx[at] = idx[at - 1];
            at--;
        }
        idx[at] = i;
    }
}

/* ------------------------------------------------------------------ buffers */

typedef struct {
    Py_buffer b[20];
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

static int check_dims(Py_ssize_t A, Py_ssize_t N, Py_ssize_t P, Py_ssize_t G, Py_ssize_t nodes, Py_ssize_t n)
{
    if (A < 0 || N < 1 || G < 1 || P < G || P % G || nodes < 1 || G % nodes || n < 0 || n > A) {
        PyErr_SetString(PyExc_ValueError, "csearch: needs N >= 1, G dividing P, nodes dividing G, 0 <= n <= A");
        return -1;
    }
    return 0;
}

static int check_rows(const int64_t *lr, Py_ssize_t n, Py_ssize_t A)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (lr[i] < 0 || lr[i] >= A) {
            PyErr_SetString(PyExc_ValueError, "csearch: lr must index the searched layers [0, A)");
            return -1;
        }
    return 0;
}

/* ------------------------------------------------------------------ repoints */

typedef struct {
    const double *w, *RL, *T;
    const int64_t *count, *cur, *node, *moves, *limit, *lr;
    const int8_t *on_rank, *held;
    double *eff, *after;
    int64_t *rank, *new_, *donor, *cost;
    Py_ssize_t N, P, G, S, nodes;
} Repoints;

static void repoint_row(const Repoints *a, Py_ssize_t i, double *scratch, int64_t *x)
{
    const Py_ssize_t N = a->N, G = a->G, S = a->S;
    const int64_t l = a->lr[i], eb = l * N;
    const double *RL = a->RL + i * G, T = a->T[i];
    double *ex = scratch, *rel = ex + G, *relief = rel + S * G, *loads = relief + S, *harm = loads + G;
    for (Py_ssize_t g = 0; g < G; g++)
        ex[g] = max0(RL[g] - T);
    const double E = pairwise_sum(ex, G);
    const int64_t top = argmax(RL, G);
    /* every expert of the most loaded rank: its rank loads with one more replica */
    for (Py_ssize_t j = 0; j < S; j++) {
        const int64_t h = eb + a->cur[l * a->P + top * S + j];
        const double wh = a->w[h], ch = (double)a->count[h];
        const double dec = wh / ch - wh / (double)(a->count[h] + 1);
        const int8_t *on = a->on_rank + h * G;
        for (Py_ssize_t g = 0; g < G; g++) {
            rel[j * G + g] = RL[g] - (double)on[g] * dec;
            ex[g] = max0(rel[j * G + g] - T);
        }
        relief[j] = E - pairwise_sum(ex, G);
    }
    /* the ky best (stable argsort of -relief) */
    const Py_ssize_t ky = S < HOT_CANDIDATES ? S : HOT_CANDIDATES;
    Py_ssize_t pick[HOT_CANDIDATES];
    for (Py_ssize_t k = 0; k < ky; k++) {
        Py_ssize_t best = -1;
        for (Py_ssize_t j = 0; j < S; j++) {
            if (k && j == pick[0])
                continue;
            if (best < 0 || relief[j] > relief[best])
                best = j;
        }
        pick[k] = best;
    }
    /* donors: the kx experts whose loss of a replica harms least (stable order) */
    const Py_ssize_t kx = N < DONOR_CANDIDATES ? N : DONOR_CANDIDATES;
    if (kx < N) {
        for (Py_ssize_t e = 0; e < N; e++) {
            const int64_t c = a->count[eb + e];
            const int64_t d = c * (c - 1);
            harm[e] = c >= 2 ? a->w[eb + e] / (double)(d > 1 ? d : 1) : INFINITY;
        }
        smallest_stable(harm, N, kx, x);
    } else {
        for (Py_ssize_t e = 0; e < N; e++)
            x[e] = e;
    }
    const int64_t spare = a->limit[l] - a->moves[l];
    double best_eff = -INFINITY;
    Py_ssize_t best_k = 0, best_m = 0, best_g = 0;
    double best_swing = 0.0;
    int first = 1;
    for (Py_ssize_t k = 0; k < ky; k++) {
        const int64_t y = eb + a->cur[l * a->P + top * S + pick[k]];
        const double wy = a->w[y];
        const int64_t cy = a->count[y];
        const double *ry = rel + pick[k] * G;
        for (Py_ssize_t m = 0; m < kx; m++) {
            const int64_t xe = eb + x[m];
            const double wx = a->w[xe];
            const int64_t cx = a->count[xe];
            const int x_ok = cx >= 2;
            const int64_t cx1 = cx - 1 > 1 ? cx - 1 : 1;
            const double grow = x_ok ? wx / (double)cx1 - wx / (double)(cx > 1 ? cx : 1) : 0.0;
            const int8_t *x_on = a->on_rank + xe * G;
            for (Py_ssize_t g = 0; g < G; g++) {
                loads[g] = ry[g] + (double)x_on[g] * grow;
                ex[g] = max0(loads[g] - T);
            }
            const double total = pairwise_sum(ex, G);
            const double swing = wy / (double)(cy + 1) - wx / (double)cx1;
            const int same_node = a->nodes <= 1 || a->node[xe] == a->node[y];
            const int pair_ok = x_ok && xe != y && same_node;
            for (Py_ssize_t g = 0; g < G; g++) {
                double after = total - ex[g];
                after += max0(loads[g] + swing - T);
                const double gain = E - after;
                const int cost = (int)a->held[xe * G + g] - (int)a->held[y * G + g];
                const int ok = x_on[g] > 0 && pair_ok && gain > TOL * T && cost <= spare;
                const double eff = ok ? gain / ((double)cost > FREE_COST ? (double)cost : FREE_COST) : -INFINITY;
                if (first || eff > best_eff) {
                    first = 0;
                    best_eff = eff;
                    best_k = k, best_m = m, best_g = g;
                    best_swing = swing;
                }
            }
        }
    }
    /* the winner's rank loads (recomputed: only the best candidate's are kept) */
    const int64_t y = eb + a->cur[l * a->P + top * S + pick[best_k]];
    const int64_t xe = eb + x[best_m];
    const double wx = a->w[xe];
    const int64_t cx = a->count[xe];
    const int64_t cx1 = cx - 1 > 1 ? cx - 1 : 1;
    const double grow = cx >= 2 ? wx / (double)cx1 - wx / (double)(cx > 1 ? cx : 1) : 0.0;
    const double *ry = rel + pick[best_k] * G;
    double *after = a->after + i * G;
    for (Py_ssize_t g = 0; g < G; g++)
        after[g] = ry[g] + (double)a->on_rank[xe * G + g] * grow;
    after[best_g] += best_swing;
    a->eff[i] = best_eff;
    a->rank[i] = best_g;
    a->new_[i] = y;
    a->donor[i] = xe;
    a->cost[i] = (int64_t)a->held[xe * G + best_g] - (int64_t)a->held[y * G + best_g];
}

static PyObject *repoints(PyObject *self, PyObject *args)
{
    PyObject *o[17];
    Py_ssize_t A, N, P, G, nodes;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOOOOOnnnnn", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7],
                          &o[8], &o[9], &o[10], &o[11], &o[12], &o[13], &o[14], &o[15], &o[16], &A, &N, &P, &G, &nodes))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *result = NULL;
    Repoints a;
    void *p[17];
    Py_ssize_t n = PyObject_Length(o[8]);
    if (n < 0 || check_dims(A, N, P, G, nodes, n) < 0)
        goto done;
    a.N = N, a.P = P, a.G = G, a.S = P / G, a.nodes = nodes;
    if (take(&bs, o[0], A * N, 8, 0, "w", &p[0]) < 0 || take(&bs, o[1], A * N, 8, 0, "count", &p[1]) < 0
        || take(&bs, o[2], A * P, 8, 0, "cur", &p[2]) < 0 || take(&bs, o[3], A * N * G, 1, 0, "on_rank", &p[3]) < 0
        || take(&bs, o[4], A * N * G, 1, 0, "held", &p[4]) < 0 || take(&bs, o[5], A * N, 8, 0, "node", &p[5]) < 0
        || take(&bs, o[6], A, 8, 0, "moves", &p[6]) < 0 || take(&bs, o[7], A, 8, 0, "limit", &p[7]) < 0
        || take(&bs, o[8], n, 8, 0, "lr", &p[8]) < 0 || take(&bs, o[9], n * G, 8, 0, "RL", &p[9]) < 0
        || take(&bs, o[10], n, 8, 0, "T", &p[10]) < 0 || take(&bs, o[11], n, 8, 1, "eff", &p[11]) < 0
        || take(&bs, o[12], n, 8, 1, "rank", &p[12]) < 0 || take(&bs, o[13], n, 8, 1, "new", &p[13]) < 0
        || take(&bs, o[14], n, 8, 1, "donor", &p[14]) < 0 || take(&bs, o[15], n, 8, 1, "cost", &p[15]) < 0
        || take(&bs, o[16], n * G, 8, 1, "after", &p[16]) < 0)
        goto done;
    a.w = p[0], a.count = p[1], a.cur = p[2], a.on_rank = p[3], a.held = p[4], a.node = p[5];
    a.moves = p[6], a.limit = p[7], a.lr = p[8], a.RL = p[9], a.T = p[10];
    a.eff = p[11], a.rank = p[12], a.new_ = p[13], a.donor = p[14], a.cost = p[15], a.after = p[16];
    if (check_rows(a.lr, n, A) < 0)
        goto done;
    double *scratch = malloc(sizeof(double) * (2 * G + a.S * G + a.S + N) + sizeof(int64_t) * N);
    if (!scratch) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *x = (int64_t *)(scratch + 2 * G + a.S * G + a.S + N);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        repoint_row(&a, i, scratch, x);
    Py_END_ALLOW_THREADS
    free(scratch);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release(&bs);
    return result;
}

/* ------------------------------------------------------------------ pair swaps */

static PyObject *pair_swaps(PyObject *self, PyObject *args)
{
    PyObject *o[17];
    Py_ssize_t A, N, P, G, nodes;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOOOOOnnnnn", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7],
                          &o[8], &o[9], &o[10], &o[11], &o[12], &o[13], &o[14], &o[15], &o[16], &A, &N, &P, &G, &nodes))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *result = NULL;
    void *p[17];
    Py_ssize_t n = PyObject_Length(o[6]);
    if (n < 0 || check_dims(A, N, P, G, nodes, n) < 0)
        goto done;
    const Py_ssize_t S = P / G, Gn = G / nodes, half = Gn / 2, cap = n * nodes * half;
    if (take(&bs, o[0], A * P, 8, 0, "cur", &p[0]) < 0 || take(&bs, o[1], A * P, 8, 0, "slot_load", &p[1]) < 0
        || take(&bs, o[2], A * N * G, 1, 0, "held", &p[2]) < 0 || take(&bs, o[3], A * P, 1, 0, "moved", &p[3]) < 0
        || take(&bs, o[4], A, 8, 0, "moves", &p[4]) < 0 || take(&bs, o[5], A, 8, 0, "limit", &p[5]) < 0
        || take(&bs, o[6], n, 8, 0, "lr", &p[6]) < 0 || take(&bs, o[7], n * G, 8, 0, "RL", &p[7]) < 0
        || take(&bs, o[8], n, 8, 0, "T", &p[8]) < 0)
        goto done;
    static const char *names[8] = {"pr", "eff", "slot_a", "slot_b", "o", "u", "cost", "delta"};
    for (int k = 0; k < 8; k++)
        if (take(&bs, o[9 + k], cap, 8, 1, names[k], &p[9 + k]) < 0)
            goto done;
    const int64_t *cur = p[0], *moves = p[4], *limit = p[5], *lr = p[6];
    const double *sl = p[1], *RLs = p[7], *Ts = p[8];
    const int8_t *held = p[2], *moved = p[3];
    int64_t *pr = p[9], *slot_a = p[11], *slot_b = p[12], *po = p[13], *pu = p[14], *pcost = p[15];
    double *peff = p[10], *pdelta = p[16];
    if (check_rows(lr, n, A) < 0)
        goto done;
    int64_t *order = malloc(sizeof(int64_t) * (Gn > 0 ? Gn : 1) + sizeof(int) * 2 * S + sizeof(float) * 2 * S);
    if (!order) {
        PyErr_NoMemory();
        goto done;
    }
    int *cost_a = (int *)(order + (Gn > 0 ? Gn : 1)), *cost_b = cost_a + S;
    float *la = (float *)(cost_b + S), *lb = la + S;
    Py_ssize_t M = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && Gn >= 2; i++) {
        const int64_t l = lr[i], rN = l * N;
        const double *RL = RLs + i * G, t = Ts[i];
        const int64_t spare = limit[l] - moves[l];
        int64_t spent = 0;
        for (Py_ssize_t nd = 0; nd < nodes; nd++) {
            /* the node's ranks heaviest first (a stable argsort of -load) */
            for (Py_ssize_t r = 0; r < Gn; r++) {
                const double v = -RL[nd * Gn + r];
                Py_ssize_t at = r;
                while (at > 0 && v < -RL[order[at - 1]]) {
                    order[at] = order[at - 1];
                    at--;
                }
                order[at] = nd * Gn + r;
            }
            for (Py_ssize_t k = 0; k < half; k++) {
                const int64_t ro = order[k], ru = order[Gn - 1 - k];
                if (!(RL[ro] > t))
                    continue;
                const double a = RL[ro] - t, b = RL[ru] - t;
                const float a3 = (float)a, b3 = (float)b, mid = (float)(0.5 * (a - b)), bpos = max0f(b3);
                const int64_t fo = l * P + ro * S, fu = l * P + ru * S;
                for (Py_ssize_t j = 0; j < S; j++) {
                    la[j] = (float)sl[fo + j];
                    lb[j] = (float)sl[fu + j];
                    cost_b[j] = 1 - held[(rN + cur[fo + j]) * G + ru] - moved[fo + j]; /* u's slot gets o's expert */
                    cost_a[j] = 1 - held[(rN + cur[fu + j]) * G + ro] - moved[fu + j]; /* o's slot gets u's expert */
                }
                float best = 0.0f;
                Py_ssize_t ia = 0, ib = 0;
                for (Py_ssize_t x = 0; x < S; x++)
                    for (Py_ssize_t y = 0; y < S; y++) {
                        const float d = la[x] - lb[y];
                        float gain = a3 <= d ? a3 : d;
                        gain -= max0f(b3 + d);
                        gain += bpos;
                        const float c = (float)(cost_b[x] + cost_a[y]);
                        gain /= c >= 0.5f ? c : 0.5f;
                        float tie = d - mid;
                        tie = fabsf(tie);
                        tie *= (float)TIE;
                        gain -= tie;
                        if ((x == 0 && y == 0) || gain > best) {
                            best = gain;
                            ia = x, ib = y;
                        }
                    }
                const double eff = (double)best;
                const int64_t cost = (int64_t)cost_b[ia] + cost_a[ib];
                int good = eff > SWAP_TOL * t;
                spent += good ? (cost > 0 ? cost : 0) : 0;
                good = good && spent <= spare;
                pr[M] = i;
                peff[M] = good ? eff : -INFINITY;
                slot_a[M] = ro * S + ia;
                slot_b[M] = ru * S + ib;
                po[M] = ro;
                pu[M] = ru;
                pcost[M] = cost;
                pdelta[M] = sl[fo + ia] - sl[fu + ib];
                M++;
            }
        }
    }
    Py_END_ALLOW_THREADS
    free(order);
    result = PyLong_FromSsize_t(M);
done:
    release(&bs);
    return result;
}

/* ------------------------------------------------------------------ widened swap */

static PyObject *widened_choice(PyObject *self, PyObject *args)
{
    PyObject *o[12];
    Py_ssize_t A, N, P, G, nodes;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOnnnnn", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8],
                          &o[9], &o[10], &o[11], &A, &N, &P, &G, &nodes))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *result = NULL;
    void *p[12];
    Py_ssize_t n = PyObject_Length(o[8]);
    if (n < 0 || check_dims(A, N, P, G, nodes, n) < 0)
        goto done;
    const Py_ssize_t S = P / G, Gn = G / nodes;
    const Py_ssize_t k = WIDE_PARTNERS < Gn - 1 ? WIDE_PARTNERS : Gn - 1;
    if (take(&bs, o[0], A * P, 8, 0, "cur", &p[0]) < 0 || take(&bs, o[1], A * P, 8, 0, "slot_load", &p[1]) < 0
        || take(&bs, o[2], A * G, 8, 0, "rank_load", &p[2]) < 0 || take(&bs, o[3], A, 8, 0, "goal", &p[3]) < 0
        || take(&bs, o[4], A * N * G, 1, 0, "held", &p[4]) < 0 || take(&bs, o[5], A * P, 1, 0, "moved", &p[5]) < 0
        || take(&bs, o[6], A, 8, 0, "moves", &p[6]) < 0 || take(&bs, o[7], A, 8, 0, "limit", &p[7]) < 0
        || take(&bs, o[8], n, 8, 0, "lr", &p[8]) < 0 || take(&bs, o[9], n, 1, 1, "found", &p[9]) < 0
        || take(&bs, o[10], n, 8, 1, "slot_a", &p[10]) < 0 || take(&bs, o[11], n, 8, 1, "slot_b", &p[11]) < 0)
        goto done;
    const int64_t *cur = p[0], *moves = p[6], *limit = p[7], *lr = p[8];
    const double *sl = p[1], *rank_load = p[2], *goal = p[3];
    const int8_t *held = p[4], *moved = p[5];
    int8_t *found = p[9];
    int64_t *out_a = p[10], *out_b = p[11];
    if (check_rows(lr, n, A) < 0)
        goto done;
    double *key = malloc(sizeof(double) * G + sizeof(int64_t) * (k > 0 ? k : 1));
    if (!key) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *partners = (int64_t *)(key + G);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        found[i] = 0;
        out_a[i] = out_b[i] = 0;
        if (k <= 0)
            continue;
        const int64_t l = lr[i], rN = l * N;
        const double *RL = rank_load + l * G, T = goal[l];
        const int64_t top = argmax(RL, G), node = top / Gn;
        for (Py_ssize_t g = 0; g < G; g++)
            key[g] = (g / Gn == node && g != top) ? RL[g] : INFINITY;
        smallest_stable(key, G, k, partners);
        const double a = RL[top] - T;
        double best = -INFINITY;
        Py_ssize_t best_x = 0, best_q = 0, best_y = 0;
        int first = 1;
        for (Py_ssize_t x = 0; x < S; x++) {
            const int64_t fa = l * P + top * S + x;
            for (Py_ssize_t q = 0; q < k; q++) {
                const int64_t rq = partners[q];
                const int ok_partner = rq / Gn == node && rq != top;
                const double b = RL[rq] - T;
                for (Py_ssize_t y = 0; y < S; y++) {
                    const int64_t fb = l * P + rq * S + y;
                    const double d = sl[fa] - sl[fb];
                    const double gain = max0(a) + max0(b) - max0(a - d) - max0(b + d);
                    const int64_t cost_a = 1 - (int64_t)held[(rN + cur[fb]) * G + top] - moved[fb];
                    const int64_t cost_b = 1 - (int64_t)held[(rN + cur[fa]) * G + rq] - moved[fa];
                    const int64_t cost = cost_b + cost_a;
                    const int ok = gain > TOL * T && ok_partner && moves[l] + cost <= limit[l];
                    const double eff = ok ? gain / ((double)cost > FREE_COST ? (double)cost : FREE_COST) : -INFINITY;
                    if (first || eff > best) {
                        first = 0;
                        best = eff;
                        best_x = x, best_q = q, best_y = y;
                    }
                }
            }
        }
        if (isfinite(best)) {
            found[i] = 1;
            out_a[i] = top * S + best_x;
            out_b[i] = partners[best_q] * S + best_y;
        }
    }
    Py_END_ALLOW_THREADS
    free(key);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release(&bs);
    return result;
}


/* ------------------------------------------------------------------ renumbering */

#define TAKEN (-(1 << 30)) /* added to a matched column's keys: far below any real key */

/* targets._greedy_assignment of one (size, size) score matrix: two rounds of proposals
 * (each free row to its best column, each column accepts its best proposer, lowest row
 * on ties; keys score * 2 * size - |row - column|), then the rest in index order.
 * work: size * size int32 scratch; target, row_free, col_block: size each. */
static void greedy_assignment(const int32_t *score, Py_ssize_t size, int32_t *work, int64_t *target,
                              int8_t *row_free, int32_t *col_block, int64_t *choice, int32_t *value, int64_t *winner)
{
    for (Py_ssize_t q = 0; q < size; q++) {
        target[q] = -1;
        row_free[q] = 1;
        col_block[q] = 0;
        for (Py_ssize_t c = 0; c < size; c++)
            work[q * size + c] = score[q * size + c] * (int32_t)(2 * size) - (int32_t)(q > c ? q - c : c - q);
    }
    for (int round = 0; round < 2; round++) {
        int any = 0;
        for (Py_ssize_t c = 0; c < size; c++)
            winner[c] = -1;
        for (Py_ssize_t q = 0; q < size; q++) {
            const int32_t *row = work + q * size;
            Py_ssize_t best = 0;
            int32_t best_v = row[0] + (round ? col_block[0] : 0);
            for (Py_ssize_t c = 1; c < size; c++) {
                const int32_t v = row[c] + (round ? col_block[c] : 0);
                if (v > best_v)
                    best_v = v, best = c;
            }
            choice[q] = best;
            value[q] = best_v;
            if (!row_free[q] || !(best_v > TAKEN / 2))
                continue;
            any = 1;
            const int64_t w = winner[best];
            if (w < 0 || best_v > value[w]) /* rows come in ascending order: ties keep the lower */
                winner[best] = q;
        }
        if (!any)
            break;
        for (Py_ssize_t c = 0; c < size; c++)
            if (winner[c] >= 0) {
                target[winner[c]] = c;
                row_free[winner[c]] = 0;
                col_block[c] = TAKEN;
            }
    }
    Py_ssize_t c = 0;
    for (Py_ssize_t q = 0; q < size; q++) {
        if (!row_free[q])
            continue;
        while (col_block[c] != 0)
            c++;
        target[q] = c++;
    }
}

static int64_t moved_slots(const int64_t *phy, const uint8_t *held, Py_ssize_t P, Py_ssize_t G, Py_ssize_t S)
{
    int64_t moved = 0;
    for (Py_ssize_t p = 0; p < P; p++)
        if (phy[p] >= 0)
            moved += !held[phy[p] * G + p / S];
    return moved;
}

static PyObject *renumber_default(PyObject *self, PyObject *args)
{
    PyObject *o[5];
    Py_ssize_t L, N, P, G, nodes;
    if (!PyArg_ParseTuple(args, "OOOOOnnnnn", &o[0], &o[1], &o[2], &o[3], &o[4], &L, &N, &P, &G, &nodes))
        return NULL;
    Bufs bs = {.n = 0};
    PyObject *result = NULL;
    void *p[5];
    if (check_dims(L, N, P, G, nodes, 0) < 0)
        goto done;
    if (take(&bs, o[0], L * P, 8, 0, "old", &p[0]) < 0 || take(&bs, o[1], L * N * G, 1, 0, "held", &p[1]) < 0
        || take(&bs, o[2], L * P, 8, 0, "new", &p[2]) < 0 || take(&bs, o[3], L * P, 8, 1, "out", &p[3]) < 0
        || take(&bs, o[4], L, 8, 1, "moved", &p[4]) < 0)
        goto done;
    const int64_t *old = p[0], *new_ = p[2];
    const uint8_t *held = p[1];
    int64_t *out = p[3], *moved = p[4];
    for (Py_ssize_t i = 0; i < L * P; i++)
        if (old[i] < -1 || old[i] >= N || new_[i] < -1 || new_[i] >= N) {
            PyErr_SetString(PyExc_ValueError, "csearch: placements must hold experts in [-1, N)");
            goto done;
        }
    const Py_ssize_t S = P / G, Gn = G / nodes;
    /* scratch: overlap, score and work (G*G int32 each), relabeled (P), per-size vectors */
    char *block = malloc(sizeof(int32_t) * 3 * G * G + sizeof(int64_t) * (P + 5 * G + 2 * S) + sizeof(int32_t) * 2 * G
                         + G + S);
    if (!block) {
        PyErr_NoMemory();
        goto done;
    }
    int32_t *overlap = (int32_t *)block, *score = overlap + G * G, *work = score + G * G;
    int64_t *relabeled = (int64_t *)(work + G * G), *target = relabeled + P, *node_target = target + G;
    int64_t *inner = node_target + G, *choice = inner + G, *winner = choice + G, *spare = winner + G;
    int32_t *col_block = (int32_t *)(spare + 2 * S), *value = col_block + G;
    int8_t *row_free = (int8_t *)(value + G), *used = row_free + G;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t l = 0; l < L; l++) {
        const int64_t *o_l = old + l * P, *n_l = new_ + l * P;
        const uint8_t *h_l = held + l * N * G;
        int64_t *out_l = out + l * P;
        /* overlap[q][g]: slots of new rank q whose expert old rank g held */
        memset(overlap, 0, sizeof(int32_t) * G * G);
        for (Py_ssize_t s = 0; s < P; s++)
            if (n_l[s] >= 0) {
                int32_t *row = overlap + (s / S) * G;
                const uint8_t *h = h_l + n_l[s] * G;
                for (Py_ssize_t g = 0; g < G; g++)
                    row[g] += h[g];
            }
        if (nodes > 1) {
            for (Py_ssize_t i = 0; i < nodes; i++)
                for (Py_ssize_t j = 0; j < nodes; j++) {
                    int32_t sum = 0;
                    for (Py_ssize_t a = 0; a < Gn; a++)
                        for (Py_ssize_t b = 0; b < Gn; b++)
                            sum += overlap[(i * Gn + a) * G + j * Gn + b];
                    score[i * nodes + j] = sum;
                }
            greedy_assignment(score, nodes, work, node_target, row_free, col_block, choice, value, winner);
            for (Py_ssize_t i = 0; i < nodes; i++) {
                for (Py_ssize_t a = 0; a < Gn; a++)
                    for (Py_ssize_t b = 0; b < Gn; b++)
                        score[a * Gn + b] = overlap[(i * Gn + a) * G + node_target[i] * Gn + b];
                greedy_assignment(score, Gn, work, inner, row_free, col_block, choice, value, winner);
                for (Py_ssize_t a = 0; a < Gn; a++)
                    target[i * Gn + a] = node_target[i] * Gn + inner[a];
            }
        } else {
            greedy_assignment(overlap, G, work, target, row_free, col_block, choice, value, winner);
        }
        for (Py_ssize_t q = 0; q < G; q++)
            memcpy(relabeled + target[q] * S, n_l + q * S, sizeof(int64_t) * S);
        const int64_t m_relabeled = moved_slots(relabeled, h_l, P, G, S), m_plain = moved_slots(n_l, h_l, P, G, S);
        const int64_t *pick = m_relabeled > m_plain ? n_l : relabeled;
        moved[l] = m_relabeled < m_plain ? m_relabeled : m_plain;
        /* rows aligned: an old row keeps its expert if an unused entry of the rank holds it
         * (the first such), the other rows take the unused entries in order */
        for (Py_ssize_t g = 0; g < G; g++) {
            const int64_t *orow = o_l + g * S, *nrow = pick + g * S;
            int64_t *dst = out_l + g * S;
            for (Py_ssize_t j = 0; j < S; j++)
                used[j] = 0;
            for (Py_ssize_t i = 0; i < S; i++) {
                dst[i] = -2; /* not kept yet */
                if (orow[i] < 0)
                    continue;
                for (Py_ssize_t j = 0; j < S; j++)
                    if (!used[j] && nrow[j] == orow[i]) {
                        used[j] = 1;
                        dst[i] = orow[i];
                        break;
                    }
            }
            Py_ssize_t next = 0;
            for (Py_ssize_t i = 0; i < S; i++) {
                if (dst[i] != -2)
                    continue;
                while (used[next])
                    next++;
                dst[i] = nrow[next++]; /* empty entries (-1) fill free rows like any other */
            }
        }
    }
    Py_END_ALLOW_THREADS
    free(block);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release(&bs);
    return result;
}

static PyMethodDef methods[] = {
    {"repoints", repoints, METH_VARARGS, "The best re-point of every live layer (see the module comment)."},
    {"pair_swaps", pair_swaps, METH_VARARGS, "The best swap of every rank pair (see the module comment)."},
    {"widened_choice", widened_choice, METH_VARARGS, "The widened swap of every layer (see the module comment)."},
    {"renumber_default", renumber_default, METH_VARARGS, "The renumbered default placement (see the module comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "csearch",
                                    "The movement-aware search's candidate scoring in C.", -1, methods};

PyMODINIT_FUNC PyInit_csearch(void) { return PyModule_Create(&module); }

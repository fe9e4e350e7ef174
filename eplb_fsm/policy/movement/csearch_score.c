/* The movement-aware search's candidate scores, one layer at a time (moves.py in C).
 *
 * es_repoint: moves.repoints for one layer; es_pairs: moves.pair_swaps for one layer's
 * rank pairs; es_widened: the swap moves.widened_swap would apply to one layer. None of
 * them changes the state. csearch.h says how they follow the numpy code.
 */
#include <math.h>
#include <stdlib.h>

#include "csearch.h"

/* numpy's pairwise summation of n contiguous float64 (the order np.add.reduce adds a row in) */
double es_pairwise_sum(const double *a, Py_ssize_t n)
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
    return es_pairwise_sum(a, n2) + es_pairwise_sum(a + n2, n - n2);
}

int es_by_keys(const void *pa, const void *pb)
{
    const EsKeyed *a = pa, *b = pb;
    if (a->key1 != b->key1)
        return a->key1 < b->key1 ? -1 : 1;
    if (a->key2 != b->key2)
        return a->key2 < b->key2 ? -1 : 1;
    return a->index < b->index ? -1 : a->index > b->index;
}

static inline double max0(double x) { return x >= 0.0 ? x : 0.0; }
static inline float max0f(float x) { return x >= 0.0f ? x : 0.0f; }

Py_ssize_t es_argmax(const double *a, Py_ssize_t n)
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
        const double v = key[i];
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

Py_ssize_t es_scratch_doubles(const EsState *s)
{
    /* the largest of: repoint (2G + S*G + S + 2N), pairs (Gn + 4S), widened (G + partners) */
    Py_ssize_t r = 2 * s->G + s->S * s->G + s->S + 2 * s->N, p = s->Gn + 4 * s->S, w = s->G + ES_WIDE_PARTNERS;
    Py_ssize_t m = r > p ? r : p;
    return (m > w ? m : w) + 8;
}

/* ------------------------------------------------------------------ re-points */

void es_repoint(const EsState *s, int64_t l, const double *RL, double T, double *scratch, EsRepoint *out,
                double *after)
{
    const Py_ssize_t N = s->N, G = s->G, S = s->S;
    const int64_t eb = l * N;
    double *ex = scratch, *rel = ex + G, *relief = rel + S * G, *loads = relief + S, *harm = loads + G;
    int64_t *x = (int64_t *)(harm + N);
    for (Py_ssize_t g = 0; g < G; g++)
        ex[g] = max0(RL[g] - T);
    const double E = es_pairwise_sum(ex, G);
    const int64_t top = es_argmax(RL, G);
    const int64_t *top_slots = s->cur + l * s->P + top * S;
    /* every expert of the most loaded rank: the rank loads with one more replica of it */
    for (Py_ssize_t j = 0; j < S; j++) {
        const int64_t h = eb + top_slots[j];
        const double wh = s->w[h], ch = (double)s->count[h];
        const double dec = wh / ch - wh / (double)(s->count[h] + 1);
        const int8_t *on = s->on_rank + h * G;
        for (Py_ssize_t g = 0; g < G; g++) {
            rel[j * G + g] = RL[g] - (double)on[g] * dec;
            ex[g] = max0(rel[j * G + g] - T);
        }
        relief[j] = E - es_pairwise_sum(ex, G);
    }
    /* the ky that relieve most (a stable argsort of -relief) */
    const Py_ssize_t ky = S < ES_HOT_CANDIDATES ? S : ES_HOT_CANDIDATES;
    Py_ssize_t pick[ES_HOT_CANDIDATES];
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
    const Py_ssize_t kx = N < ES_DONOR_CANDIDATES ? N : ES_DONOR_CANDIDATES;
    if (kx < N) {
        for (Py_ssize_t e = 0; e < N; e++) {
            const int64_t c = s->count[eb + e], d = c * (c - 1);
            harm[e] = c >= 2 ? s->w[eb + e] / (double)(d > 1 ? d : 1) : INFINITY;
        }
        smallest_stable(harm, N, kx, x);
    } else {
        for (Py_ssize_t e = 0; e < N; e++)
            x[e] = e;
    }
    const int64_t spare = s->limit[l] - s->moves[l];
    /* argmax over (hot, donor, rank) candidates, first maximum; with no finite one numpy's
     * argmax is candidate 0 (hot 0, donor 0, rank 0), whose loads are reported */
    double best_eff = -INFINITY, best_swing = 0.0, best_grow = 0.0;
    Py_ssize_t best_k = 0, best_m = 0, best_g = 0;
    for (Py_ssize_t k = 0; k < ky; k++) {
        const int64_t y = eb + top_slots[pick[k]];
        const double wy = s->w[y];
        const int64_t cy = s->count[y];
        const double *ry = rel + pick[k] * G;
        for (Py_ssize_t m = 0; m < kx; m++) {
            const int64_t xe = eb + x[m];
            const double wx = s->w[xe];
            const int64_t cx = s->count[xe], cx1 = cx - 1 > 1 ? cx - 1 : 1;
            const int x_ok = cx >= 2;
            const double grow = x_ok ? wx / (double)cx1 - wx / (double)(cx > 1 ? cx : 1) : 0.0;
            /* the re-pointed slot (on rank g) drops its x replica and holds a y replica instead */
            const double swing = wy / (double)(cy + 1) - wx / (double)cx1;
            if (k == 0 && m == 0)
                best_swing = swing, best_grow = grow;
            /* a candidate needs a donor with 2+ replicas, other than y, on y's node, held by rank g */
            if (!x_ok || xe == y || (s->nodes > 1 && s->node[xe] != s->node[y]))
                continue;
            const int8_t *x_on = s->on_rank + xe * G;
            for (Py_ssize_t g = 0; g < G; g++) {
                loads[g] = ry[g] + (double)x_on[g] * grow;
                ex[g] = max0(loads[g] - T);
            }
            const double total = es_pairwise_sum(ex, G);
            for (Py_ssize_t g = 0; g < G; g++) {
                if (x_on[g] <= 0)
                    continue;
                double rest = total - ex[g];
                rest += max0(loads[g] + swing - T);
                const double gain = E - rest;
                const int cost = (int)s->held[xe * G + g] - (int)s->held[y * G + g];
                if (!(gain > ES_TOL * T) || cost > spare)
                    continue;
                const double eff = gain / ((double)cost > ES_FREE_COST ? (double)cost : ES_FREE_COST);
                if (eff > best_eff) {
                    best_eff = eff, best_swing = swing, best_grow = grow;
                    best_k = k, best_m = m, best_g = g;
                }
            }
        }
    }
    const int64_t y = eb + top_slots[pick[best_k]], xe = eb + x[best_m];
    const double *ry = rel + pick[best_k] * G;
    for (Py_ssize_t g = 0; g < G; g++)
        after[g] = ry[g] + (double)s->on_rank[xe * G + g] * best_grow;
    after[best_g] += best_swing;
    out->eff = best_eff;
    out->rank = best_g;
    out->new_ = y;
    out->donor = xe;
    out->cost = (int64_t)s->held[xe * G + best_g] - (int64_t)s->held[y * G + best_g];
}

/* ------------------------------------------------------------------ pair swaps */

Py_ssize_t es_pairs(const EsState *s, int64_t l, int64_t i, const double *RL, double t, double *scratch, EsPair *out)
{
    const Py_ssize_t N = s->N, G = s->G, S = s->S, Gn = s->Gn, half = Gn / 2;
    if (Gn < 2)
        return 0;
    int64_t *order = (int64_t *)scratch;
    int *cost_a = (int *)(order + Gn), *cost_b = cost_a + S;
    float *la = (float *)(cost_b + S), *lb = la + S;
    const int64_t rN = l * N, spare = s->limit[l] - s->moves[l];
    const int64_t *cur = s->cur;
    const double *sl = s->slot_load;
    int64_t spent = 0;
    Py_ssize_t M = 0;
    for (Py_ssize_t nd = 0; nd < s->nodes; nd++) {
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
        /* the k-th heaviest (above the goal) with the k-th lightest */
        for (Py_ssize_t k = 0; k < half; k++) {
            const int64_t ro = order[k], ru = order[Gn - 1 - k];
            if (!(RL[ro] > t))
                continue;
            const double a = RL[ro] - t, b = RL[ru] - t;
            const float a3 = (float)a, b3 = (float)b, mid = (float)(0.5 * (a - b)), bpos = max0f(b3);
            const int64_t fo = l * s->P + ro * S, fu = l * s->P + ru * S;
            for (Py_ssize_t j = 0; j < S; j++) {
                la[j] = (float)sl[fo + j];
                lb[j] = (float)sl[fu + j];
                cost_b[j] = 1 - s->held[(rN + cur[fo + j]) * G + ru] - s->moved[fo + j]; /* u's slot gets it */
                cost_a[j] = 1 - s->held[(rN + cur[fu + j]) * G + ro] - s->moved[fu + j]; /* o's slot gets it */
            }
            static const float per_cost[5] = {2.0f, 2.0f, 2.0f, 1.0f, 0.5f};
            float best = 0.0f;
            Py_ssize_t ia = 0, ib = 0;
            for (Py_ssize_t x = 0; x < S; x++)
                for (Py_ssize_t y = 0; y < S; y++) {
                    const float d = la[x] - lb[y];
                    float gain = a3 <= d ? a3 : d;
                    gain -= max0f(b3 + d);
                    gain += bpos;
                    /* / max(cost, 0.5) with cost in -2..2 is * 2, 2, 2, 1 or 0.5: the same rounding */
                    gain *= per_cost[cost_b[x] + cost_a[y] + 2];
                    float tie = d - mid;
                    tie = fabsf(tie);
                    tie *= (float)ES_TIE;
                    gain -= tie;
                    if ((x == 0 && y == 0) || gain > best) {
                        best = gain;
                        ia = x, ib = y;
                    }
                }
            const double eff = (double)best;
            const int64_t cost = (int64_t)cost_b[ia] + cost_a[ib];
            int good = eff > ES_SWAP_TOL * t;
            spent += good ? (cost > 0 ? cost : 0) : 0;
            good = good && spent <= spare;
            EsPair *pair = out + M++;
            pair->layer = i;
            pair->eff = good ? eff : -INFINITY;
            pair->slot_a = ro * S + ia;
            pair->slot_b = ru * S + ib;
            pair->o = ro;
            pair->u = ru;
            pair->cost = cost;
            pair->delta = sl[fo + ia] - sl[fu + ib];
        }
    }
    return M;
}

/* ------------------------------------------------------------------ widened swap */

int es_widened(const EsState *s, int64_t l, double *scratch, int64_t *slot_a, int64_t *slot_b)
{
    const Py_ssize_t N = s->N, G = s->G, S = s->S, Gn = s->Gn;
    const Py_ssize_t k = ES_WIDE_PARTNERS < Gn - 1 ? ES_WIDE_PARTNERS : Gn - 1;
    *slot_a = *slot_b = 0;
    if (k <= 0)
        return 0;
    double *key = scratch;
    int64_t *partners = (int64_t *)(key + G);
    const int64_t rN = l * N;
    const int64_t *cur = s->cur;
    const double *sl = s->slot_load, *RL = s->rank_load + l * G, T = s->goal[l];
    const int64_t top = es_argmax(RL, G), node = top / Gn;
    for (Py_ssize_t g = 0; g < G; g++)
        key[g] = (g / Gn == node && g != top) ? RL[g] : INFINITY;
    smallest_stable(key, G, k, partners);
    const double a = RL[top] - T;
    double best = -INFINITY;
    Py_ssize_t best_x = 0, best_q = 0, best_y = 0;
    int first = 1;
    for (Py_ssize_t x = 0; x < S; x++) {
        const int64_t fa = l * s->P + top * S + x;
        for (Py_ssize_t q = 0; q < k; q++) {
            const int64_t rq = partners[q];
            const int ok_partner = rq / Gn == node && rq != top;
            const double b = RL[rq] - T;
            for (Py_ssize_t y = 0; y < S; y++) {
                const int64_t fb = l * s->P + rq * S + y;
                const double d = sl[fa] - sl[fb];
                const double gain = max0(a) + max0(b) - max0(a - d) - max0(b + d);
                const int64_t cost_a = 1 - (int64_t)s->held[(rN + cur[fb]) * G + top] - s->moved[fb];
                const int64_t cost_b = 1 - (int64_t)s->held[(rN + cur[fa]) * G + rq] - s->moved[fa];
                const int64_t cost = cost_b + cost_a;
                const int ok = gain > ES_TOL * T && ok_partner && s->moves[l] + cost <= s->limit[l];
                const double eff = ok ? gain / ((double)cost > ES_FREE_COST ? (double)cost : ES_FREE_COST) : -INFINITY;
                if (first || eff > best) {
                    first = 0;
                    best = eff;
                    best_x = x, best_q = q, best_y = y;
                }
            }
        }
    }
    if (!isfinite(best))
        return 0;
    *slot_a = top * S + best_x;
    *slot_b = partners[best_q] * S + best_y;
    return 1;
}

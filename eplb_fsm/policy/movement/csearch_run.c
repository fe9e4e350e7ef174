/* The movement-aware search's round loop and its state updates (search.py in C).
 *
 * es_run is SearchState.run: every round scores the live layers (csearch_score.c), makes
 * each layer's plan (a re-point and/or swaps), in the round that can meet the budget
 * keeps only the plans that cut the sum of layer maxima most per moved slot (and for a
 * layer without a re-point the best prefix of its pairs: moves.best_prefix), applies
 * them, and gives idle layers a widened swap. es_swap / es_recount are SearchState.swap /
 * SearchState.recount for one change. csearch.h says how all of it follows the numpy code.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "csearch.h"

void es_set_slot(EsState *s, int64_t l, int64_t slot, int64_t expert)
{
    const int64_t flat = l * s->P + slot, base = l * s->N * s->G + slot / s->S;
    s->on_rank[base + s->cur[flat] * s->G] -= 1;
    s->on_rank[base + expert * s->G] += 1;
    s->cur[flat] = expert;
    const int8_t moved = (int8_t)(1 - s->held[base + expert * s->G]); /* the expert is new to the rank */
    s->moves[l] += moved - s->moved[flat];
    s->moved[flat] = moved;
}

void es_reload(EsState *s, int64_t l)
{
    const int64_t *row = s->cur + l * s->P;
    double *load = s->slot_load + l * s->P;
    for (Py_ssize_t p = 0; p < s->P; p++) {
        const int64_t e = l * s->N + row[p];
        load[p] = s->w[e] / (double)s->count[e];
    }
    for (Py_ssize_t g = 0; g < s->G; g++)
        s->rank_load[l * s->G + g] = es_pairwise_sum(load + g * s->S, s->S);
}

void es_swap(EsState *s, int64_t l, int64_t slot_a, int64_t slot_b)
{
    const int64_t fa = l * s->P + slot_a, fb = l * s->P + slot_b;
    const int64_t xa = s->cur[fa], xb = s->cur[fb];
    const double la = s->slot_load[fa], lb = s->slot_load[fb];
    es_set_slot(s, l, slot_a, xb);
    es_set_slot(s, l, slot_b, xa);
    s->slot_load[fa] = lb;
    s->slot_load[fb] = la;
    s->rank_load[l * s->G + slot_a / s->S] += lb - la;
    s->rank_load[l * s->G + slot_b / s->S] += la - lb;
}

void es_recount(EsState *s, int64_t l, int64_t slot, int64_t expert)
{
    s->count[l * s->N + s->cur[l * s->P + slot]] -= 1;
    s->count[l * s->N + expert] += 1;
    es_set_slot(s, l, slot, expert);
    es_reload(s, l);
}

static double row_max(const double *a, Py_ssize_t n)
{
    double m = a[0];
    for (Py_ssize_t i = 1; i < n; i++)
        if (a[i] > m)
            m = a[i];
    return m;
}

/* np.searchsorted(a, key) (side "left"), numpy's binary search step for step */
static Py_ssize_t search_left(const double *a, Py_ssize_t n, double key)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        const Py_ssize_t mid = lo + ((hi - lo) >> 1);
        if (a[mid] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static double searched_max_sum(const EsState *s, const double *layer_max, const int64_t *searched, Py_ssize_t n,
                               double *tmp)
{
    for (Py_ssize_t j = 0; j < n; j++)
        tmp[j] = layer_max[searched[j]];
    return es_pairwise_sum(tmp, n);
}

static inline double per_slot(int64_t cost) { return (double)cost > ES_FREE_COST ? (double)cost : ES_FREE_COST; }

Py_ssize_t es_run(EsState *s, double budget, double fixed_max, Py_ssize_t max_rounds, Py_ssize_t rounds)
{
    const Py_ssize_t A = s->A, G = s->G, cap = A * s->nodes * (s->Gn / 2) + 1;
    const Py_ssize_t nd = es_scratch_doubles(s);
    /* one block: doubles, then int64, then EsRepoint / EsPair / EsKeyed, then bytes */
    const size_t doubles = (size_t)(nd + 6 * A + 2 * A * G + G), longs = (size_t)(6 * A);
    char *block = malloc(sizeof(double) * doubles + sizeof(int64_t) * longs + sizeof(EsRepoint) * A
                         + sizeof(EsPair) * cap + sizeof(EsKeyed) * (A + 1) + (size_t)(6 * A + cap));
    if (!block)
        return -1;
    double *scratch = (double *)block, *layer_max = scratch + nd, *value = layer_max + A, *p_value = value + A;
    double *best_swap = p_value + A, *tmp = best_swap + A, *cum = tmp + A, *rp_after = cum + A;
    double *after = rp_after + A * G, *shift = after + A * G;
    int64_t *searched = (int64_t *)(shift + G), *lr = searched + A, *cost = lr + A, *p_cost = cost + A,
            *keep = p_cost + A, *spent = keep + A;
    EsRepoint *rp = (EsRepoint *)(spent + A);
    EsPair *pairs = (EsPair *)(rp + A);
    EsKeyed *ranked = (EsKeyed *)(pairs + cap);
    int8_t *live = (int8_t *)(ranked + A + 1), *has_rp = live + A, *use_rp = has_rp + A, *acts = use_rp + A,
           *take = acts + A, *no_rp = take + A, *pick = no_rp + A;

    Py_ssize_t n_searched = 0;
    for (Py_ssize_t l = 0; l < A; l++) {
        layer_max[l] = row_max(s->rank_load + l * G, G);
        live[l] = layer_max[l] > s->goal[l];
        if (live[l])
            searched[n_searched++] = l;
    }
    int repoints_pay = 1; /* until a round where (almost) no layer takes one */
    while (rounds < max_rounds) {
        Py_ssize_t n = 0;
        for (Py_ssize_t l = 0; l < A; l++)
            if (live[l])
                lr[n++] = l;
        if (n == 0 || (double)n < ES_FEW_LIVE_SHARE * (double)n_searched)
            break;
        rounds++;
        const int first_rounds = rounds <= ES_REPOINT_FIRST_ROUNDS;
        int any_rp = 0;
        memset(has_rp, 0, (size_t)n);
        if (rounds <= ES_REPOINT_ROUNDS && repoints_pay)
            for (Py_ssize_t i = 0; i < n; i++) {
                es_repoint(s, lr[i], s->rank_load + lr[i] * G, s->goal[lr[i]], scratch, rp + i, rp_after + i * G);
                has_rp[i] = isfinite(rp[i].eff) != 0;
                any_rp |= has_rp[i];
            }
        /* swaps: in the first rounds only for layers without a useful re-point */
        int waiting = 0;
        Py_ssize_t M = 0;
        if (any_rp && first_rounds) {
            Py_ssize_t without = 0;
            for (Py_ssize_t i = 0; i < n; i++)
                without += !has_rp[i];
            waiting = (double)without <= ES_SWAP_WAIT_SHARE * (double)n;
            if (!waiting)
                for (Py_ssize_t i = 0; i < n; i++)
                    if (!has_rp[i])
                        M += es_pairs(s, lr[i], i, s->rank_load + lr[i] * G, s->goal[lr[i]], scratch, pairs + M);
        } else {
            for (Py_ssize_t i = 0; i < n; i++)
                M += es_pairs(s, lr[i], i, s->rank_load + lr[i] * G, s->goal[lr[i]], scratch, pairs + M);
        }
        const int have_swaps = M > 0;
        for (Py_ssize_t i = 0; i < n; i++)
            use_rp[i] = any_rp && has_rp[i];
        if (any_rp && !first_rounds && have_swaps) {
            /* a re-point must beat the layer's best swap */
            for (Py_ssize_t i = 0; i < n; i++)
                best_swap[i] = -INFINITY;
            for (Py_ssize_t m = 0; m < M; m++)
                if (pairs[m].eff > best_swap[pairs[m].layer])
                    best_swap[pairs[m].layer] = pairs[m].eff;
            any_rp = 0;
            for (Py_ssize_t i = 0; i < n; i++) {
                use_rp[i] = has_rp[i] && rp[i].eff >= best_swap[i];
                any_rp |= use_rp[i];
            }
        }
        /* the round's plan per layer: loads after (n, G), cost, whether it acts */
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(after + i * G, use_rp[i] ? rp_after + i * G : s->rank_load + lr[i] * G, sizeof(double) * G);
            cost[i] = use_rp[i] ? rp[i].cost : 0;
            acts[i] = use_rp[i];
            spent[i] = 0;
        }
        for (Py_ssize_t m = 0; m < M; m++) {
            const EsPair *q = pairs + m;
            int ok = isfinite(q->eff) != 0;
            if (ok && use_rp[q->layer]) {
                /* next to a re-point, only pairs of ranks holding neither its new expert nor its donor */
                const EsRepoint *r = rp + q->layer;
                const int8_t *on_new = s->on_rank + r->new_ * G, *on_donor = s->on_rank + r->donor * G;
                const int touched = on_new[q->o] > 0 || on_donor[q->o] > 0 || on_new[q->u] > 0 || on_donor[q->u] > 0;
                ok = !touched;
                /* ... and only the first pairs whose cost, with the re-point's, fits the move limit */
                if (ok) {
                    const int64_t l = lr[q->layer];
                    spent[q->layer] += q->cost > 0 ? q->cost : 0;
                    ok = spent[q->layer] + r->cost <= s->limit[l] - s->moves[l];
                }
            }
            pick[m] = (int8_t)ok;
            const double moved_load = ok ? q->delta : 0.0;
            after[q->layer * G + q->o] -= moved_load;
            after[q->layer * G + q->u] += moved_load;
            cost[q->layer] += ok ? q->cost : 0;
            acts[q->layer] |= (int8_t)ok;
        }
        /* if this round can meet the budget, carry out only the plans that cut the sum of
         * layer maxima most per moved slot, and stop after it */
        const double need = fixed_max + searched_max_sum(s, layer_max, searched, n_searched, tmp) - budget;
        for (Py_ssize_t i = 0; i < n; i++)
            value[i] = acts[i] ? layer_max[lr[i]] - row_max(after + i * G, G) : 0.0;
        const int last = need > 0 && es_pairwise_sum(value, n) >= need;
        if (last) {
            for (Py_ssize_t i = 0; i < n; i++)
                keep[i] = INT64_MAX;
            if (have_swaps) {
                /* moves.best_prefix: a layer without a re-point may carry out only its first pairs */
                Py_ssize_t m = 0;
                for (Py_ssize_t i = 0; i < n; i++) {
                    no_rp[i] = !(any_rp && use_rp[i]);
                    p_value[i] = value[i];
                    p_cost[i] = cost[i];
                    const Py_ssize_t start = m;
                    while (m < M && pairs[m].layer == i)
                        m++;
                    if (!no_rp[i] || m == start)
                        continue;
                    const double *RL = s->rank_load + lr[i] * G, top = row_max(RL, G);
                    for (Py_ssize_t g = 0; g < G; g++)
                        shift[g] = 0.0;
                    int64_t c = 0, best_c = 0;
                    double best_eff = -INFINITY, best_v = 0.0;
                    Py_ssize_t best_j = 0;
                    for (Py_ssize_t j = start; j < m; j++) {
                        const double moved_load = pick[j] ? pairs[j].delta : 0.0;
                        shift[pairs[j].o] += -moved_load;
                        shift[pairs[j].u] += moved_load;
                        c += pick[j] ? pairs[j].cost : 0;
                        double hi = RL[0] + shift[0];
                        for (Py_ssize_t g = 1; g < G; g++)
                            if (RL[g] + shift[g] > hi)
                                hi = RL[g] + shift[g];
                        const double v = top - hi;
                        const double eff = v > 0 ? v / per_slot(c) : -INFINITY;
                        if (j == start || eff > best_eff)
                            best_eff = eff, best_v = v, best_c = c, best_j = j - start;
                    }
                    if (isfinite(best_eff) && best_eff > value[i] / per_slot(cost[i])) {
                        p_value[i] = best_v;
                        p_cost[i] = best_c;
                        keep[i] = best_j + 1;
                    }
                }
                if (es_pairwise_sum(p_value, n) >= need) {
                    memcpy(value, p_value, sizeof(double) * n);
                    memcpy(cost, p_cost, sizeof(int64_t) * n);
                } else {
                    for (Py_ssize_t i = 0; i < n; i++)
                        keep[i] = INT64_MAX;
                }
            }
            /* np.lexsort((-value, -value / max(cost, FREE_COST))): the best value per slot first */
            for (Py_ssize_t i = 0; i < n; i++) {
                ranked[i].key1 = -value[i] / per_slot(cost[i]);
                ranked[i].key2 = -value[i];
                ranked[i].index = i;
            }
            qsort(ranked, (size_t)n, sizeof(EsKeyed), es_by_keys);
            double run = 0.0;
            for (Py_ssize_t j = 0; j < n; j++) {
                run = j ? run + value[ranked[j].index] : value[ranked[j].index];
                cum[j] = run;
            }
            Py_ssize_t upto = search_left(cum, n, need) + 1;
            if (upto > n)
                upto = n;
            memset(take, 0, (size_t)n);
            for (Py_ssize_t j = 0; j < upto; j++)
                take[ranked[j].index] = 1;
            if (any_rp) {
                any_rp = 0;
                for (Py_ssize_t i = 0; i < n; i++) {
                    use_rp[i] = use_rp[i] && take[i];
                    any_rp |= use_rp[i];
                }
            }
            Py_ssize_t start = 0;
            for (Py_ssize_t m = 0; m < M; m++) {
                if (m && pairs[m].layer != pairs[m - 1].layer)
                    start = m;
                pick[m] = pick[m] && take[pairs[m].layer] && (int64_t)(m - start) < keep[pairs[m].layer];
            }
            for (Py_ssize_t i = 0; i < n; i++)
                acts[i] = acts[i] && take[i];
        }
        for (Py_ssize_t m = 0; m < M; m++)
            if (pick[m])
                es_swap(s, lr[pairs[m].layer], pairs[m].slot_a, pairs[m].slot_b);
        Py_ssize_t taken = 0;
        if (any_rp)
            for (Py_ssize_t i = 0; i < n; i++) {
                if (!use_rp[i])
                    continue;
                taken++;
                const int64_t l = lr[i], donor = rp[i].donor - l * s->N;
                /* the freed slot: the first one of the chosen rank holding the donor */
                const int64_t *first = s->cur + l * s->P + rp[i].rank * s->S;
                Py_ssize_t at = 0;
                for (Py_ssize_t j = 0; j < s->S; j++)
                    if (first[j] == donor) {
                        at = j;
                        break;
                    }
                es_recount(s, l, rp[i].rank * s->S + at, rp[i].new_ - l * s->N);
            }
        repoints_pay = (double)taken > ES_REPOINT_MIN_SHARE * (double)n;
        if (last)
            break;
        if (!waiting)
            for (Py_ssize_t i = 0; i < n; i++) {
                if (acts[i])
                    continue;
                int64_t slot_a, slot_b;
                if (es_widened(s, lr[i], scratch, &slot_a, &slot_b))
                    es_swap(s, lr[i], slot_a, slot_b);
                else
                    live[lr[i]] = 0;
            }
        for (Py_ssize_t l = 0; l < A; l++) {
            layer_max[l] = row_max(s->rank_load + l * G, G);
            live[l] = live[l] && layer_max[l] > s->goal[l] && s->moves[l] < s->limit[l];
        }
        if (fixed_max + searched_max_sum(s, layer_max, searched, n_searched, tmp) <= budget)
            break;
    }
    free(block);
    return rounds;
}

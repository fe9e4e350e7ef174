/* The movement-aware policy's one-pass replica-count fix (search.rebalance_counts in C), and
 * the search state's slot counts per rank (placement.rank_counts, es_rank_counts).
 *
 * Experts far above the default's load per replica get more replicas before the search:
 * expert e wants ceil(w_e / cap - 1e-9) - c_e more, an expert can spare what it has above
 * max(1, that ceiling); in every (layer, node) as many replicas change hands as both
 * sides allow, within the layer's move limit (nodes in order). The neediest experts
 * (largest load per replica) take first, the experts that suffer least (smallest load
 * per replica after giving one up) give first, a giver frees its slots on its lightest
 * ranks, and the new replicas, neediest first, go to the freed slots lightest rank first.
 * Every order is numpy's stable argsort of the same float64 keys (node * span + key,
 * with span from all the layers that need a change), rebuilt by qsort on (key, index)
 * (es_by_keys).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "csearch.h"

/* np.argsort(key, kind="stable") of n keys into order (n) */
static void stable_order(EsKeyed *tmp, const double *key, Py_ssize_t n, int64_t *order)
{
    for (Py_ssize_t i = 0; i < n; i++)
        tmp[i].key1 = key[i], tmp[i].key2 = 0.0, tmp[i].index = i;
    qsort(tmp, (size_t)n, sizeof(EsKeyed), es_by_keys);
    for (Py_ssize_t i = 0; i < n; i++)
        order[i] = tmp[i].index;
}

/* search._take for one layer: up to moves[node] units of amount, experts in order */
static void take_units(const int64_t *amount, const int64_t *order, const int64_t *node, const int64_t *moves,
                       Py_ssize_t N, Py_ssize_t width, int64_t *start, int64_t *got)
{
    for (Py_ssize_t j = 0; j < width; j++)
        start[j] = -1;
    int64_t before = 0;
    for (Py_ssize_t i = 0; i < N; i++) {
        const int64_t e = order[i], a = amount[e], nd = width == 1 ? 0 : node[e];
        if (start[nd] < 0)
            start[nd] = before; /* units before the node's first expert in the order */
        const int64_t mine = before - start[nd];
        int64_t g = moves[nd] - mine;
        g = g < 0 ? 0 : g > a ? a : g;
        got[e] = g;
        before += a;
    }
}

int es_rebalance_counts(EsState *s, const double *cap)
{
    const Py_ssize_t A = s->A, N = s->N, P = s->P, S = s->S, G = s->G, width = s->nodes;
    int64_t *need = malloc(sizeof(int64_t) * (size_t)(2 * A * N)), *spare = need + A * N; /* above / below the floor */
    int8_t *some = malloc((size_t)(A > 0 ? A : 1));
    if (!need || !some) {
        free(need);
        free(some);
        return -1;
    }
    int any = 0;
    for (Py_ssize_t l = 0; l < A; l++) {
        some[l] = 0;
        const double c = cap[l] > 1e-300 ? cap[l] : 1e-300;
        for (Py_ssize_t e = 0; e < N; e++) {
            double f = ceil(s->w[l * N + e] / c - 1e-9);
            f = f >= 1 ? f : 1;
            const int64_t d = (int64_t)f - s->count[l * N + e];
            need[l * N + e] = d > 0 ? d : 0;
            spare[l * N + e] = d < 0 ? -d : 0;
            some[l] |= d > 0;
        }
        any |= some[l];
    }
    if (!any) {
        free(need);
        free(some);
        return 0;
    }
    /* spans over every layer that needs a change (numpy takes them over the whole array) */
    double span_take = 0.0, span_give = 0.0, span_slot = 0.0;
    for (Py_ssize_t l = 0; l < A; l++) {
        if (!some[l])
            continue;
        for (Py_ssize_t e = 0; e < N; e++) {
            const double w = s->w[l * N + e];
            const int64_t c = s->count[l * N + e];
            const double t = fabs(-(w / (double)c)), g = fabs(w / (double)(c - 1 > 1 ? c - 1 : 1));
            span_take = t > span_take ? t : span_take;
            span_give = g > span_give ? g : span_give;
        }
        for (Py_ssize_t g = 0; g < G; g++)
            span_slot = s->rank_load[l * G + g] > span_slot ? s->rank_load[l * G + g] : span_slot;
    }
    span_take = span_take * 4 + 1.0, span_give = span_give * 4 + 1.0, span_slot = span_slot * 4 + 1.0;

    const Py_ssize_t big = N > P ? N : P;
    char *block = malloc(sizeof(EsKeyed) * big + sizeof(double) * big + sizeof(int64_t) * (7 * big + 4 * width));
    if (!block) {
        free(need);
        free(some);
        return -1;
    }
    EsKeyed *tmp = (EsKeyed *)block;
    double *key = (double *)(tmp + big);
    int64_t *take_order = (int64_t *)(key + big), *give_order = take_order + big;
    int64_t *gets = give_order + big, *gives = gets + big, *slot_order = gives + big, *freed_order = slot_order + big;
    int64_t *first = freed_order + big, *moves = first + big, *total_need = moves + width;
    int64_t *total_spare = total_need + width;
    int64_t *start = total_spare + width;
    int8_t *freed = (int8_t *)key; /* reused once the keys of the slot order are consumed */
    for (Py_ssize_t l = 0; l < A; l++) {
        if (!some[l])
            continue;
        const double *w = s->w + l * N;
        const int64_t *count = s->count + l * N, *node = s->node + l * N, *nd_l = need + l * N, *sp_l = spare + l * N;
        for (Py_ssize_t j = 0; j < width; j++)
            total_need[j] = total_spare[j] = 0;
        for (Py_ssize_t e = 0; e < N; e++) {
            const Py_ssize_t nd = width == 1 ? 0 : node[e];
            total_need[nd] += nd_l[e];
            total_spare[nd] += sp_l[e];
        }
        /* replicas changing hands per node, within the layer's move limit, nodes in order */
        int64_t room = s->limit[l] - s->moves[l], used = 0, total = 0;
        room = room > 0 ? room : 0;
        for (Py_ssize_t j = 0; j < width; j++) {
            const int64_t m = total_need[j] < total_spare[j] ? total_need[j] : total_spare[j];
            int64_t k = room - used;
            k = k < 0 ? 0 : k > m ? m : k;
            moves[j] = k;
            used += m;
            total += k;
        }
        if (total == 0)
            continue;
        for (Py_ssize_t e = 0; e < N; e++)
            key[e] = (double)(width == 1 ? 0 : node[e]) * span_take + -(w[e] / (double)count[e]);
        stable_order(tmp, key, N, take_order); /* neediest first */
        take_units(nd_l, take_order, node, moves, N, width, start, gets);
        for (Py_ssize_t e = 0; e < N; e++)
            key[e] = (double)(width == 1 ? 0 : node[e]) * span_give
                     + w[e] / (double)(count[e] - 1 > 1 ? count[e] - 1 : 1);
        stable_order(tmp, key, N, give_order); /* least harmed first */
        take_units(sp_l, give_order, node, moves, N, width, start, gives);
        /* each giver frees its slots on its lightest ranks: slots by (expert, rank load) */
        const int64_t *cur = s->cur + l * P;
        const double *rl = s->rank_load + l * G;
        for (Py_ssize_t p = 0; p < P; p++)
            key[p] = (double)cur[p] * span_slot + rl[p / S];
        stable_order(tmp, key, P, slot_order);
        int64_t acc = 0;
        for (Py_ssize_t e = 0; e < N; e++)
            first[e] = acc, acc += count[e];
        memset(freed, 0, (size_t)P);
        for (Py_ssize_t q = 0; q < P; q++) {
            const int64_t e = cur[slot_order[q]];
            freed[slot_order[q]] = (int64_t)q - first[e] < gives[e];
        }
        /* freed slots node-major, lightest rank first (numpy sorts the others as +inf) */
        for (Py_ssize_t p = 0; p < P; p++)
            tmp[p].key1 = freed[p] ? (double)((p / S) / s->Gn) * span_slot + rl[p / S] : INFINITY, tmp[p].key2 = 0.0,
            tmp[p].index = p;
        qsort(tmp, (size_t)P, sizeof(EsKeyed), es_by_keys);
        for (Py_ssize_t p = 0; p < P; p++)
            freed_order[p] = tmp[p].index;
        /* new replica j goes to the expert whose run of new replicas (neediest first) covers j */
        Py_ssize_t i = 0;
        int64_t end = gets[take_order[0]];
        for (int64_t j = 0; j < total; j++) {
            while (i < N - 1 && end <= j)
                end += gets[take_order[++i]];
            Py_ssize_t at = end <= j ? N : i; /* searchsorted(ends, j, "right"), clipped below */
            at = at > N - 1 ? N - 1 : at;
            const int64_t slot = freed_order[j], expert = take_order[at];
            /* SearchState.recount(distinct=False): counts, then the slot; loads once after */
            s->count[l * N + cur[slot]] -= 1;
            s->count[l * N + expert] += 1;
            es_set_slot(s, l, slot, expert);
        }
        es_reload(s, l);
    }
    free(block);
    free(need);
    free(some);
    return 0;
}

void es_rank_counts(const int64_t *phy, int8_t *out, Py_ssize_t L, Py_ssize_t N, Py_ssize_t P, Py_ssize_t G)
{
    memset(out, 0, (size_t)(L * N * G));
    const Py_ssize_t S = P / G;
    for (Py_ssize_t l = 0; l < L; l++)
        for (Py_ssize_t q = 0; q < P; q++) {
            const int64_t e = phy[l * P + q];
            if (e >= 0)
                out[(l * N + e) * G + q / S] += 1;
        }
}

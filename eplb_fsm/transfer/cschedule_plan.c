/* The transfer schedule's planning core (cschedule.h): pairing, row classes, the
 * local-copy order, commit entries and the commit split. No Python objects here. */
#include "cschedule.h"

#include <stdlib.h>
#include <string.h>

static int cmp_transfer(const void *a, const void *b)
{
    int64_t x = ((const Transfer *)a)->key, y = ((const Transfer *)b)->key;
    return (x > y) - (x < y);
}

/* local_copies.order_local_copies on n copies dst[i] <- src[i] (dst distinct, ascending):
 * writes direct_* in commit order and staged_* ascending by dst. work: 5 n ints. */
static void order_local(const int64_t *dst, const int64_t *src, Py_ssize_t n, RankLayer *out, int64_t *work)
{
    int64_t *waiting = work, *writer_of_src = work + n, *path = work + 2 * n;
    char *done = (char *)(work + 3 * n), *ready = done + n;
    out->n_direct = out->n_staged = 0;
    if (n == 0) return;
    for (Py_ssize_t i = 0; i < n; i++) {
        waiting[i] = 0;
        writer_of_src[i] = -1;
        done[i] = ready[i] = 0;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        for (Py_ssize_t j = 0; j < n; j++) {
            if (src[j] == dst[i]) waiting[i]++;      /* copies that still read row dst[i] */
            if (dst[j] == src[i]) writer_of_src[i] = j;
        }
    for (Py_ssize_t i = 0; i < n; i++) ready[i] = waiting[i] == 0;
    Py_ssize_t placed = 0;
#define RELEASE(i) do { int64_t w_ = writer_of_src[i]; \
        if (w_ >= 0 && --waiting[w_] == 0 && !done[w_]) ready[w_] = 1; } while (0)
    while (placed < n) {
        for (;;) { /* the ready copy with the lowest destination row (what the heap pops) */
            Py_ssize_t best = -1;
            for (Py_ssize_t i = 0; i < n; i++)
                if (ready[i] && !done[i] && (best < 0 || dst[i] < dst[best])) best = i;
            if (best < 0) break;
            done[best] = 1;
            out->direct_dst[out->n_direct] = dst[best];
            out->direct_src[out->n_direct++] = src[best];
            placed++;
            RELEASE(best);
        }
        if (placed == n) break;
        /* every copy left writes a row a copy left reads: walk to a cycle from the lowest
         * row, always to the lowest pending reader, and stage the cycle's lowest row */
        Py_ssize_t i = -1;
        for (Py_ssize_t c = 0; c < n; c++) {
            path[c] = -1;
            if (!done[c] && (i < 0 || dst[c] < dst[i])) i = c;
        }
        int64_t len = 0;
        while (path[i] < 0) {
            path[i] = len++;
            Py_ssize_t next = -1;
            for (Py_ssize_t r = 0; r < n; r++)
                if (!done[r] && src[r] == dst[i] && (next < 0 || dst[r] < dst[next])) next = r;
            i = next;
        }
        Py_ssize_t x = -1;
        for (Py_ssize_t c = 0; c < n; c++)
            if (path[c] >= path[i] && (x < 0 || dst[c] < dst[x])) x = c;
        done[x] = 1;
        out->staged_dst[out->n_staged] = dst[x];
        out->staged_src[out->n_staged++] = src[x];
        placed++;
        RELEASE(x);
    }
#undef RELEASE
    for (Py_ssize_t a = 1; a < out->n_staged; a++) /* ascending by row (few entries) */
        for (Py_ssize_t b = a; b > 0 && out->staged_dst[b] < out->staged_dst[b - 1]; b--) {
            int64_t t = out->staged_dst[b]; out->staged_dst[b] = out->staged_dst[b - 1]; out->staged_dst[b - 1] = t;
            t = out->staged_src[b]; out->staged_src[b] = out->staged_src[b - 1]; out->staged_src[b - 1] = t;
        }
}

/* plan.plan_from_transfers + schedule._commit_of for rank r of one layer */
void plan_rank(const int64_t *o, const int64_t *nw, Py_ssize_t s, const Transfer *t, Py_ssize_t nt,
               int64_t r, RankLayer *out, int64_t *work)
{
    int64_t *local_dst = work, *local_src = work + s, *more = work + 2 * s;
    Py_ssize_t n_local = 0;
    out->n_commit = 0;
    memset(out->overwritten, 0, (size_t)s);
    for (Py_ssize_t row = 0; row < s; row++) {
        int64_t e = nw[row];
        if (e < 0 || e == o[row]) continue; /* empty, unchanged */
        Py_ssize_t j = 0;
        while (j < s && o[j] != e) j++;
        if (j < s) { /* local: from this rank's first old row holding e */
            local_dst[n_local] = row;
            local_src[n_local++] = j;
            continue;
        }
        Py_ssize_t first = 0; /* remote: the first row needing e is its primary */
        while (nw[first] != e) first++;
        out->dst[out->n_commit] = row; /* primary reads its own buffer row, a duplicate its primary's */
        out->src[out->n_commit++] = first;
    }
    order_local(local_dst, local_src, n_local, out, more);
    /* commit entries: staged, primary and duplicate rows, ascending by row (all distinct) */
    for (Py_ssize_t i = 0; i < out->n_staged; i++) {
        out->dst[out->n_commit] = out->src[out->n_commit] = out->staged_dst[i];
        out->n_commit++;
    }
    for (Py_ssize_t a = 1; a < out->n_commit; a++)
        for (Py_ssize_t b = a; b > 0 && out->dst[b] < out->dst[b - 1]; b--) {
            int64_t x = out->dst[b]; out->dst[b] = out->dst[b - 1]; out->dst[b - 1] = x;
            x = out->src[b]; out->src[b] = out->src[b - 1]; out->src[b - 1] = x;
        }
    for (Py_ssize_t i = 0; i < nt; i++)
        if (t[i].dst == r) out->overwritten[t[i].dst_row] = 1;
    for (Py_ssize_t i = 0; i < out->n_staged; i++) out->overwritten[out->staged_dst[i]] = 1;
}

/* schedule._split_runs of prev's commit against the rows nxt overwrites: the entries
 * whose buffer row nxt writes (early) and the rest (late); whether the direct copies go
 * early (an early write hits a row one of them reads). Each output array: n_commit rows. */
int split_rows(const RankLayer *prev, const RankLayer *nxt, int64_t *e_dst, int64_t *e_src, Py_ssize_t *ne,
               int64_t *l_dst, int64_t *l_src, Py_ssize_t *nl)
{
    int direct_early = 0;
    *ne = *nl = 0;
    for (Py_ssize_t i = 0; i < prev->n_commit; i++) {
        if (nxt->overwritten[prev->src[i]]) {
            e_dst[*ne] = prev->dst[i];
            e_src[(*ne)++] = prev->src[i];
            for (Py_ssize_t d = 0; d < prev->n_direct && !direct_early; d++)
                if (prev->direct_src[d] == prev->dst[i]) direct_early = 1;
        } else {
            l_dst[*nl] = prev->dst[i];
            l_src[(*nl)++] = prev->src[i];
        }
    }
    return direct_early;
}

/* the layer's transfers, every rank's (plan.layer_transfers), sorted by (src, dst, expert).
 * old_first / new_first: (G, P) tables, all -1 on entry and again on return. */
Py_ssize_t layer_transfers(const int64_t *o, const int64_t *nw, Py_ssize_t p, Py_ssize_t g, Py_ssize_t s,
                           Transfer *t, int64_t *old_first, int64_t *new_first, int64_t *n_hold,
                           int64_t *n_recv, int64_t *hold_at, int64_t *holders)
{
    /* first row of each rank holding / needing each expert */
    for (Py_ssize_t q = 0; q < g; q++)
        for (Py_ssize_t row = s - 1; row >= 0; row--) {
            int64_t e = o[q * s + row];
            if (e >= 0) old_first[q * p + e] = row;
            e = nw[q * s + row];
            if (e >= 0) new_first[q * p + e] = row;
        }
    for (Py_ssize_t e = 0; e < p; e++) n_hold[e] = n_recv[e] = 0;
    Py_ssize_t nt = 0;
    for (Py_ssize_t q = 0; q < g; q++) /* receivers, ascending rank: their position per expert */
        for (Py_ssize_t row = 0; row < s; row++) {
            int64_t e = nw[q * s + row];
            if (e < 0 || new_first[q * p + e] != row || old_first[q * p + e] >= 0) continue;
            t[nt].dst = q;
            t[nt].expert = e;
            t[nt].dst_row = row;
            t[nt++].key = n_recv[e]++; /* the receiver's index among its expert's */
        }
    /* holders of the experts someone receives, ascending rank (a rank counts at its first row) */
    for (Py_ssize_t i = 0; i < g * s; i++) {
        int64_t e = o[i];
        if (e >= 0 && n_recv[e] && old_first[(i / s) * p + e] == i % s) n_hold[e]++;
    }
    int64_t at = 0;
    for (Py_ssize_t e = 0; e < p; e++) { hold_at[e] = at; at += n_hold[e]; n_hold[e] = 0; }
    for (Py_ssize_t i = 0; i < g * s; i++) {
        int64_t e = o[i];
        if (e >= 0 && n_recv[e] && old_first[(i / s) * p + e] == i % s) holders[hold_at[e] + n_hold[e]++] = i / s;
    }
    for (Py_ssize_t i = 0; i < nt; i++) {
        int64_t e = t[i].expert, j = t[i].key, se = n_hold[e], k = n_recv[e] / se;
        /* receivers below S_e k go in blocks of k; the remainder one per sender */
        int64_t sender = j < se * k ? j / (k > 1 ? k : 1) : j - se * k;
        t[i].src = holders[hold_at[e] + sender];
        t[i].src_row = old_first[t[i].src * p + e];
        t[i].key = (t[i].src * g + t[i].dst) * p + e;
    }
    for (Py_ssize_t i = 0; i < g * s; i++) { /* back to -1 for the next layer */
        if (o[i] >= 0) old_first[(i / s) * p + o[i]] = -1;
        if (nw[i] >= 0) new_first[(i / s) * p + nw[i]] = -1;
    }
    if (nt > 1) qsort(t, (size_t)nt, sizeof(Transfer), cmp_transfer);
    return nt;
}

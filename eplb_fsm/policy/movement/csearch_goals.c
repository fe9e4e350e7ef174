/* The movement-aware policy's per-layer goals in flat mode (targets.lagrange_levels in C).
 *
 * Each layer's ranks sorted by load, heaviest first; fixing k of them gives the goal
 * max(R[l, k], floor[l]). A price mu per fixed rank picks, in every layer, the k that
 * maximises (reduction of its max - mu * k); mu is the largest price on a grid whose
 * plan still reduces the sum of maxima by what the budget needs, found by bisection on
 * a geometric grid of 40 prices and then on 64 prices between the two that bracket it.
 * Same float64 operations as the numpy code, sums over layers in numpy's pairwise order.
 */
#include <math.h>
#include <stdlib.h>

#include "csearch.h"

static int descending(const void *pa, const void *pb)
{
    const double a = *(const double *)pa, b = *(const double *)pb;
    return a > b ? -1 : a < b;
}

/* the plan at price mu: every layer's pick and the total reduction */
static double plan(const double *reduction, Py_ssize_t n, Py_ssize_t width, double mu, int64_t *pick, double *gathered)
{
    for (Py_ssize_t l = 0; l < n; l++) {
        const double *row = reduction + l * width;
        Py_ssize_t best = 0;
        double best_v = row[0] - mu * 0.0;
        for (Py_ssize_t j = 1; j < width; j++) {
            const double v = row[j] - mu * (double)j;
            if (v > best_v)
                best_v = v, best = j;
        }
        pick[l] = best;
        gathered[l] = row[best];
    }
    return es_pairwise_sum(gathered, n);
}

/* the largest index of the ascending prices whose plan still reduces by need (-1 if none) */
static Py_ssize_t largest_fit(const double *reduction, Py_ssize_t n, Py_ssize_t width, const double *mu,
                              Py_ssize_t size, double need, int64_t *pick, int64_t *best, double *gathered)
{
    Py_ssize_t lo = -1, hi = size;
    while (hi - lo > 1) {
        const Py_ssize_t mid = (lo + hi) / 2;
        if (plan(reduction, n, width, mu[mid], pick, gathered) >= need) {
            lo = mid;
            for (Py_ssize_t l = 0; l < n; l++)
                best[l] = pick[l];
        } else {
            hi = mid;
        }
    }
    return lo;
}

int es_lagrange_levels(const double *rank_loads, const double *floor, double budget, double *goal, Py_ssize_t n,
                       Py_ssize_t G)
{
    double *r = malloc(sizeof(double) * (size_t)(n * G + n + n * (G + 1) + 104));
    int64_t *pick = malloc(sizeof(int64_t) * (size_t)(2 * n + 1));
    if (!r || !pick) {
        free(r);
        free(pick);
        return -1;
    }
    double *gathered = r + n * G, *level = gathered + n, *mu = level + n * (G + 1);
    int64_t *best = pick + n;
    for (Py_ssize_t l = 0; l < n; l++) {
        for (Py_ssize_t g = 0; g < G; g++)
            r[l * G + g] = rank_loads[l * G + g];
        qsort(r + l * G, (size_t)G, sizeof(double), descending);
        gathered[l] = r[l * G];
    }
    const double need = es_pairwise_sum(gathered, n) - budget;
    if (need <= 0) {
        for (Py_ssize_t l = 0; l < n; l++)
            goal[l] = r[l * G];
        goto done;
    }
    /* past the first rank at or below its floor every level is the floor: keep the ranks that matter */
    Py_ssize_t width = 0;
    for (Py_ssize_t l = 0; l < n; l++) {
        Py_ssize_t above = 0;
        for (Py_ssize_t g = 0; g < G; g++)
            above += r[l * G + g] > floor[l];
        width = above > width ? above : width;
    }
    width += 1;
    double top = -INFINITY;
    for (Py_ssize_t l = 0; l < n; l++) {
        double *lv = level + l * width;
        for (Py_ssize_t j = 0; j < width; j++) {
            const double v = j < G ? r[l * G + j] : floor[l];
            lv[j] = v >= floor[l] ? v : floor[l];
        }
        const double first = lv[0];
        for (Py_ssize_t j = 0; j < width; j++) {
            lv[j] = first - lv[j]; /* the reduction of the layer's max when k = j ranks are fixed */
            top = lv[j] > top ? lv[j] : top;
        }
    }
    const double *reduction = level;
    const double hi0 = top + 1.0;
    for (int i = 0; i < 40; i++)
        mu[i] = hi0 * ldexp(1.0, -(39 - i)); /* hi * 0.5 ** arange(40)[::-1] */
    double lo_mu = 0.0, hi_mu = hi0;
    Py_ssize_t size = 40;
    for (Py_ssize_t l = 0; l < n; l++)
        best[l] = width - 1;
    for (int round = 0; round < 2; round++) {
        const Py_ssize_t i = largest_fit(reduction, n, width, mu, size, need, pick, best, gathered);
        if (i >= 0) {
            lo_mu = mu[i];
            hi_mu = i + 1 < size ? mu[i + 1] : hi_mu;
        } else {
            hi_mu = mu[0];
        }
        const double step = (hi_mu - lo_mu) / 65;
        for (int k = 0; k < 64; k++)
            mu[k] = lo_mu + (double)(k + 1) * step;
        size = 64;
    }
    for (Py_ssize_t l = 0; l < n; l++) {
        /* level = first - reduction, read back from the sorted loads */
        const Py_ssize_t j = best[l];
        const double v = j < G ? r[l * G + j] : floor[l];
        goal[l] = v >= floor[l] ? v : floor[l];
    }
done:
    free(r);
    free(pick);
    return 0;
}

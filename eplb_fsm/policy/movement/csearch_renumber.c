/* The movement-aware fallback's renumbering (targets.renumbered_default in C).
 *
 * The default's placement of a layer, its ranks renumbered to keep as many experts where
 * they were (targets.relabel_ranks: the greedy matching of targets._greedy_assignment on
 * how many slots of new rank q hold experts old rank g held; with nodes > 1 whole nodes
 * first, then ranks inside matched nodes), the plain numbering where that moves less,
 * then every rank's rows aligned with the old ones (targets.align_rows).
 */
#include <stdlib.h>
#include <string.h>

#include "csearch.h"

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

int es_renumber_default(const int64_t *old, const uint8_t *held, const int64_t *new_, int64_t *out, int64_t *moved,
                        Py_ssize_t L, Py_ssize_t N, Py_ssize_t P, Py_ssize_t G, Py_ssize_t nodes)
{
    const Py_ssize_t S = P / G, Gn = G / nodes;
    /* scratch, widest type first (aligned): relabeled (P) and per-rank int64 vectors, then
     * overlap, score and work (G*G int32 each) and int32 vectors, then bytes */
    char *block = malloc(sizeof(int64_t) * (P + 5 * G) + sizeof(int32_t) * (3 * G * G + 2 * G) + G + S);
    if (!block)
        return -1;
    int64_t *relabeled = (int64_t *)block, *target = relabeled + P, *node_target = target + G;
    int64_t *inner = node_target + G, *choice = inner + G, *winner = choice + G;
    int32_t *overlap = (int32_t *)(winner + G), *score = overlap + G * G, *work = score + G * G;
    int32_t *col_block = work + G * G, *value = col_block + G;
    int8_t *row_free = (int8_t *)(value + G), *used = row_free + G;
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
    free(block);
    return 0;
}

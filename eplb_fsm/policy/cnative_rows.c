/* The default policy's row kernels: replication + balanced packing of one row (cnative.c,
 * the Python module, describes what they compute and calls them).
 *
 * cn_place_one_row replicates a row's items (each extra slot to the largest load /
 * replicas) and packs the replicas with cn_pack_items, which eplb_fsm/policy/cnative.c
 * also calls to pack a layer's groups onto its nodes. No -ffast-math: every float
 * operation must round as numpy's float32 ones do.
 */
#include "cnative.h"

#include <stdlib.h>
#include <string.h>

#define SORT2(a, b)                        \
    do {                                   \
        uint64_t lo_ = a < b ? a : b;      \
        uint64_t hi_ = a < b ? b : a;      \
        a = lo_;                           \
        b = hi_;                           \
    } while (0)

/* Sort 8 keys in place: the 19-comparator network (branch-free: the comparisons of a
 * row's loads are unpredictable, and a mispredicted branch costs more than the swap). */
static void sort8(uint64_t *k)
{
    uint64_t a0 = k[0], a1 = k[1], a2 = k[2], a3 = k[3], a4 = k[4], a5 = k[5], a6 = k[6], a7 = k[7];
    SORT2(a0, a2); SORT2(a1, a3); SORT2(a4, a6); SORT2(a5, a7);
    SORT2(a0, a4); SORT2(a1, a5); SORT2(a2, a6); SORT2(a3, a7);
    SORT2(a0, a1); SORT2(a2, a3); SORT2(a4, a5); SORT2(a6, a7);
    SORT2(a2, a4); SORT2(a3, a5);
    SORT2(a1, a4); SORT2(a3, a6);
    SORT2(a1, a2); SORT2(a3, a4); SORT2(a5, a6);
    k[0] = a0; k[1] = a1; k[2] = a2; k[3] = a3; k[4] = a4; k[5] = a5; k[6] = a6; k[7] = a7;
}

/* Ascending sort of unique uint64 keys: runs of 8 by the network (a shorter last run by
 * insertion), then bottom-up merges whose inner step is branch-free. */
static void sort_keys(uint64_t *a, uint64_t *tmp, Py_ssize_t n)
{
    const Py_ssize_t run = 8;
    for (Py_ssize_t lo = 0; lo < n; lo += run) {
        if (lo + run <= n) {
            sort8(a + lo);
            continue;
        }
        for (Py_ssize_t i = lo + 1; i < n; i++) {
            uint64_t v = a[i];
            Py_ssize_t j = i;
            while (j > lo && a[j - 1] > v) {
                a[j] = a[j - 1];
                j--;
            }
            a[j] = v;
        }
    }
    uint64_t *src = a, *dst = tmp;
    for (Py_ssize_t width = run; width < n; width *= 2) {
        for (Py_ssize_t lo = 0; lo < n; lo += 2 * width) {
            Py_ssize_t mid = lo + width < n ? lo + width : n;
            Py_ssize_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            Py_ssize_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                uint64_t x = src[i], y = src[j];
                int take_right = y < x;
                dst[k++] = take_right ? y : x;
                j += take_right;
                i += !take_right;
            }
            while (i < mid) dst[k++] = src[i++];
            while (j < hi) dst[k++] = src[j++];
        }
        uint64_t *swap = src; src = dst; dst = swap;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof(uint64_t));
}

/* The bits of a float32 >= 0 as an unsigned integer that orders like the value (-0.0 as 0.0). */
static uint32_t order_bits(float x)
{
    uint32_t bits;
    x += 0.0f;  /* -0.0 + 0.0 = +0.0 */
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

/* Restore the max-heap property below position i of heap[0..n). */
static void sift_down(uint64_t *heap, Py_ssize_t n, Py_ssize_t i)
{
    uint64_t v = heap[i];
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap[c + 1] > heap[c]) c++;
        if (heap[c] <= v) break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = v;
}

int cn_scratch_alloc(Scratch *sc, Py_ssize_t items, Py_ssize_t slots, Py_ssize_t packs)
{
    Py_ssize_t width = 1;  /* the winner tree of pack_items: 2 * width keys */
    while (width < packs) width *= 2;
    size_t bytes = (size_t)slots * (2 * sizeof(uint64_t) + sizeof(int64_t) + sizeof(float))
                   + (size_t)items * (sizeof(uint64_t) + sizeof(float)) + (size_t)(2 * width) * sizeof(int64_t)
                   + (size_t)packs * (sizeof(Py_ssize_t) + sizeof(float));
    sc->block = malloc(bytes > 0 ? bytes : 1);
    if (sc->block == NULL) return -1;
    /* 8-byte fields first, then the 4-byte ones: every field stays aligned */
    sc->keys = (uint64_t *)sc->block;
    sc->tmp = sc->keys + slots;
    sc->heap = sc->tmp + slots;
    sc->replica = (int64_t *)(sc->heap + items);
    sc->pack_key = sc->replica + slots;
    sc->filled = (Py_ssize_t *)(sc->pack_key + 2 * width);
    sc->per = (float *)(sc->filled + packs);
    sc->replica_load = sc->per + items;
    sc->total = sc->replica_load + slots;
    return 0;
}

/* Item s into pack pick (pack_items' step): its total and arrival grow; returns the pack's
 * new key (INT64_MAX once full). */
static inline int64_t put_item(Py_ssize_t s, Py_ssize_t pick, const float *load, const int64_t *label,
                               Py_ssize_t capacity, int64_t *out, float *total, Py_ssize_t *filled)
{
    total[pick] += load[s];
    out[pick * capacity + filled[pick]] = label != NULL ? label[s] : s;
    filled[pick] += 1;
    return filled[pick] == capacity ? INT64_MAX : ((int64_t)order_bits(total[pick]) << 32) | pick;
}

/* Greedy balanced packing of one row: n items with loads load[0..n) (finite, >= 0) into
 * packs of n / packs, visited by descending load (ties: ascending index), each to the open
 * pack with the smallest float32 running total (lowest pack on ties). Writes
 * out[pack * (n / packs) + arrival] = label[item] (label NULL: the item itself). Needs
 * n / packs > 1 (one item per pack is item i -> pack i, the caller's case). */
__attribute__((optimize("no-tree-vectorize")))
void cn_pack_items(const float *load, const int64_t *label, Py_ssize_t n, Py_ssize_t packs, int64_t *out,
                   Scratch *sc)
{
    Py_ssize_t capacity = n / packs;
    uint64_t *keys = sc->keys;
    float *total = sc->total;
    Py_ssize_t *filled = sc->filled;
    for (Py_ssize_t s = 0; s < n; s++)
        keys[s] = ((uint64_t)(0x7FFFFFFFu - order_bits(load[s])) << 32) | (uint64_t)s;
    sort_keys(keys, sc->tmp, n);
    /* A pack's key: its total's order bits, then its index (so the smallest key is the
     * lightest pack, lowest index on ties); a full pack's key is above every open one, and
     * an open pack exists for every item, so a full key (its low bits no index) never
     * wins. */
    for (Py_ssize_t p = 0; p < packs; p++) {
        total[p] = 0.0f;
        filled[p] = 0;
    }
    if (packs <= 8) {
        /* Eight keys (the missing packs' as full ones), their least found by a tree of
         * independent minima: three steps deep instead of seven in a row. */
        int64_t key8[8];
        for (Py_ssize_t p = 0; p < 8; p++) key8[p] = p < packs ? ((int64_t)order_bits(0.0f) << 32) | p : INT64_MAX;
        for (Py_ssize_t k = 0; k < n; k++) {
            Py_ssize_t s = (Py_ssize_t)(keys[k] & 0xFFFFFFFFu);
            int64_t m01 = key8[0] < key8[1] ? key8[0] : key8[1], m23 = key8[2] < key8[3] ? key8[2] : key8[3];
            int64_t m45 = key8[4] < key8[5] ? key8[4] : key8[5], m67 = key8[6] < key8[7] ? key8[6] : key8[7];
            int64_t m03 = m01 < m23 ? m01 : m23, m47 = m45 < m67 ? m45 : m67;
            Py_ssize_t pick = (Py_ssize_t)((m03 < m47 ? m03 : m47) & 0xFFFFFFFFu);
            key8[pick] = put_item(s, pick, load, label, capacity, out, total, filled);
        }
        return;
    }
    /* More packs: a winner tree over the keys (leaves at [width, 2 * width), node i the
     * least of nodes 2i and 2i + 1, the root at 1). Filling a pack changes one leaf and
     * the log2(width) nodes above it, each a branch-free minimum. */
    Py_ssize_t width = 1;
    while (width < packs) width *= 2;
    int64_t *tree = sc->pack_key;
    for (Py_ssize_t p = 0; p < width; p++)
        tree[width + p] = p < packs ? ((int64_t)order_bits(0.0f) << 32) | p : INT64_MAX;
    for (Py_ssize_t i = width - 1; i >= 1; i--) tree[i] = tree[2 * i] < tree[2 * i + 1] ? tree[2 * i] : tree[2 * i + 1];
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t s = (Py_ssize_t)(keys[k] & 0xFFFFFFFFu);
        Py_ssize_t pick = (Py_ssize_t)(tree[1] & 0xFFFFFFFFu);
        Py_ssize_t i = width + pick;
        tree[i] = put_item(s, pick, load, label, capacity, out, total, filled);
        for (i /= 2; i >= 1; i /= 2) tree[i] = tree[2 * i] < tree[2 * i + 1] ? tree[2 * i] : tree[2 * i + 1];
    }
}

/* Replication and packing of one row (see the module comment): w (items) -> slot_item
 * (slots), count (items). */
void cn_place_one_row(const float *w, int64_t *slot_item, int64_t *count, Py_ssize_t items, Py_ssize_t slots,
                      Py_ssize_t packs, Scratch *sc)
{
    float *per = sc->per;
    int64_t *replica = sc->replica;
    uint64_t *heap = sc->heap;
    /* Replication: a max-heap of item keys, (order bits of load / replicas, then the
     * reversed index): its top is numpy's argmax (largest value, first index). Each extra
     * slot takes the top item and sifts its new, smaller key down: log(items) steps. */
    for (Py_ssize_t i = 0; i < items; i++) {
        per[i] = w[i] + 0.0f;  /* -0.0 as 0.0: equal in every comparison below */
        count[i] = 1;
        replica[i] = i;
        heap[i] = ((uint64_t)order_bits(per[i]) << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)i);
    }
    if (slots > items) {
        for (Py_ssize_t i = items / 2 - 1; i >= 0; i--) sift_down(heap, items, i);
        for (Py_ssize_t s = items; s < slots; s++) {
            Py_ssize_t best = (Py_ssize_t)(0xFFFFFFFFu - (uint32_t)(heap[0] & 0xFFFFFFFFu));
            replica[s] = best;
            count[best] += 1;
            per[best] = w[best] / (float)count[best] + 0.0f;
            heap[0] = ((uint64_t)order_bits(per[best]) << 32) | (heap[0] & 0xFFFFFFFFu);
            sift_down(heap, items, 0);
        }
    }
    if (slots == packs) {  /* replica i alone in pack i, whatever the loads */
        for (Py_ssize_t s = 0; s < slots; s++) slot_item[s] = replica[s];
        return;
    }
    for (Py_ssize_t s = 0; s < slots; s++) sc->replica_load[s] = per[replica[s]];
    cn_pack_items(sc->replica_load, replica, slots, packs, slot_item, sc);
}

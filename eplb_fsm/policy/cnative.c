/* The default policy's per-row loops in C: replication + balanced packing, and log2phy.
 *
 * eplb_fsm/policy/native.py is the Python face of this module (and the fallback when it
 * is not built); the numpy implementation in default.py / packing.py defines the results
 * and the tests check both against each other and against policy/reference.py.
 *
 * place_rows(w, slot_item, count, rows, items, slots, packs)
 *     w          (rows, items) float32, finite, >= 0 (read-only buffer)
 *     slot_item  (rows, slots) int64, written: the item each slot holds, slots ordered
 *                pack-major (slot = pack * (slots / packs) + arrival in the pack)
 *     count      (rows, items) int64, written: replicas of each item
 *   Per row: slot i < items holds item i; each further slot goes to the item with the
 *   largest load / replicas (float32, first maximum). Replicas (each carrying its item's
 *   final load / replicas) are visited by descending load, ties by ascending replica
 *   index, and each goes to the open pack with the smallest float32 running total
 *   (lowest pack on ties). One replica per pack (slots == packs): replica i -> pack i.
 *
 * place_layers(w, group_load, phy2log, replica_count, layers, experts, groups, nodes, slots, ranks)
 *     w              (layers, experts) float32, finite, >= 0
 *     group_load     (layers, groups) float32: each group's load as torch sums it (the
 *                    reference's call, so bit-identical); ignored when groups == 1
 *     phy2log        (layers, slots) int64, written; replica_count (layers, experts) int64
 *   docs/design.md §5 for every layer: the groups (groups / nodes per node) packed onto the
 *   nodes as place_rows packs (one group per node: group i -> node i), then each node's
 *   experts, its groups in arrival order, replicated and packed onto its ranks as by
 *   place_rows. groups = nodes = 1 is the global mode. The same placement as
 *   default.rebalance_hierarchical's numpy path.
 *
 * slots_of_experts(phy2log, log2phy, layers, slots, experts, width)
 *     phy2log    (layers, slots) int64, every entry in [0, experts)
 *     log2phy    (layers, experts, width) int64, written: each expert's slots ascending,
 *                padded with -1
 *   Raises ValueError if a slot names no expert, an expert has no slot, or more than
 *   width slots.
 *
 * All three release the GIL while they run. No -ffast-math: every float operation must round
 * as numpy's float32 ones do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
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

/* Scratch of place_one_row and pack_items for rows of up to `items` items, `slots` slots
 * and `packs` packs, in one allocation. */
typedef struct {
    char *block;
    uint64_t *keys, *tmp, *heap;
    int64_t *replica, *pack_key;
    Py_ssize_t *filled;
    float *per, *replica_load, *total;
} Scratch;

static int scratch_alloc(Scratch *sc, Py_ssize_t items, Py_ssize_t slots, Py_ssize_t packs)
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
static void pack_items(const float *load, const int64_t *label, Py_ssize_t n, Py_ssize_t packs, int64_t *out,
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
    for (Py_ssize_t p = 0; p < width; p++) tree[width + p] = p < packs ? ((int64_t)order_bits(0.0f) << 32) | p : INT64_MAX;
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
static void place_one_row(const float *w, int64_t *slot_item, int64_t *count, Py_ssize_t items, Py_ssize_t slots,
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
    pack_items(sc->replica_load, replica, slots, packs, slot_item, sc);
}

static PyObject *place_rows(PyObject *self, PyObject *args)
{
    Py_buffer w, slot_item, count;
    Py_ssize_t rows, items, slots, packs;
    if (!PyArg_ParseTuple(args, "y*w*w*nnnn", &w, &slot_item, &count, &rows, &items, &slots, &packs))
        return NULL;
    PyObject *result = NULL;
    if (rows < 0 || items < 1 || slots < items || packs < 1 || slots % packs != 0 || slots >= ((Py_ssize_t)1 << 31)) {
        PyErr_SetString(PyExc_ValueError, "place_rows: needs rows >= 0, 1 <= items <= slots < 2**31, packs dividing slots");
        goto done;
    }
    if (w.len != rows * items * (Py_ssize_t)sizeof(float) || slot_item.len != rows * slots * (Py_ssize_t)sizeof(int64_t)
        || count.len != rows * items * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "place_rows: buffer sizes do not match (rows, items, slots)");
        goto done;
    }
    Scratch sc;
    if (scratch_alloc(&sc, items, slots, packs) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    const float *wp = (const float *)w.buf;
    int64_t *sp = (int64_t *)slot_item.buf, *cp = (int64_t *)count.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++)
        place_one_row(wp + r * items, sp + r * slots, cp + r * items, items, slots, packs, &sc);
    Py_END_ALLOW_THREADS
    free(sc.block);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&slot_item);
    PyBuffer_Release(&count);
    return result;
}

static PyObject *place_layers(PyObject *self, PyObject *args)
{
    Py_buffer w, group_load, phy2log, replica_count;
    Py_ssize_t layers, experts, groups, nodes, slots, ranks;
    if (!PyArg_ParseTuple(args, "y*y*w*w*nnnnnn", &w, &group_load, &phy2log, &replica_count, &layers, &experts,
                          &groups, &nodes, &slots, &ranks))
        return NULL;
    PyObject *result = NULL;
    if (layers < 0 || experts < 1 || groups < 1 || nodes < 1 || ranks < 1 || groups % nodes != 0
        || experts % groups != 0 || ranks % nodes != 0 || slots < experts || slots % ranks != 0
        || slots >= ((Py_ssize_t)1 << 31)) {
        PyErr_SetString(PyExc_ValueError, "place_layers: needs groups | experts, nodes | groups, nodes | ranks, "
                                          "ranks | slots, experts <= slots < 2**31");
        goto done;
    }
    if (w.len != layers * experts * (Py_ssize_t)sizeof(float)
        || (groups > 1 && group_load.len != layers * groups * (Py_ssize_t)sizeof(float))
        || phy2log.len != layers * slots * (Py_ssize_t)sizeof(int64_t)
        || replica_count.len != layers * experts * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "place_layers: buffer sizes do not match (layers, experts, groups, slots)");
        goto done;
    }
    Py_ssize_t group_size = experts / groups, groups_per_node = groups / nodes, experts_per_node = experts / nodes;
    Py_ssize_t slots_per_node = slots / nodes, ranks_per_node = ranks / nodes;
    /* The row (one node of one layer) is packed into its ranks, the groups of a layer into
     * its nodes: one scratch serves both. */
    Scratch sc;
    if (scratch_alloc(&sc, experts_per_node, slots_per_node > groups ? slots_per_node : groups,
                      ranks_per_node > nodes ? ranks_per_node : nodes) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    char *rows = malloc((size_t)experts_per_node * (sizeof(float) + sizeof(int64_t))
                        + (size_t)slots_per_node * sizeof(int64_t) + (size_t)groups * sizeof(int64_t));
    if (rows == NULL) {
        free(sc.block);
        PyErr_NoMemory();
        goto done;
    }
    int64_t *node_item = (int64_t *)rows, *node_count = node_item + slots_per_node;
    int64_t *group_at = node_count + experts_per_node;  /* group at each node-major position */
    float *node_w = (float *)(group_at + groups);
    const float *wp = (const float *)w.buf, *gp = (const float *)group_load.buf;
    int64_t *pp = (int64_t *)phy2log.buf, *cp = (int64_t *)replica_count.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t l = 0; l < layers; l++) {
        const float *layer_w = wp + l * experts;
        if (groups_per_node > 1)  /* 1. groups onto nodes */
            pack_items(gp + l * groups, NULL, groups, nodes, group_at, &sc);
        else
            for (Py_ssize_t g = 0; g < groups; g++) group_at[g] = g;
        for (Py_ssize_t n = 0; n < nodes; n++) {
            const int64_t *node_groups = group_at + n * groups_per_node;
            for (Py_ssize_t r = 0; r < groups_per_node; r++)  /* the node's experts, its groups in arrival order */
                memcpy(node_w + r * group_size, layer_w + node_groups[r] * group_size, (size_t)group_size * sizeof(float));
            place_one_row(node_w, node_item, node_count, experts_per_node, slots_per_node, ranks_per_node, &sc);
            int64_t *slot_out = pp + l * slots + n * slots_per_node;
            for (Py_ssize_t k = 0; k < slots_per_node; k++) {
                int64_t i = node_item[k];
                slot_out[k] = node_groups[i / group_size] * group_size + i % group_size;
            }
            for (Py_ssize_t r = 0; r < groups_per_node; r++)
                memcpy(cp + l * experts + node_groups[r] * group_size, node_count + r * group_size,
                       (size_t)group_size * sizeof(int64_t));
        }
    }
    Py_END_ALLOW_THREADS
    free(rows);
    free(sc.block);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&group_load);
    PyBuffer_Release(&phy2log);
    PyBuffer_Release(&replica_count);
    return result;
}

static PyObject *slots_of_experts(PyObject *self, PyObject *args)
{
    Py_buffer phy2log, log2phy;
    Py_ssize_t layers, slots, experts, width;
    if (!PyArg_ParseTuple(args, "y*w*nnnn", &phy2log, &log2phy, &layers, &slots, &experts, &width))
        return NULL;
    PyObject *result = NULL;
    if (layers < 0 || slots < 1 || experts < 1 || width < 1 || phy2log.len != layers * slots * (Py_ssize_t)sizeof(int64_t)
        || log2phy.len != layers * experts * width * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "slots_of_experts: buffer sizes do not match (layers, slots, experts, width)");
        goto done;
    }
    Py_ssize_t *seen = malloc((size_t)experts * sizeof(Py_ssize_t));
    if (seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *src = (const int64_t *)phy2log.buf;
    int64_t *out = (int64_t *)log2phy.buf;
    int bad = 0;  /* 1: a slot names no expert; 2: an expert has no slot; 3: more than width */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t l = 0; l < layers && !bad; l++) {
        memset(seen, 0, (size_t)experts * sizeof(Py_ssize_t));
        int64_t *layer_out = out + l * experts * width;
        /* -1 is all 0xFF bytes; filled a layer at a time, so the slots written next land in
         * cache lines just filled (one pass over the output, whatever its size) */
        memset(layer_out, 0xFF, (size_t)(experts * width) * sizeof(int64_t));
        for (Py_ssize_t s = 0; s < slots; s++) {
            int64_t e = src[l * slots + s];
            if (e < 0 || e >= experts) { bad = 1; break; }
            if (seen[e] >= width) { bad = 3; break; }
            layer_out[e * width + seen[e]++] = s;
        }
        for (Py_ssize_t e = 0; e < experts && !bad; e++)
            if (seen[e] == 0) bad = 2;
    }
    Py_END_ALLOW_THREADS
    free(seen);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad == 1 ? "slots_of_experts: every slot must hold an expert in [0, experts)"
                                          : bad == 2 ? "slots_of_experts: every expert needs at least one slot"
                                                     : "slots_of_experts: an expert has more slots than max_replicas");
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&phy2log);
    PyBuffer_Release(&log2phy);
    return result;
}

static PyMethodDef methods[] = {
    {"place_rows", place_rows, METH_VARARGS, "Replicate and pack every row (see the module comment)."},
    {"place_layers", place_layers, METH_VARARGS, "The whole placement of every layer (see the module comment)."},
    {"slots_of_experts", slots_of_experts, METH_VARARGS, "log2phy of a full placement (see the module comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cnative", "The default policy's row loops in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit_cnative(void) { return PyModule_Create(&module); }

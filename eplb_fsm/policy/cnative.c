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
 * slots_of_experts(phy2log, log2phy, layers, slots, experts, width)
 *     phy2log    (layers, slots) int64, every entry in [0, experts)
 *     log2phy    (layers, experts, width) int64, written: each expert's slots ascending,
 *                padded with -1
 *   Raises ValueError if a slot names no expert, an expert has no slot, or more than
 *   width slots.
 *
 * Both release the GIL while they run. No -ffast-math: every float operation must round
 * as numpy's float32 ones do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Ascending sort of unique uint64 keys: insertion sort on runs of 8, then bottom-up merges
 * whose inner step is branch-free (the comparisons are unpredictable by nature). */
static void sort_keys(uint64_t *a, uint64_t *tmp, Py_ssize_t n)
{
    const Py_ssize_t run = 8;
    for (Py_ssize_t lo = 0; lo < n; lo += run) {
        Py_ssize_t hi = lo + run < n ? lo + run : n;
        for (Py_ssize_t i = lo + 1; i < hi; i++) {
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

/* Restore the min-heap property of heap[0..n) after its top grew. */
static void sift_down_min(int64_t *heap, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    int64_t v = heap[0];
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap[c + 1] < heap[c]) c++;
        if (heap[c] >= v) break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = v;
}

__attribute__((optimize("no-tree-vectorize")))
static void place_one_row(const float *w, int64_t *slot_item, int64_t *count, Py_ssize_t items, Py_ssize_t slots,
                          Py_ssize_t packs, float *per, int64_t *replica, uint64_t *keys, uint64_t *tmp,
                          float *total, Py_ssize_t *filled, int64_t *pack_key, uint64_t *heap)
{
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
    Py_ssize_t capacity = slots / packs;
    if (capacity == 1) {  /* replica i alone in pack i, whatever the loads */
        for (Py_ssize_t s = 0; s < slots; s++) slot_item[s] = replica[s];
        return;
    }
    for (Py_ssize_t s = 0; s < slots; s++)
        keys[s] = ((uint64_t)(0x7FFFFFFFu - order_bits(per[replica[s]])) << 32) | (uint64_t)s;
    sort_keys(keys, tmp, slots);
    /* A pack's key: its total's order bits, then its index (so the smallest key is the
     * lightest pack, lowest index on ties); a full pack's key is above every open one. */
    for (Py_ssize_t p = 0; p < packs; p++) {
        total[p] = 0.0f;
        filled[p] = 0;
        pack_key[p] = ((int64_t)order_bits(0.0f) << 32) | p;
    }
    /* Few packs: a scan of the keys. Many: the keys as a min-heap (ascending keys already
     * are one), whose top is the pack to fill; its key only grows, so it sifts down. An
     * open pack exists for every replica, so a full key (its low bits no index) never tops. */
    int heap_packs = packs > 8;
    for (Py_ssize_t k = 0; k < slots; k++) {
        Py_ssize_t s = (Py_ssize_t)(keys[k] & 0xFFFFFFFFu);
        int64_t least = pack_key[0];
        if (!heap_packs)
            for (Py_ssize_t p = 1; p < packs; p++) least = pack_key[p] < least ? pack_key[p] : least;
        Py_ssize_t pick = (Py_ssize_t)(least & 0xFFFFFFFFu);
        total[pick] += per[replica[s]];
        slot_item[pick * capacity + filled[pick]] = replica[s];
        filled[pick] += 1;
        int64_t key = filled[pick] == capacity ? INT64_MAX : ((int64_t)order_bits(total[pick]) << 32) | pick;
        if (heap_packs) {
            pack_key[0] = key;
            sift_down_min(pack_key, packs);
        } else {
            pack_key[pick] = key;
        }
    }
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
    size_t bytes = (size_t)items * sizeof(float) + (size_t)slots * (sizeof(int64_t) + 2 * sizeof(uint64_t))
                   + (size_t)packs * (sizeof(float) + sizeof(Py_ssize_t) + sizeof(int64_t))
                   + (size_t)items * sizeof(uint64_t);
    char *scratch = malloc(bytes > 0 ? bytes : 1);
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *keys = (uint64_t *)scratch;
    uint64_t *tmp = keys + slots;
    int64_t *replica = (int64_t *)(tmp + slots);
    Py_ssize_t *filled = (Py_ssize_t *)(replica + slots);
    int64_t *pack_key = (int64_t *)(filled + packs);
    uint64_t *heap = (uint64_t *)(pack_key + packs);
    float *per = (float *)(heap + items);
    float *total = per + items;
    const float *wp = (const float *)w.buf;
    int64_t *sp = (int64_t *)slot_item.buf, *cp = (int64_t *)count.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++)
        place_one_row(wp + r * items, sp + r * slots, cp + r * items, items, slots, packs, per, replica, keys, tmp,
                      total, filled, pack_key, heap);
    Py_END_ALLOW_THREADS
    free(scratch);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&slot_item);
    PyBuffer_Release(&count);
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
    {"slots_of_experts", slots_of_experts, METH_VARARGS, "log2phy of a full placement (see the module comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cnative", "The default policy's row loops in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit_cnative(void) { return PyModule_Create(&module); }

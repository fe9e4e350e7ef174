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
 * as numpy's float32 ones do. The row kernels (replication, packing) are in cnative_rows.c.
 */
#include "cnative.h"

#include <stdlib.h>
#include <string.h>

static PyObject *place_rows(PyObject *self, PyObject *args)
{
    Py_buffer w, slot_item, count;
    Py_ssize_t rows, items, slots, packs;
    if (!PyArg_ParseTuple(args, "y*w*w*nnnn", &w, &slot_item, &count, &rows, &items, &slots, &packs))
        return NULL;
    PyObject *result = NULL;
    if (rows < 0 || items < 1 || slots < items || packs < 1 || slots % packs != 0
        || slots >= ((Py_ssize_t)1 << 31)) {
        PyErr_SetString(PyExc_ValueError,
                        "place_rows: needs rows >= 0, 1 <= items <= slots < 2**31, packs dividing slots");
        goto done;
    }
    if (w.len != rows * items * (Py_ssize_t)sizeof(float)
        || slot_item.len != rows * slots * (Py_ssize_t)sizeof(int64_t)
        || count.len != rows * items * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "place_rows: buffer sizes do not match (rows, items, slots)");
        goto done;
    }
    Scratch sc;
    if (cn_scratch_alloc(&sc, items, slots, packs) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    const float *wp = (const float *)w.buf;
    int64_t *sp = (int64_t *)slot_item.buf, *cp = (int64_t *)count.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++)
        cn_place_one_row(wp + r * items, sp + r * slots, cp + r * items, items, slots, packs, &sc);
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
    if (cn_scratch_alloc(&sc, experts_per_node, slots_per_node > groups ? slots_per_node : groups,
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
            cn_pack_items(gp + l * groups, NULL, groups, nodes, group_at, &sc);
        else
            for (Py_ssize_t g = 0; g < groups; g++) group_at[g] = g;
        for (Py_ssize_t n = 0; n < nodes; n++) {
            const int64_t *node_groups = group_at + n * groups_per_node;
            for (Py_ssize_t r = 0; r < groups_per_node; r++)  /* the node's experts, its groups in arrival order */
                memcpy(node_w + r * group_size, layer_w + node_groups[r] * group_size,
                       (size_t)group_size * sizeof(float));
            cn_place_one_row(node_w, node_item, node_count, experts_per_node, slots_per_node, ranks_per_node, &sc);
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
    if (layers < 0 || slots < 1 || experts < 1 || width < 1
        || phy2log.len != layers * slots * (Py_ssize_t)sizeof(int64_t)
        || log2phy.len != layers * experts * width * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError,
                        "slots_of_experts: buffer sizes do not match (layers, slots, experts, width)");
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
        PyErr_SetString(PyExc_ValueError,
                        bad == 1   ? "slots_of_experts: every slot must hold an expert in [0, experts)"
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

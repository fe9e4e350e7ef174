/* The default policy's C kernels (cnative_rows.c), shared with the Python module (cnative.c).
 *
 * Only PyInit_cnative is exported from the extension: these stay hidden.
 */
#ifndef EPLB_CNATIVE_H
#define EPLB_CNATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define CN_HIDDEN __attribute__((visibility("hidden")))

/* Scratch of cn_place_one_row and cn_pack_items for rows of up to `items` items, `slots` slots
 * and `packs` packs, in one allocation. */
typedef struct {
    char *block;
    uint64_t *keys, *tmp, *heap;
    int64_t *replica, *pack_key;
    Py_ssize_t *filled;
    float *per, *replica_load, *total;
} Scratch;

/* The scratch for rows of up to `items` items, `slots` slots and `packs` packs; -1 when out of memory
 * (free sc->block after use). */
CN_HIDDEN int cn_scratch_alloc(Scratch *sc, Py_ssize_t items, Py_ssize_t slots, Py_ssize_t packs);
/* Greedy balanced packing of n items (finite loads >= 0) into packs of n / packs (n / packs > 1):
 * out[pack * (n / packs) + arrival] = label[item] (label NULL: the item itself). */
CN_HIDDEN void cn_pack_items(const float *load, const int64_t *label, Py_ssize_t n, Py_ssize_t packs, int64_t *out,
                             Scratch *sc);
/* Replication and packing of one row: w (items) -> slot_item (slots), count (items). */
CN_HIDDEN void cn_place_one_row(const float *w, int64_t *slot_item, int64_t *count, Py_ssize_t items,
                                Py_ssize_t slots, Py_ssize_t packs, Scratch *sc);

#endif

/* The transfer schedule's planning core in plain C (no Python objects): see cschedule.c.
 *
 * Every function follows the Python planner's rules exactly (transfer/plan.py,
 * plan_all.py, local_copies.py, schedule.py); tests/test_transfer_native_schedule.py
 * compares the two on random maps.
 */
#ifndef EPLB_FSM_CSCHEDULE_H
#define EPLB_FSM_CSCHEDULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct { int64_t src, dst, expert, src_row, dst_row, key; } Transfer;

typedef struct {
    int64_t *dst, *src; /* commit entries (buffer -> weights), ascending dst */
    Py_ssize_t n_commit;
    int64_t *direct_dst, *direct_src; /* weights -> weights, in commit order */
    Py_ssize_t n_direct;
    int64_t *staged_dst, *staged_src; /* through the buffer, ascending dst */
    Py_ssize_t n_staged;
    char *overwritten; /* (S,) rows this layer's receives or staged copies write */
} RankLayer;

/* plan.layer_transfers for one layer: every rank's transfers, sorted by (src, dst,
 * expert); t holds P entries. old_first / new_first: (G, P) tables, all -1 on entry and
 * again on return; n_hold, n_recv, hold_at, holders: P each. Returns the count. */
Py_ssize_t layer_transfers(const int64_t *o, const int64_t *nw, Py_ssize_t p, Py_ssize_t g, Py_ssize_t s,
                           Transfer *t, int64_t *old_first, int64_t *new_first, int64_t *n_hold,
                           int64_t *n_recv, int64_t *hold_at, int64_t *holders);

/* plan.plan_from_transfers + schedule._commit_of for rank r of one layer (o, nw: its S
 * old and new rows); work: 7 S ints. */
void plan_rank(const int64_t *o, const int64_t *nw, Py_ssize_t s, const Transfer *t, Py_ssize_t nt,
               int64_t r, RankLayer *out, int64_t *work);

int split_rows(const RankLayer *prev, const RankLayer *nxt, int64_t *e_dst, int64_t *e_src, Py_ssize_t *ne,
               int64_t *l_dst, int64_t *l_src, Py_ssize_t *nl);

#endif

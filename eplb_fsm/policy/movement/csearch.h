/* The movement-aware search in C: shared declarations (csearch.c is the Python module).
 *
 * The numpy code of eplb_fsm/policy/movement (moves.py, search.py, targets.py) defines
 * every result; these loops follow its arithmetic operation for operation (float64 where
 * it uses float64, float32 where pair_swaps scores in float32, every sum of a contiguous
 * row as numpy's pairwise summation adds it), its tie-breaks (argmax takes the first
 * maximum, stable sorts keep index order) and its order of updates, so both paths reach
 * the same placements; the tests compare them call by call and plan by plan.
 *
 * Sizes: A searched layers, N experts, P slots, G ranks, S = P / G slots per rank,
 * nodes (> 1 only in hierarchical mode) of Gn = G / nodes ranks. Arrays are flat, C order.
 */
#ifndef EPLB_CSEARCH_H
#define EPLB_CSEARCH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* moves.py's and search.py's constants (a drift shows in the tests that compare both paths) */
#define ES_FREE_COST 0.5
#define ES_HOT_CANDIDATES 2
#define ES_DONOR_CANDIDATES 6
#define ES_WIDE_PARTNERS 8
#define ES_TIE 1e-4
#define ES_SWAP_TOL 1e-5
#define ES_TOL 1e-9
#define ES_REPOINT_ROUNDS 3
#define ES_REPOINT_MIN_SHARE 0.25
#define ES_REPOINT_FIRST_ROUNDS 2
#define ES_SWAP_WAIT_SHARE 0.25
#define ES_FEW_LIVE_SHARE 0.05

/* SearchState's arrays (search.py's module docstring), borrowed from numpy. */
typedef struct {
    Py_ssize_t A, N, P, G, S, nodes, Gn;
    const double *w;     /* (A*N) loads */
    int64_t *count;      /* (A*N) replica counts */
    int64_t *cur;        /* (A*P) placement */
    double *slot_load;   /* (A*P) expert load / count */
    double *rank_load;   /* (A*G) sums per rank */
    int8_t *on_rank;     /* (A*N*G) slots of expert e on rank g */
    const int8_t *held;  /* (A*N*G) old membership (0/1) */
    int8_t *moved;       /* (A*P) slot's expert new to its rank (0/1) */
    const int64_t *node; /* (A*N) node of every expert */
    int64_t *moves;      /* (A) moved slots per layer */
    const int64_t *limit;/* (A) moves a layer may spend */
    const double *goal;  /* (A) max rank load to reach */
} EsState;

/* A layer's best re-point (moves.repoints): eff -inf when none helps. */
typedef struct {
    double eff;
    int64_t rank, new_, donor, cost; /* new_ / donor: flat (layer, expert) */
} EsRepoint;

/* One rank pair's best swap (moves.pair_swaps). */
typedef struct {
    int64_t layer; /* index into the live layers */
    int64_t slot_a, slot_b, o, u, cost;
    double eff, delta;
} EsPair;

/* A sort key and its index: qsort with es_by_keys orders by (key1, key2, index), which is
 * numpy's stable argsort (key2 = 0 for a single key) or np.lexsort((key2, key1)). */
typedef struct {
    double key1, key2;
    int64_t index;
} EsKeyed;

int es_by_keys(const void *a, const void *b);
double es_pairwise_sum(const double *a, Py_ssize_t n);
Py_ssize_t es_argmax(const double *a, Py_ssize_t n);

/* scoring (csearch_score.c); scratch sizes from es_scratch_doubles */
Py_ssize_t es_scratch_doubles(const EsState *s);
void es_repoint(const EsState *s, int64_t l, const double *RL, double T, double *scratch, EsRepoint *out,
                double *after);
Py_ssize_t es_pairs(const EsState *s, int64_t l, int64_t i, const double *RL, double t, double *scratch, EsPair *out);
int es_widened(const EsState *s, int64_t l, double *scratch, int64_t *slot_a, int64_t *slot_b);

/* state updates and the round loop (csearch_run.c) */
/* SearchState.set_slots for one slot (counts are the caller's job; moves kept current) */
void es_set_slot(EsState *s, int64_t l, int64_t slot, int64_t expert);
/* layer l's slot and rank loads from its counts, as SearchState.recount recomputes them */
void es_reload(EsState *s, int64_t l);
void es_swap(EsState *s, int64_t l, int64_t slot_a, int64_t slot_b);
void es_recount(EsState *s, int64_t l, int64_t slot, int64_t expert);
/* SearchState.run: returns the rounds run (from `rounds`), -1 when out of memory */
Py_ssize_t es_run(EsState *s, double budget, double fixed_max, Py_ssize_t max_rounds, Py_ssize_t rounds);

/* search.rebalance_counts (csearch_counts.c): cap (A) the load per replica to reach; -1 when out of memory */
int es_rebalance_counts(EsState *s, const double *cap);
/* placement.rank_counts (csearch_counts.c): phy (L*P) experts in [-1, N) -> out (L*N*G) slots of e on rank g */
void es_rank_counts(const int64_t *phy, int8_t *out, Py_ssize_t L, Py_ssize_t N, Py_ssize_t P, Py_ssize_t G);

/* targets.lagrange_levels (csearch_goals.c): rank_loads (n*G), floor (n) -> goal (n); -1 when out of memory */
int es_lagrange_levels(const double *rank_loads, const double *floor, double budget, double *goal, Py_ssize_t n,
                       Py_ssize_t G);

/* the fallback's renumbering (csearch_renumber.c); -1 when out of memory */
int es_renumber_default(const int64_t *old, const uint8_t *held, const int64_t *new_, int64_t *out, int64_t *moved,
                        Py_ssize_t L, Py_ssize_t N, Py_ssize_t P, Py_ssize_t G, Py_ssize_t nodes);

#endif

"""Build hook for the optional C kernels: the default and movement-aware policies and the transfer schedule (everything else is in pyproject.toml).

``optional=True``: where no C compiler is found the build goes on without them and
``eplb_fsm.policy.native`` / ``eplb_fsm.policy.movement.native`` /
``eplb_fsm.transfer.native_schedule`` fall back to the numpy implementations.
"""

from setuptools import Extension, setup

# no fast-math and no fused multiply-adds: the C loops must round as numpy's float ops do
FLOAT_AS_NUMPY = ["-O3", "-fno-fast-math", "-ffp-contract=off"]
SEARCH_SOURCES = ("csearch", "csearch_score", "csearch_run", "csearch_counts", "csearch_goals", "csearch_renumber")

setup(
    ext_modules=[
        Extension("eplb_fsm.policy.cnative", ["eplb_fsm/policy/cnative.c", "eplb_fsm/policy/cnative_rows.c"],
                  depends=["eplb_fsm/policy/cnative.h"], optional=True, extra_compile_args=FLOAT_AS_NUMPY),
        Extension("eplb_fsm.transfer.cschedule",
                  ["eplb_fsm/transfer/cschedule.c", "eplb_fsm/transfer/cschedule_plan.c"],
                  depends=["eplb_fsm/transfer/cschedule.h"], optional=True, extra_compile_args=["-O2"]),
        Extension("eplb_fsm.policy.movement.csearch",
                  [f"eplb_fsm/policy/movement/{name}.c" for name in SEARCH_SOURCES],
                  depends=["eplb_fsm/policy/movement/csearch.h"], optional=True,
                  extra_compile_args=FLOAT_AS_NUMPY),
    ],
)

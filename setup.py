"""Build hook for the optional C kernel of the default policy (everything else is in pyproject.toml).

``optional=True``: where no C compiler is found the build goes on without it and
``eplb_fsm.policy.native`` falls back to the numpy implementation.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("eplb_fsm.policy.cnative", ["eplb_fsm/policy/cnative.c"], optional=True,
                  extra_compile_args=["-O3", "-fno-fast-math", "-ffp-contract=off"]),
    ],
)

"""The one compiled part: dtypeaudit/fused_kernel.c, the float32 -> float16/bfloat16 conversion pass (dtypeaudit/fused.py).

Optional: where no C compiler is found, the install goes on without it and conversion uses numpy for the
same pass (the same bytes and figures, about 1.7 times the CPU). Everything else is in pyproject.toml.
"""

import os

from setuptools import Extension, setup

# Every float operation in the loop must round as one float32 operation. These come after the environment's CFLAGS,
# so they win over a -ffast-math or -Ofast there; at link time they also keep crtfastmath.o out, which would turn on
# flush-to-zero for the whole process when the module loads.
exact = [] if os.name == "nt" else ["-fno-fast-math", "-ffp-contract=off"]
flags = [] if os.name == "nt" else ["-O3", *exact]
setup(
    ext_modules=[
        Extension(
            "dtypeaudit.fused_kernel",
            ["dtypeaudit/fused_kernel.c"],
            optional=True,
            extra_compile_args=flags,
            extra_link_args=exact,
        )
    ]
)

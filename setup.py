"""The one compiled part: dtypeaudit/fused_kernel.c, the float32 -> float16/bfloat16 conversion pass (dtypeaudit/fused.py).

Optional: where no C compiler is found, the install goes on without it and conversion uses numpy for the
same pass (the same bytes and figures, about four times the CPU). Everything else is in pyproject.toml.
"""

import os

from setuptools import Extension, setup

# No -ffast-math, ever: every float operation in the loop must round as one float32 operation.
flags = [] if os.name == "nt" else ["-O3"]
setup(ext_modules=[Extension("dtypeaudit.fused_kernel", ["dtypeaudit/fused_kernel.c"], optional=True, extra_compile_args=flags)])

"""``dtypeaudit tune``: which modules of a model compute the right thing in fp16 or bf16, which must stay fp32, and
a policy that convert, scan and ``apply`` follow.

    import dtypeaudit
    result = dtypeaudit.tune(model, batch, to="fp16", tolerance=1e-2)   # TuneResult: keep, first_overflow, ...
    text = dtypeaudit.tuning.policy_text(result)                         # a policy in the existing language
    model = dtypeaudit.apply(model, "tuned.yaml")                        # a live model that runs that way
    result = dtypeaudit.tuning.tune_from("net.py:build", to="fp16", checkpoint="model.pt", specs=["8x16"])  # the command's core

The flow: model (a factory, a Hugging Face folder, + checkpoint values) and inputs (``load``) -> real fp32 run with
every module's range and shadow error, real all-low run -> keep-set search -> verifying run (``search``) ->
``TuneResult`` (``result``) -> report (``report``) and policy (``tuned_policy``). What "kept in fp32" means at run time is
defined once, in ``keep``. torch is imported only inside functions.
"""

from __future__ import annotations

from .keep import apply
from .load import tune_from
from .result import SCHEMA, ModuleStats, TuneResult
from .search import tune
from .tuned_policy import policy_text

__all__ = ["tune", "tune_from", "apply", "policy_text", "TuneResult", "ModuleStats", "SCHEMA"]

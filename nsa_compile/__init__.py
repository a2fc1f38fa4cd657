"""nsa_compile: torch.compile with rewrite passes for eager Native Sparse Attention models.

    model = nsa_compile.optimize(model)            # compiles in place, returns the model
    nsa_compile.report(model)                      # what was rewritten, where, into what
"""

from .api import optimize, report
from .config import OptimizeConfig
from .registry import pass_names, register_pass, unregister_pass
from .rewrite import PassContext, PassLog, RewritePass

__all__ = [
    "optimize",
    "report",
    "OptimizeConfig",
    "pass_names",
    "register_pass",
    "unregister_pass",
    "RewritePass",
    "PassContext",
    "PassLog",
]

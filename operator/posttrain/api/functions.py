"""Which Python functions a job may name (spec.grpo.rewards[].function and
spec.grpo.agent.tools[].function, module:callable).

The trainer imports the function and calls it on the model's completions, so a callable
from the interpreter's own modules (`builtins:exec`, `subprocess:run`, `os:system`) would
run the model's output as code or commands in the trainer pod: every module of Python's
standard library is refused. An installation may go further and allow only module
prefixes of its own (the chart's `rewardFunctions.allowedModules`, given to the operator,
its admission webhook and every trainer pod as ALLOWED_ENV): `posttrain validate`, the
webhook, the operator and the trainer all call `function_error`, so they agree.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

ALLOWED_ENV = "POSTTRAIN_ALLOWED_FUNCTION_MODULES"  # comma-separated module prefixes


def allowed_modules(environ: Mapping[str, str] = os.environ) -> tuple[str, ...] | None:
    """The installation's allowed module prefixes; None when any (but the standard
    library's) is allowed."""
    found = tuple(p.strip() for p in environ.get(ALLOWED_ENV, "").split(",") if p.strip())
    return found or None


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def function_error(value: str, allowed: tuple[str, ...] | None = None) -> str | None:
    """Why the job may not name `value` (module:callable), or None."""
    module = value.partition(":")[0]
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return (
            f"{value!r} is from Python's own {top} module; a reward or tool function runs on the "
            "model's output and must come from a module of your own"
        )
    if allowed is not None and not any(_under(module, p) for p in allowed):
        return (
            f"{value!r}: this installation allows functions from {', '.join(allowed)} only "
            f"({ALLOWED_ENV})"
        )
    return None

"""gdn-dispatch: chunked Gated Delta Network prefill, routed to the fastest backend for the device."""

from gdn_dispatch.api import chunk_gated_delta_rule
from gdn_dispatch.contract import GDNInputError, GDNProblem, StateLayout
from gdn_dispatch.registry import GDNDispatchError, explain
from gdn_dispatch.warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "chunk_gated_delta_rule",
    "explain",
    "GDNDispatchError",
    "GDNInputError",
    "GDNProblem",
    "StateLayout",
    "warmup",
    "__version__",
]

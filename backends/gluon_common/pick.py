"""A call that runs one of two plans, picked on the device: each plan's launches read a
pick word first and leave at once where it names the other plan.

Used by chained calls (:mod:`.warm_chain`): the census kernel counts the segments that
cannot warm up into the word; the warm chain runs where the count is 0, the unsegmented
pipeline where it is not. The word is written by an earlier launch on the same stream, so a
plain load reads it.
"""

from __future__ import annotations

import dataclasses

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gdn_dispatch.backends.gluon_common.launch_plan import LaunchPlan

#: Where the pick word sits in a picked warm chain's ``chain_flags`` (``[NSEG * HV + 2]``:
#: the hand-over counts, the ticket, the pick), as an offset from its end.
PICK_WORD = -1

#: What a picked launch's plan notes.
PICK_NOTE = "runs only where the census picks its plan (pick word)"


@gluon.jit
def picked_elsewhere(pick, WARM: gl.constexpr):
    """Whether the pick word at ``pick`` names the other plan than the launch's own
    (``WARM``: the launch is the warm chain's, which runs on a count of 0; else the
    pipeline's, which runs on any other count)."""
    waiting = gl.load(pick)
    if WARM:
        elsewhere = waiting != 0
    else:
        elsewhere = waiting == 0
    return elsewhere


def picked_plan(launch: LaunchPlan) -> LaunchPlan:
    """``launch`` as one of a picked call's plans (``PICK`` on: it reads the pick word
    first), its compiled kernels its own."""
    return dataclasses.replace(launch, constexprs={**launch.constexprs, "PICK": True}, compiled={},
                               notes=launch.notes + "; " + PICK_NOTE)

"""The ahead-of-time entries of a warp-specialized fused kernel (gluon_sm90's, and its
sm_100a twin): one per case of dtypes, tails, state layout and state source, each with the
kernel's signature and a tag naming the case."""

from __future__ import annotations

import torch

from gdn_dispatch.aot import AotKernel

from gdn_dispatch.backends.gluon_common.compat import arg_names
from gdn_dispatch.backends.gluon_common.launch_plan import as_device, pointer_attrs, sig_dtype
from gdn_dispatch.backends.gluon_common.state_output import _aot_problem

#: A case: bf16 q/k/v with varlen tails, "kv", a float32 initial and final state, int32
#: offsets. Cases override some of it.
BASE_CASE = dict(dtype=torch.bfloat16, tails=True, vk=False, h0=True, ht=True, pool=False, inplace=False,
                 state_dtype=torch.float32, index_dtype=torch.int32, cu_dtype=torch.int32, l2=False)


def core_cases() -> list[dict]:
    """bf16/fp16 x tails or not x "kv"/"vk", with a float32 initial and final state."""
    return [{**BASE_CASE, "dtype": dtype, "tails": tails, "vk": vk} for dtype in (torch.bfloat16, torch.float16)
            for tails in (True, False) for vk in (False, True)]


def case_tag(case: dict) -> str:
    """``bf16-varlen-kv-h0-ht``, then the pool (state and index dtypes, in place), a 16-bit
    initial state, int64 offsets; head dims other than K = V = 128 first (``K64-V128-...``)."""
    dims = (case.get("K", 128), case.get("V", 128))
    parts = [] if dims == (128, 128) else [f"K{dims[0]}-V{dims[1]}"]
    parts += [sig_dtype(case["dtype"]), "varlen" if case["tails"] else "dense", "vk" if case["vk"] else "kv"]
    parts += (["h0"] if case["h0"] else []) + (["ht"] if case["ht"] else [])
    if case["pool"]:
        parts.append(f"pool-{sig_dtype(case['state_dtype'])}-{sig_dtype(case['index_dtype'])}"
                     + ("-inplace" if case["inplace"] else ""))
    elif case["state_dtype"] != torch.float32:
        parts.append(f"state-{sig_dtype(case['state_dtype'])}")
    if case["cu_dtype"] == torch.int64:
        parts.append("cu64")
    if case.get("l2"):
        parts.append("l2")
    return "-".join(parts)


def fused_aot_kernels(cases: list[dict], capability: tuple[int, int], backend: str, *, engine, plan_fused, fn,
                      spill_bytes_allowed: int = 0) -> list[AotKernel]:
    """One AotKernel of ``fn`` (planned by ``plan_fused(problem, device, engine=)``) per
    case, at the case's head dims (``K``, ``V``; 128 where it names none)."""
    device = as_device(capability)
    kernels = []
    for case in cases:
        flags = {name: value for name, value in case.items() if name not in ("K", "V")}
        problem = _aot_problem(case.get("K", 128), case.get("V", 128), **flags)
        launch = plan_fused(problem, device, engine=engine)
        sig = {d.arg: d.signature for d in launch.descriptors}
        sig.update(o_ptr="*" + sig_dtype(case["dtype"]), g_cum="*fp32", h0="*" + sig_dtype(case["state_dtype"]),
                   ht="*fp32", state_indices="*" + sig_dtype(case["index_dtype"] if case["pool"] else case["cu_dtype"]),
                   cu_seqlens="*" + sig_dtype(case["cu_dtype"]), scale="fp32", HV="i32", GROUP="i32", pool_size="i32",
                   g="*fp32", beta="*fp32", s_g="i32", s_beta="i32", k_ptr="*" + sig_dtype(case["dtype"]),
                   hand="*fp32", chain_flags="*i32" if launch.constexprs.get("CHAIN") else "*" + sig_dtype(case["cu_dtype"]),
                   s_k="i32", N="i32", L="i32", NSEG="i32")
        sig.update({name: "constexpr" for name in launch.constexprs})
        kernels.append(AotKernel(
            backend=backend, kernel="fused_fwd", specialization=case_tag(case), fn=fn,
            signature={name: sig[name] for name in arg_names(fn)},
            constexprs=dict(launch.constexprs), dialect="gluon", num_warps=launch.num_warps,
            attrs=pointer_attrs(fn, [name for name in ("o_ptr", "g_cum", "g", "beta", "h0", "ht", "state_indices",
                                                       "cu_seqlens", "k_ptr", "hand", "chain_flags")
                                     if name in arg_names(fn)]),
            spill_bytes_allowed=spill_bytes_allowed))
    return kernels

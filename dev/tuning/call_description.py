"""How one attention call is described on its way from DotProductAttention to the kernels: the fields of each
description type, the fields they share, and the path of ``window_size`` (the Python frames on the stack when
backend selection reads the call and when ``plan.mask_flags`` turns the window into the kernels' WINDOW_*
values), with how often the path returns to a file it left. CPU only (Triton's interpreter).

    PYTHONPATH=$PWD python dev/tuning/call_description.py
"""
# throwaway: reads the description types' fields and profiles frames inside the package on purpose

import dataclasses
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import transformer_engine  # noqa: E402
from transformer_engine.common.attention.config import AttnConfig, PlanKey  # noqa: E402
from transformer_engine.common.attention.launch_description import Call  # noqa: E402
from transformer_engine.common.attention.params import AttnParams  # noqa: E402
from transformer_engine.pytorch import DotProductAttention  # noqa: E402
from transformer_engine.pytorch.attention.call import AttnCall  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(transformer_engine.__file__))
ALIASES = {"dropout": "dropout_probability", "qkv_layout": "qkv_format"}  # one thing under two names


def fields():
    types = dict(AttnConfig=AttnConfig, AttnParams=AttnParams, PlanKey=PlanKey, Call=Call, AttnCall=AttnCall)
    names = {n: {ALIASES.get(f.name, f.name) for f in dataclasses.fields(t)} for n, t in types.items()}
    print("fields:", {n: len(f) for n, f in names.items()})
    print("AttnConfig and AttnParams share:", sorted(names["AttnConfig"] & names["AttnParams"]))
    print("return_max_logit is a field of:", [n for n, f in names.items() if "return_max_logit" in f])


def window_path():
    stacks = {}

    def profile(frame, event, arg):
        key = {"mask_flags": "launch", "select_backend": "selection"}.get(frame.f_code.co_name)
        if event != "call" or key is None or key in stacks:
            return
        chain = []
        while frame is not None:
            if frame.f_code.co_filename.startswith(os.path.join(ROOT, "transformer_engine")):
                chain.append((frame.f_code.co_qualname, os.path.relpath(frame.f_code.co_filename, ROOT)))
            frame = frame.f_back
        stacks[key] = chain[::-1]

    dpa = DotProductAttention(2, 16, attn_mask_type="causal", window_size=(3, 0))
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float16) for _ in range(3))
    sys.setprofile(profile)
    dpa(q, k, v)
    sys.setprofile(None)
    for key, chain in stacks.items():
        files, returns = [], 0
        for _, f in chain:
            if not files or files[-1] != f:
                returns += f in files
                files.append(f)
        print(f"window_size to {key}: {len(chain)} hops, {len(set(files))} files, {returns} returns to a file left")
        for name, f in chain:
            print(f"    {name} ({f})")


if __name__ == "__main__":
    fields()
    window_path()

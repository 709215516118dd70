"""How far torch.compile's RoPE is from Megatron-Core's eager one, bit for bit, on the CPU (issue 29).

Runs megatron.core's unfused `_apply_rotary_pos_emb_bshd` eagerly and through torch.compile, with and
without Inductor's `emulate_precision_casts`, on one bf16 input of [256, 1, 4, 128] (seed 0, RoPE base
500000), and prints how many elements differ. Needs the torch venv (`make torch-tests` builds one) and a
C++ compiler for Inductor's CPU backend:

    <torch venv>/bin/python bench/rope_numerics_cpu.py
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils


def main() -> None:
    rope = rope_utils._apply_rotary_pos_emb_bshd
    torch.manual_seed(0)
    s, d = 256, 128
    t = torch.randn(s, 1, 4, d, dtype=torch.bfloat16)
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]
    eager = rope(t, freqs)
    for emulate in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(rope, dynamic=False, options={"emulate_precision_casts": emulate})(t, freqs)
        print(f"emulate_precision_casts={emulate}: {(compiled != eager).sum().item()} of {eager.numel()} "
              f"elements differ from eager")


if __name__ == "__main__":
    main()

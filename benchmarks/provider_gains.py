"""``python benchmarks/provider_gains.py [--rounds 31]``, in an environment with vLLM: the vLLM
provider's calls with vLLM's bf16 gain against the same calls with an fp32 gain.

vLLM keeps norm gains in the model's dtype, and its definition then rounds ``x̂`` once more (the
Hugging Face order, ``cast="hf"``); an fp32 gain is DeepSeek's cast. A third column times the fp32
gain in the Hugging Face order (``dsnorm.rms_norm`` / ``fused_add_rms_norm_`` with ``cast="hf"``),
the same arithmetic as the bf16 gain, so the gain's dtype and the definition's rounding show apart.
The three alternate in one process; each cell is the median over ``--rounds`` rounds, the ratios
medians of the per-round ratios. Inputs rotate through a 16 MiB pool (from L3) up to 64 rows.
Not a test: it only reports (docs/performance.md records the runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dsnorm
from dsnorm.integrations import vllm as provider

SHAPES = ((1, 1536), (1, 7168), (8, 7168), (64, 7168), (4096, 7168))


def _timed(f, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        f()
    return (time.perf_counter() - t0) / inner


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=31)
    args = p.parse_args()
    torch.manual_seed(0)
    for rows, n in SHAPES:
        inner = 2 if rows >= 4096 else (100 if rows >= 64 else 1000)
        pool = 1 if rows >= 4096 else min(64, max(1, (16 << 20) // (rows * n * 4)))
        xs = [torch.randn(rows, n).to(torch.bfloat16) for _ in range(pool)]
        rs = [torch.randn(rows, n).to(torch.bfloat16) for _ in range(pool)]
        w16 = (1 + 0.1 * torch.randn(n)).to(torch.bfloat16)
        w32 = w16.float()  # the same values: only the dtype (and so the definition) differs
        k = [0]

        def pick():
            k[0] = (k[0] + 1) % pool
            return xs[k[0]], rs[k[0]]

        calls = {
            "rms_norm": {
                "bf16": lambda: provider.rms_norm(pick()[0], w16, 1e-6),
                "fp32": lambda: provider.rms_norm(pick()[0], w32, 1e-6),
                "fp32 hf": lambda: dsnorm.rms_norm(pick()[0], w32, 1e-6, cast="hf"),
            },
            "fused_add_rms_norm": {
                "bf16": lambda: provider.fused_add_rms_norm(*pick(), w16, 1e-6),
                "fp32": lambda: provider.fused_add_rms_norm(*pick(), w32, 1e-6),
                "fp32 hf": lambda: dsnorm.fused_add_rms_norm_(*pick(), w32, 1e-6, cast="hf"),
            },
        }
        for name, fs in calls.items():
            for f in fs.values():
                for _ in range(5):
                    f()
            times = {key: [] for key in fs}
            ratios = {"bf16/fp32": [], "bf16/fp32 hf": []}
            for _ in range(args.rounds):
                t = {key: _timed(f, inner) for key, f in fs.items()}
                for key, v in t.items():
                    times[key].append(v)
                ratios["bf16/fp32"].append(t["bf16"] / t["fp32"])
                ratios["bf16/fp32 hf"].append(t["bf16"] / t["fp32 hf"])
            cells = "  ".join(f"{key} {statistics.median(v) * 1e6:8.1f} us" for key, v in times.items())
            ratio = "  ".join(f"{key} {statistics.median(v):.3f}" for key, v in ratios.items())
            print(f"{name:18} [{rows}, {n}]  {cells}  |  {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""vLLM's engine end to end on CPU (``LLM.generate``) on a tiny DeepSeek-V3 saved with
transformers: the ``dsnorm`` provider against vLLM's defaults, eager and compiled.

Each run is its own process (tests/vllm_engine_run.py): vLLM spawns its engine core and worker
from ``__main__``, and counts are collected in the worker. Slow (minutes): run in its own pytest
call, as .ci/run does.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import require_extra

require_extra("vllm", "vllm")

SCRIPT = pathlib.Path(__file__).with_name("vllm_engine_run.py")
LAYERS = 3  # vllm_engine_run.LAYERS
# Per step, one request: layer 0's input norm is the plain form, every other input norm and every
# post-attention norm the fused one; q_a and kv_a are plain; the final norm is fused.
PLAIN_PER_STEP = 1 + 2 * LAYERS
FUSED_PER_STEP = (LAYERS - 1) + LAYERS + 1


def _run(tmp: pathlib.Path, *args: str, out: str | None = None, timeout: int = 1500) -> dict | None:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(tmp / "vllm-cache"))
    cmd = [sys.executable, str(SCRIPT), str(tmp / "model")] + ([str(tmp / out)] if out else []) + list(args)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    if out is None:
        return None
    result = json.loads((tmp / out).read_text())
    result["log"] = proc.stdout + proc.stderr
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    _run(tmp, "--make-model")
    results = {
        "native_eager": _run(tmp, "--provider", "native", out="native_eager.json"),
        "dsnorm_eager": _run(tmp, "--provider", "dsnorm", out="dsnorm_eager.json"),
        "dsnorm_compiled": _run(tmp, "--provider", "dsnorm", "--compiled", out="dsnorm_compiled.json"),
    }
    graphs = [p for p in (tmp / "vllm-cache").rglob("*.py")]
    results["compiled_code"] = "\n".join(p.read_text(errors="replace") for p in graphs)
    for name in ("native_eager", "dsnorm_eager", "dsnorm_compiled"):
        r = results[name]
        decode = sorted((s for s in _forward_steps(r)[1:] if s["tokens"] == 1), key=lambda s: s["seconds"])
        mid = decode[len(decode) // 2]
        print(f"{name}: tokens {r['tokens']}; calls per step {_forward_steps(r)[-1]['calls']}; median decode "
              f"step {1e3 * mid['seconds']:.2f} ms (in the eager impls {1e3 * mid['impl_seconds']:.2f} ms); "
              f"startup {r['startup_s']:.1f} s")
    return results


def _forward_steps(run: dict) -> list:
    """The worker's execute_model calls that ran the model (the last one schedules no token)."""
    steps = run["steps"]
    assert all(not s["calls"] for s in steps if s["tokens"] == 0), steps
    return [s for s in steps if s["tokens"]]


def test_eager_dsnorm_matches_vllm_defaults_bitwise(runs):
    native, ds = runs["native_eager"], runs["dsnorm_eager"]
    assert len(ds["tokens"]) == 32
    assert ds["tokens"] == native["tokens"]
    assert ds["logprobs"] == native["logprobs"]  # floats compared exactly


def test_eager_calls_per_step_match_the_models_sites(runs):
    for name, provider in (("native_eager", "native"), ("dsnorm_eager", "dsnorm")):
        steps = _forward_steps(runs[name])
        assert [s["tokens"] for s in steps] == [10] + [1] * 31  # the prefill, then 31 decode steps
        for step in steps:
            assert step["calls"] == {f"{provider}.rms_norm": PLAIN_PER_STEP,
                                     f"{provider}.fused_add_rms_norm": FUSED_PER_STEP}, (name, step)


def test_compiled_engine_runs_dsnorm_ops_in_its_graph(runs):
    compiled = runs["dsnorm_compiled"]  # built by docs/engines.md's vLLM example, as written
    assert compiled["tokens"] == runs["dsnorm_eager"]["tokens"]
    # The compiled graph calls dsnorm's torch ops (counted inside their kernels), not the Python
    # impls, once per site per step.
    for step in _forward_steps(compiled):
        calls = step["calls"]
        assert not any(k.startswith(("dsnorm.", "native.")) for k in calls), calls
        assert calls.get("op.rms_norm", 0) == PLAIN_PER_STEP, calls
        fused = calls.get("op.fused_add_rms_norm_", 0) + calls.get("op.fused_add_rms_norm", 0)
        assert fused == FUSED_PER_STEP, calls
    assert "torch.ops.dsnorm" in runs["compiled_code"]

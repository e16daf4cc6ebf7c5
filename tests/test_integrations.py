"""Without the engines, dsnorm imports and works, and asking for an integration names its extra."""

import logging
import subprocess
import sys

import torch


def test_dsnorm_imports_no_engine():
    code = ("import sys, dsnorm, dsnorm.integrations, dsnorm.integrations.vllm; "
            "print(sorted(m for m in ('vllm', 'kernels') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_vllm_register_without_vllm_names_the_extra(monkeypatch):
    from dsnorm.integrations import vllm as provider

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    provider.logger.addHandler(handler)
    try:
        provider.register()
    finally:
        provider.logger.removeHandler(handler)
    assert any("pip install 'dsnorm[vllm]'" in r.getMessage() for r in records)
    x = torch.randn(2, 8)
    assert provider.rms_norm(x, torch.ones(8), 1e-6).shape == (2, 8)  # dsnorm itself still works

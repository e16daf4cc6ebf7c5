"""One vLLM engine run on a tiny DeepSeek-V3 model, for tests/test_vllm_engine.py (run as a script,
one process per run: vLLM spawns its engine and worker processes from ``__main__``).

    python tests/vllm_engine_run.py MODEL_DIR OUT_JSON --provider {native,dsnorm} [--compiled]
    python tests/vllm_engine_run.py MODEL_DIR --make-model

``--make-model`` saves a randomly initialised ``DeepseekV3ForCausalLM`` (bf16, 3 layers: one dense,
two MoE; q_lora_rank set; MLA's kv_lora_rank 512 + qk_rope_head_dim 64) with transformers. A run
writes the greedy tokens, their logprobs, the norm calls counted in the worker per step (inside the
``dsnorm`` impls in eager mode, inside dsnorm's torch op kernels in compiled mode) and step times.
"""

import argparse
import json
import os
import time

PROMPT = [11, 57, 203, 4, 99, 150, 7, 311, 42, 8]
MAX_TOKENS = 32
LAYERS = 3


def make_model(path: str) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=LAYERS, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, topk_method="noaux_tc", routed_scaling_factor=2.5,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # gains that are not all ones, so the weight multiply matters
                p.normal_(1.0, 0.2)
            elif "e_score_correction_bias" in name:
                p.normal_(0.0, 0.1)
        # Clear greedy margins: a random model's logits are nearly uniform, and the compiled engine
        # (Inductor compiles the whole model, not only the norms) is not bitwise the eager one, so
        # its argmax would flip on ulps. Embeddings of std 1 dominate the residual stream and the
        # output head is a permutation of them: token t is followed by perm[t] by a wide margin,
        # while every layer and norm still shapes the logits (and the logprobs compared bitwise).
        embed = model.model.embed_tokens.weight
        embed.normal_(0.0, 1.0)
        perm = torch.randperm(config.vocab_size)
        model.lm_head.weight.copy_(embed[torch.argsort(perm)])
    model.save_pretrained(path)


def _install_counters(worker):
    """In the worker: count calls inside the dsnorm impls (eager) and inside dsnorm's torch op
    kernels (what a compiled graph calls), per execute_model step, and time each step."""
    import collections
    import time as _time

    import torch
    from vllm.ir import ops as ir_ops

    import dsnorm.ops as dsops

    counts = collections.Counter()
    seconds = collections.Counter()  # time inside the eager impls
    worker._dsnorm_counts = counts
    worker._dsnorm_steps = []

    for name in ("rms_norm", "fused_add_rms_norm"):
        for provider, impl in ir_ops.__dict__[name].impls.items():
            def counted(*args, _f=impl.impl_fn, _k=f"{provider}.{name}", **kwargs):
                counts[_k] += 1
                t0 = _time.perf_counter()
                try:
                    return _f(*args, **kwargs)
                finally:
                    seconds[_k] += _time.perf_counter() - t0
            impl.impl_fn = counted

    lib = torch.library.Library("dsnorm", "IMPL")  # kept alive on the worker
    worker._dsnorm_count_lib = lib
    for op, fn in (("rms_norm", dsops.rms_norm), ("fused_add_rms_norm", dsops.fused_add_rms_norm),
                   ("fused_add_rms_norm_", dsops.fused_add_rms_norm_inplace)):
        def kernel(*args, _f=fn, _k="op." + op):
            counts[_k] += 1
            return _f(*args)
        lib.impl(op, kernel, "CPU")

    runner = worker.model_runner
    execute = runner.execute_model

    def timed(*args, **kwargs):
        before, before_s = dict(counts), dict(seconds)
        t0 = _time.perf_counter()
        out = execute(*args, **kwargs)
        dt = _time.perf_counter() - t0
        delta = {k: v - before.get(k, 0) for k, v in counts.items() if v - before.get(k, 0)}
        impl_s = sum(seconds.values()) - sum(before_s.values())
        tokens = getattr(args[0] if args else kwargs.get("scheduler_output"), "total_num_scheduled_tokens", None)
        worker._dsnorm_steps.append({"calls": delta, "seconds": dt, "impl_seconds": impl_s, "tokens": tokens})
        return out

    runner.execute_model = timed
    return True


def _threads() -> dict:
    import torch

    with open("/proc/self/status") as f:
        os_threads = next((int(line.split()[1]) for line in f if line.startswith("Threads:")), None)
    return {"torch_threads": torch.get_num_threads(), "os_threads": os_threads}


def _read_counters(worker):
    return {"steps": worker._dsnorm_steps, "threads": _threads()}


def docs_example(engine: str) -> str:
    """The first python block of docs/engines.md's section on ``engine``."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "engines.md").read_text(encoding="utf-8")
    section = next(s for s in text.split("\n## ")[1:] if s.startswith(engine))
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


def run(model: str, out: str, provider: str, compiled: bool) -> None:
    # collective_rpc hands the worker the counting functions above (cloudpickle, by value).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128,
                  max_num_seqs=1, enforce_eager=not compiled, seed=0)
    if provider == "dsnorm":
        kwargs["kernel_config"] = {"ir_op_priority": {"rms_norm": ["dsnorm"], "fused_add_rms_norm": ["dsnorm"]}}
    t0 = time.perf_counter()
    if provider == "dsnorm" and compiled:
        # The default (compiled) engine with the provider on: docs/engines.md's example, as written.
        namespace = {"model_dir": model}
        exec(compile(docs_example("vLLM"), "docs/engines.md", "exec"), namespace)
        llm = namespace["llm"]
    else:
        llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    llm.collective_rpc(_install_counters)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True,
                            detokenize=False)
    t0 = time.perf_counter()
    result = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0]
    generate = time.perf_counter() - t0
    worker = llm.collective_rpc(_read_counters)[0]
    steps = worker["steps"]
    logprobs = [lp[t].logprob for lp, t in zip(result.logprobs, result.token_ids)]
    with open(out, "w") as f:
        json.dump({"provider": provider, "compiled": compiled, "tokens": list(result.token_ids),
                   "logprobs": logprobs, "steps": steps, "worker_threads": worker["threads"],
                   "startup_s": startup, "generate_s": generate}, f)
    llm.llm_engine.engine_core.shutdown()  # the engine core and worker processes end with this run


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--make-model", action="store_true")
    parser.add_argument("--provider", choices=("native", "dsnorm"), default="native")
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args()
    if args.make_model:
        make_model(args.model)
    else:
        run(args.model, args.out, args.provider, args.compiled)

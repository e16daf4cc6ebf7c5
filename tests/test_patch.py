"""dsnorm.patch on HF, reference and torch norms; bitwise-identical logits of a tiny bf16 DeepseekV3."""

import copy

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn

import dsnorm
from dsnorm.checkpoint import load_norms
from dsnorm.patching import PatchReport, patch
from dsnorm.ref import RMSNormRef


def tiny_deepseek_v3(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5,
    )
    model = transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # Random gains so that a wrong cast or a lost weight shows in the logits.
        for name, mod in model.named_modules():
            if type(mod).__name__ == "DeepseekV3RMSNorm":
                mod.weight.copy_((1 + 0.5 * torch.randn(mod.weight.shape, generator=g)).to(mod.weight.dtype))
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))


def test_tiny_deepseek_v3_bf16_logits_bitwise(ids):
    model = tiny_deepseek_v3()
    before = logits(model, ids)
    gains = {n: m.weight.detach().clone() for n, m in model.named_modules() if type(m).__name__ == "DeepseekV3RMSNorm"}
    assert len(gains) == 3 * 4 + 1
    rep = patch(model)
    assert isinstance(rep, PatchReport)
    assert sorted(e.name for e in rep.replaced) == sorted(gains) and not rep.left
    assert {e.cast for e in rep.replaced} == {"hf"}
    eps = {e.name: e.eps for e in rep.replaced}
    assert eps["model.norm"] == 1e-5 and eps["model.layers.0.self_attn.kv_a_layernorm"] == 1e-6
    for name, w in gains.items():
        new = model.get_submodule(name)
        assert isinstance(new, dsnorm.RMSNorm) and new.weight.dtype == torch.float32
        assert new.weight.device == w.device and torch.equal(new.weight, w.float())
    assert before.dtype == torch.bfloat16
    assert torch.equal(logits(model, ids), before)
    assert "replaced 13 norm(s), left 0" in str(rep)


# Kills: the report repeating one 300-character explanation for each of the 13 modules (issue 40).
def test_report_groups_modules_and_gives_detail_on_request():
    model = tiny_deepseek_v3()
    rep = patch(model)
    text = str(rep)
    (reason,) = {e.reason for e in rep.replaced}
    flat = " ".join(text.split())
    assert flat.count(" ".join(reason.split())) == 1 and "replaced 13 DeepseekV3RMSNorm" in flat
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "model.layers.{0-2}.input_layernorm" in flat and "model.norm" in flat
    detail = rep.format(detail=True).splitlines()
    assert detail[0] == text.splitlines()[0] == "replaced 13 norm(s), left 0"
    assert [line.split()[1] for line in detail[1:]] == [e.name for e in rep.replaced]
    assert all(reason in line for line in detail[1:])
    # Modules left alone are grouped the same way, by class and reason.
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    mixed = nn.ModuleDict({f"g{i}": GemmaRMSNorm(8) for i in range(3)})
    mixed["keep"] = RMSNormRef(8)
    rep = patch(mixed)
    text = str(rep)
    assert "left 3 GemmaRMSNorm" in text and "g{0-2}" not in text and "g0, g1, g2" in text
    assert "replaced 1 RMSNormRef (dim 8; eps 1e-06) with cast='deepseek'" in text


def test_the_logit_check_can_fail(ids):
    # The same swap with the reference cast order changes the bf16 logits: the test above is not vacuous.
    model = tiny_deepseek_v3()
    before = logits(model, ids)
    for name, mod in list(model.named_modules()):
        if type(mod).__name__ == "DeepseekV3RMSNorm":
            new = dsnorm.RMSNorm(mod.weight.shape[0], mod.variance_epsilon, cast="deepseek")
            with torch.no_grad():
                new.weight.copy_(mod.weight.float())
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
    assert not torch.equal(logits(model, ids), before)


def test_patch_then_load_norms_from_hf_checkpoint(tmp_path, ids):
    model = tiny_deepseek_v3()
    before = logits(model, ids)
    norms = {k: v.contiguous() for k, v in model.state_dict().items() if "layernorm" in k or k == "model.norm.weight"}
    save_file(norms, str(tmp_path / "model.safetensors"))
    patch(model)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, dsnorm.RMSNorm):
                m.weight.fill_(1.0)
    assert not torch.equal(logits(model, ids), before)
    rep = load_norms(model, tmp_path)
    assert len(rep.loaded) == 13 and rep.naming == "huggingface"
    assert torch.equal(logits(model, ids), before)


def test_gains_holding_nan_or_inf_are_patched(tmp_path, ids):
    # A model built on the meta device and materialised with to_empty holds whatever memory had
    # (NaN and inf included) until the checkpoint is loaded; load_norms' docstring has users patch
    # it then. The probe counted dsnorm's NaN-for-NaN output as a difference and left such norms.
    model = tiny_deepseek_v3()
    before = logits(model, ids)
    norms = {k: v.contiguous() for k, v in model.state_dict().items() if "layernorm" in k or k == "model.norm.weight"}
    save_file(norms, str(tmp_path / "model.safetensors"))
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, 1e-40, 0.0])
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "DeepseekV3RMSNorm":
                m.weight.copy_(garbage.repeat(m.weight.numel() // 6 + 1)[: m.weight.numel()].to(m.weight.dtype))
    rep = patch(model)
    assert len(rep.replaced) == 13 and not rep.left, str(rep)
    assert len(load_norms(model, tmp_path).loaded) == 13
    assert torch.equal(logits(model, ids), before)


class RMSNorm(RMSNormRef):
    """The reference class under its reference name (inference/model.py's ``RMSNorm``)."""


@pytest.mark.parametrize("cls", [RMSNorm, RMSNormRef])
def test_reference_class_becomes_deepseek_cast(cls):
    g = torch.Generator().manual_seed(5)
    # b's eps is a numpy scalar (a config read with numpy): a real number like any other.
    holder = nn.ModuleDict({"a": cls(96, eps=1e-6), "b": cls(40, eps=np.float32(1e-3))})
    with torch.no_grad():
        for m in holder.values():
            m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
    old = {k: v for k, v in holder.items()}
    rep = patch(holder)
    assert [(e.name, e.cast, e.eps) for e in rep.replaced] == [("a", "deepseek", 1e-6),
                                                               ("b", "deepseek", float(np.float32(1e-3)))]
    for k in ("a", "b"):
        new = holder[k]
        assert isinstance(new, dsnorm.RMSNorm) and torch.equal(new.weight, old[k].weight)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(3, 5, new.dim, generator=g).to(dtype)
            r = torch.randn(3, 5, new.dim, generator=g).to(dtype)
            assert torch.equal(new(x), old[k](x))
            y, res = new(x, r)
            y0, res0 = old[k](x, r)
            assert torch.equal(y, y0) and torch.equal(res, res0)


def test_patch_keeps_an_fp32_gain_parameter_an_optimizer_holds():
    # Patched mid-training: the optimizer (and DDP, an EMA) built before the patch hold the fp32
    # gain Parameter; the new module keeps that very object, so training goes on updating it, as
    # the unpatched model does. A 16-bit gain becomes a new fp32 Parameter (documented).
    def run(patch_at):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), RMSNorm(16), nn.Linear(16, 16), nn.RMSNorm(16))
        # SGD: the runs' few-ulp gradient differences stay that small (Adam's normalisation would
        # blow those of near-zero gradients up)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        data = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(1))
        for step in range(5):
            if step == patch_at:
                gains = (model[1].weight, model[3].weight)
                at_patch = [g.detach().clone() for g in gains]
                assert len(patch(model).replaced) == 2
                assert model[1].weight is gains[0] and model[3].weight is gains[1]
            opt.zero_grad()
            model(data[step]).square().mean().backward()
            opt.step()
        if patch_at is not None:  # the gains went on training after the patch
            assert not torch.equal(model[1].weight, at_patch[0]) and not torch.equal(model[3].weight, at_patch[1])
        return [p.detach().clone() for p in model.parameters()], model

    unpatched, _ = run(None)
    patched, model = run(2)
    assert isinstance(model[1], dsnorm.RMSNorm) and isinstance(model[3], dsnorm.RMSNorm)
    # the same training (dsnorm's weight gradient is not bitwise autograd's: a few fp32 ulps)
    for a, b in zip(patched, unpatched):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    bf16 = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8, dtype=torch.bfloat16))
    old = bf16[1].weight
    rep = patch(bf16)
    assert bf16[1].weight is not old and bf16[1].weight.dtype == torch.float32
    assert "bfloat16 weight copied into a new float32 Parameter" in rep.replaced[0].reason
    assert "copied" not in patch(nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8))).replaced[0].reason


def test_a_kept_hf_gain_cast_through_another_owner():
    # The kept fp32 Parameter is also the replaced module's (a user may still hold it) and may be
    # tied to another module: a cast through one of those reaches the patched norm without its
    # _apply. The gain is the weight as it is then, as HF's: nothing stale from an earlier cast.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(9)
    model = nn.Sequential(nn.Linear(16, 16), LlamaRMSNorm(16))
    with torch.no_grad():
        model[1].weight.copy_(1 + 0.3 * torch.randn(16, generator=g))
    unpatched, held = copy.deepcopy(model), model[1]
    patch(model)
    assert model[1].gain_is_weight and model[1].weight is held.weight
    x = torch.randn(4, 16, generator=g)
    for m, norm in ((model, held), (unpatched, unpatched[1])):
        m.half()
        norm.float()  # "keep the norm in fp32", through the module the user holds
        with torch.no_grad():
            norm.weight.mul_(1.0001)  # an fp32 update the fp16 gain could not hold
    for dtype in (torch.float16, torch.float32):
        got, want = model[1](x.to(dtype)), unpatched[1](x.to(dtype))
        assert got.dtype == want.dtype and torch.equal(got, want), dtype
    model.to(torch.bfloat16)
    unpatched.to(torch.bfloat16)
    assert torch.equal(model[1].weight, unpatched[1].weight)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_torch_rmsnorm_on_cpu(wdtype, eps):
    g = torch.Generator().manual_seed(7)
    holder = nn.Sequential(nn.RMSNorm(80, eps=eps, dtype=wdtype))
    with torch.no_grad():
        holder[0].weight.copy_(1 + 0.3 * torch.randn(80, generator=g))
    old = holder[0]
    rep = patch(holder)
    assert len(rep.replaced) == 1 and rep.replaced[0].cast == "deepseek"
    assert rep.replaced[0].eps == (torch.finfo(torch.float32).eps if eps is None else eps)
    for dtype in (torch.bfloat16, torch.float32, wdtype):
        # Small values make eps matter, so a wrong eps for eps=None would show.
        x = (torch.randn(4, 7, 80, generator=g) * 1e-3).to(dtype)
        assert torch.equal(holder[0](x), old(x))


def test_left_alone_with_reasons():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class OffsetRMSNorm(nn.Module):
        """A (1 + w) norm that looks Llama-like by its attributes: only the probe can tell."""

        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(d))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return ((1.0 + self.weight.float()) * xf).to(x.dtype)

    class MyRMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * self.weight

    class LazyRMSNorm(nn.Module):
        """A lazy module's norm: no shape or values until its first forward."""

        def __init__(self):
            super().__init__()
            self.weight = nn.parameter.UninitializedParameter()
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return x

    model = nn.ModuleDict({
        "gemma": GemmaRMSNorm(32),
        "no_weight": nn.RMSNorm(32, elementwise_affine=False),
        "two_d": nn.RMSNorm((4, 8)),
        "eps_zero": nn.RMSNorm(32, eps=0.0),
        "eps_huge_int": nn.RMSNorm(32, eps=10**400),
        "offset": OffsetRMSNorm(32).to(torch.bfloat16),
        "unknown": MyRMSNorm(32),
        "lazy": LazyRMSNorm(),
        "empty": nn.RMSNorm(0),
        "empty_llama": LlamaRMSNorm(0),
        "done": dsnorm.RMSNorm(32),
        "linear": nn.Linear(4, 4),
    })
    before = {k: v for k, v in model.items()}
    rep = patch(model)
    assert not rep.replaced
    why = {e.name: e.reason for e in rep.left}
    assert set(why) == {"gemma", "no_weight", "two_d", "eps_zero", "eps_huge_int", "offset", "unknown", "lazy",
                        "empty", "empty_llama", "done"}
    assert "uninitialised (a lazy module)" in why["lazy"]
    # A width-0 gain raised part-way through the model, leaving the norms before it replaced (review).
    assert "width 0" in why["empty"] and "width 0" in why["empty_llama"]
    assert "eps is 0.0: dsnorm takes eps > 0" in why["eps_zero"]
    assert "dsnorm takes eps > 0" in why["eps_huge_int"]
    assert "(1 + weight)" in why["gemma"]
    assert "no weight" in why["no_weight"]
    assert "several axes" in why["two_d"]
    assert "probe" in why["offset"] and "differs" in why["offset"]
    assert "unrecognised" in why["unknown"]
    assert "already" in why["done"]
    assert all(model[k] is v for k, v in before.items())


def test_an_error_part_way_leaves_the_model_as_it_was(monkeypatch):
    # Modules are replaced only once the whole model is planned: an unexpected error at the second
    # norm must not leave the first one replaced (found by review with a width-0 gain).
    import dsnorm.patching as patching

    model = nn.Sequential(nn.RMSNorm(8, eps=1e-6), nn.Linear(8, 8), nn.RMSNorm(8, eps=1e-6))
    before = list(model)
    real_plan, calls = patching._plan, []

    def plan_then_fail(module):
        calls.append(module)
        if len(calls) == 2:
            raise RuntimeError("planted failure")
        return real_plan(module)

    monkeypatch.setattr(patching, "_plan", plan_then_fail)
    with pytest.raises(RuntimeError, match="planted failure"):
        patch(model)
    assert list(model) == before and all(a is b for a, b in zip(model, before))
    monkeypatch.setattr(patching, "_plan", real_plan)
    assert len(patch(model).replaced) == 2


def test_left_alone_where_a_replacement_would_change_behaviour():
    # Each of these looks like a norm dsnorm reproduces, but replacing it would silently change what
    # the model computes: a gate argument would become dsnorm's residual; hooks, an instance-level
    # forward wrapper and a parametrised weight would be dropped.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class GatedRMSNorm(LlamaRMSNorm):
        def forward(self, hidden_states, gate=None):
            y = super().forward(hidden_states)
            return y if gate is None else y * gate

    def bf16_norm():
        return LlamaRMSNorm(32).to(torch.bfloat16)

    seen = []
    hooked = bf16_norm()
    hooked.register_forward_hook(lambda m, i, o: seen.append(o))
    wrapped = bf16_norm()
    plain_forward = wrapped.forward
    wrapped.forward = lambda *a, **k: plain_forward(*a, **k)
    param = bf16_norm()
    torch.nn.utils.parametrize.register_parametrization(param, "weight", nn.Identity())
    model = nn.ModuleDict({"gated": GatedRMSNorm(32).to(torch.bfloat16),
                           "hooked": hooked, "wrapped": wrapped, "param": param, "fine": bf16_norm()})
    before = dict(model.items())
    rep = patch(model)
    assert [e.name for e in rep.replaced] == ["fine"]
    why = {e.name: e.reason for e in rep.left}
    assert "forward takes hidden_states, gate" in why["gated"]
    assert "_forward_hooks" in why["hooked"]
    assert "replaced on the instance" in why["wrapped"]
    assert "parametrised" in why["param"]
    assert all(model[k] is v for k, v in before.items() if k != "fine")
    model["hooked"](torch.ones(2, 32, dtype=torch.bfloat16))
    assert len(seen) == 1


def test_hf_norms_with_an_fp32_gain_the_other_order_and_tied_gains():
    # An fp32 HF model: its norms meet fp32 activations, and bf16/fp16 ones under autocast, where HF
    # returns the fp32 product weight * x̂.to(bf16). Olmo2's class has variance_epsilon too but
    # computes (weight * x̂).to(dtype): patched before its weights load (a gain of ones, where the two
    # orders agree), only the probe's random gain tells them apart. A gain tied between two norms
    # stays one parameter.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from dsnorm.patching import PromotingHFRMSNorm

    fp32_norm = LlamaRMSNorm(48, eps=1e-5)
    olmo = Olmo2RMSNorm(48).to(torch.bfloat16)  # gain of ones, as built
    tied_a, tied_b = LlamaRMSNorm(48).to(torch.bfloat16), LlamaRMSNorm(48).to(torch.bfloat16)
    tied_b.weight = tied_a.weight
    model = nn.ModuleDict({"fp32": fp32_norm, "olmo": olmo, "tied_a": tied_a, "tied_b": tied_b})
    rep = patch(model)
    assert sorted(e.name for e in rep.replaced) == ["fp32", "olmo", "tied_a", "tied_b"], str(rep)
    assert type(model["fp32"]) is PromotingHFRMSNorm and model["fp32"].cast == "hf"
    assert model["olmo"].cast == "deepseek"
    assert model["tied_a"] is not model["tied_b"] and model["tied_a"].weight is model["tied_b"].weight
    gen = torch.Generator().manual_seed(3)
    gain = 1 + 0.5 * torch.randn(48, generator=gen)
    with torch.no_grad():  # the weights load after the patch
        fp32_norm.weight.copy_(gain)
        model["fp32"].weight.copy_(gain)
        olmo.weight.copy_(gain.to(torch.bfloat16))
        model["olmo"].weight.copy_(gain.to(torch.bfloat16).float())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (3 * torch.randn(5, 48, generator=gen)).to(dtype)
        want, got = fp32_norm(x), model["fp32"](x)
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want), dtype
    x = torch.randn(5, 48, generator=gen).to(torch.bfloat16)
    assert torch.equal(model["olmo"](x), olmo(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the fp32 model's training setting
        lin = nn.Linear(48, 48)
        want = fp32_norm(lin(x.float()))
        got = model["fp32"](lin(x.float()))
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("gain_dtype", [torch.bfloat16, torch.float16])
def test_hf_norms_with_a_16_bit_gain_promote_the_other_16_bit_dtype(gain_dtype):
    # HF multiplies its bf16 gain by x̂.to(fp16) with torch's promotion: an fp32 result (an fp16
    # autocast over a bf16 model). The patched norm returns the same dtype and bits in every input
    # dtype (before, it rounded the gain to fp16 and returned fp16), and stays one kernel for inputs
    # in the gain's dtype.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from dsnorm.patching import PromotingHFRMSNorm

    gen = torch.Generator().manual_seed(11)
    norm = LlamaRMSNorm(48, eps=1e-5).to(gain_dtype)
    with torch.no_grad():
        norm.weight.copy_((1 + 0.5 * torch.randn(48, generator=gen)).to(gain_dtype))
    want_norm = copy.deepcopy(norm)
    model = nn.ModuleDict({"n": norm})
    rep = patch(model)
    new = model["n"]
    assert [e.name for e in rep.replaced] == ["n"], str(rep)
    assert type(new) is PromotingHFRMSNorm and new.gain_dtype == gain_dtype and new.cast == "hf"
    assert new.weight.dtype == torch.float32 and torch.equal(new.weight, want_norm.weight.float())
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (3 * torch.randn(5, 48, generator=gen)).to(dtype)
        want, got = want_norm(x), new(x)
        assert got.dtype == want.dtype and torch.equal(got, want), dtype
    assert list(new.state_dict()) == ["weight"]
    with pytest.raises(ValueError, match="gain_dtype must be"):
        PromotingHFRMSNorm(8, gain_dtype=torch.int32)


def test_patched_hf_norms_follow_later_dtype_casts(ids):
    # HF's gain follows .to(dtype) / .half() / .float() / .double(), and with it the promotion: a
    # patched norm does the same. Every gain x cast x input dtype, against HF cast the same way.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(12)
    for gain_dtype in (torch.float32, torch.bfloat16, torch.float16):
        for cast in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
            norm = LlamaRMSNorm(48).to(gain_dtype)
            with torch.no_grad():
                norm.weight.copy_((1 + 0.5 * torch.randn(48, generator=gen)).to(gain_dtype))
            model = nn.ModuleDict({"n": copy.deepcopy(norm)})
            patch(model)
            new = model["n"]
            if cast is not None:
                norm, new = norm.to(cast), new.to(cast)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                x = (3 * torch.randn(5, 48, generator=gen)).to(dtype)
                want, got = norm(x), new(x)
                assert got.dtype == want.dtype and torch.equal(got, want), (gain_dtype, cast, dtype)
    # A whole model, patched in fp32 then cast to bf16 (and in bf16 then cast to fp16): HF's logits.
    for built, cast in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)):
        hf = tiny_deepseek_v3().to(built)
        ours = copy.deepcopy(hf)
        patch(ours)
        hf, ours = hf.to(cast), ours.to(cast)
        assert torch.equal(logits(ours, ids), logits(hf, ids)), (built, cast)


def test_promoting_norm_keeps_the_fast_lane_where_nothing_is_promoted(monkeypatch):
    from dsnorm import ops
    from dsnorm.patching import PromotingHFRMSNorm

    norm = PromotingHFRMSNorm(64, 1e-5, gain_dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64).to(torch.bfloat16).float())
    ops.lane or ops._load_lane()
    # forward runs only when the fast lane declines the call (it is RMSNorm.__call__'s fallback).
    forward, calls = PromotingHFRMSNorm.forward, []
    monkeypatch.setattr(PromotingHFRMSNorm, "forward", lambda self, *a, **k: (calls.append(1), forward(self, *a, **k))[1])
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        # fp32 x with a bf16 gain: the gain is the weight rounded to bf16, which the lane does not do.
        for args, dtype, lane in (((x,), torch.bfloat16, True), ((x.float(),), torch.float32, False),
                                  ((x, None), torch.bfloat16, True), ((x, x), torch.bfloat16, True),
                                  ((x.half(), x.half()), torch.float16, False),
                                  ((x.half(),), torch.float32, False), ((x.half(), None), torch.float32, False)):
            calls.clear()
            out = norm(*args)
            out = out[0] if isinstance(out, tuple) else out
            assert out.dtype == dtype and calls == ([] if lane else [1]), ([a.dtype for a in args if a is not None], calls)
        calls.clear()
        norm(x, residual=None)  # keywords take nn.Module's path
        assert calls == [1]
    # A module pickled before gain_dtype existed (fp32 gains only) has no instance attribute.
    del norm.__dict__["gain_dtype"]
    assert norm.gain_dtype == torch.float32 and norm(x).dtype == torch.float32
    with pytest.raises(ValueError, match="cast must be 'hf'"):
        PromotingHFRMSNorm(8, cast="deepseek")


def test_promoting_norm_gain_follows_the_weight_and_foreign_applies():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from dsnorm.patching import PromotingHFRMSNorm

    gen = torch.Generator().manual_seed(13)
    hf = LlamaRMSNorm(48)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.5 * torch.randn(48, generator=gen))
    model = nn.ModuleDict({"n": copy.deepcopy(hf)})
    patch(model)
    ours = model["n"]
    assert type(ours) is PromotingHFRMSNorm and ours._gain_dtype() == torch.float32
    # A bf16 state_dict assigned (not copied) makes both gains bf16: fp16 activations promote.
    sd = {"weight": hf.weight.detach().to(torch.bfloat16)}
    hf.load_state_dict(sd, assign=True)
    ours.load_state_dict({"weight": sd["weight"].clone()}, assign=True)
    assert ours._gain_dtype() == torch.bfloat16
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (3 * torch.randn(5, 48, generator=gen)).to(dtype)
        want, got = hf(x), ours(x)
        assert got.dtype == want.dtype and torch.equal(got, want), dtype
    # A gain that an fp32 weight stands for (patched from a 16-bit HF gain; here made directly)
    # follows the module's casts. _apply's probe never needs the weight, and a fn that refuses
    # foreign tensors is tolerated.
    stand_in = PromotingHFRMSNorm(48, gain_dtype=torch.bfloat16)
    assert not stand_in.gain_is_weight and ours.gain_is_weight  # patch kept HF's fp32 Parameter
    stand_in.weight = None
    stand_in.half()
    assert stand_in.gain_dtype == torch.float16
    def own_tensors_only(t):
        if t.numel() == 0:
            raise RuntimeError("not one of mine")
        return t
    stand_in._apply(own_tensors_only)
    assert stand_in.gain_dtype == torch.float16


def test_promoting_norm_loads_state_dicts_and_norms_as_hf_would(tmp_path):
    # HF's bf16 parameter rounds the fp32 values a copying load_state_dict gives it; the patched
    # norm keeps them in its fp32 weight and rounds them where the gain is used, so its outputs are
    # HF's for every input dtype, and a model reloading its own state_dict (copied or assigned,
    # after training moved the weight off the bf16 grid) is unchanged. A wrapper may swap the
    # parameter for a plain tensor (FSDP's use_orig_params=False with mixed precision). load_norms
    # refuses gains the HF parameter could not hold exactly.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(15)
    fp32_values = 1 + 0.5 * torch.randn(48, generator=gen)  # not representable in bf16
    xs = [(3 * torch.randn(5, 48, generator=gen)).to(d) for d in (torch.bfloat16, torch.float16, torch.float32)]

    def fresh():
        hf = LlamaRMSNorm(48).to(torch.bfloat16)
        model = nn.ModuleDict({"n": copy.deepcopy(hf)})
        patch(model)
        return hf, model

    def outputs(norm):
        with torch.no_grad():
            return [norm(x) for x in xs]

    def same(want, got, what):
        for w, g in zip(want, got):
            assert g.dtype == w.dtype and torch.equal(g, w), (what, w.dtype)

    hf, model = fresh()
    hf.load_state_dict({"weight": fp32_values.clone()})
    model["n"].load_state_dict({"weight": fp32_values.clone()})
    assert torch.equal(model["n"].weight, fp32_values)
    same(outputs(hf), outputs(model["n"]), "copied fp32 values")
    for cast in ("float", "half", "double", "bfloat16"):  # HF casts its rounded values
        h, m = copy.deepcopy(hf), copy.deepcopy(model["n"])
        same(outputs(getattr(h, cast)()), outputs(getattr(m, cast)()), f"copied fp32 values, then {cast}()")
    # The fused form (dsnorm's; HF has none) uses the same gain: the plain form of x + residual.
    r = torch.zeros(5, 48)
    for x in xs[2:]:
        with torch.no_grad():
            assert torch.equal(model["n"](x, r)[0], model["n"](x))
    before = outputs(model["n"])
    for assign in (False, True):
        model.load_state_dict(copy.deepcopy(model.state_dict()), assign=assign)
        same(before, outputs(model["n"]), f"own state_dict, assign={assign}")
    hf, model = fresh()
    plain = fp32_values.to(torch.bfloat16)
    del hf._parameters["weight"], model["n"]._parameters["weight"]
    hf.weight, model["n"].weight = plain, plain.clone()
    same(outputs(hf), outputs(model["n"]), "plain-tensor weight")
    _, model = fresh()
    save_file({"n.weight": fp32_values.clone()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"patched norm's torch.bfloat16 gain"):
        load_norms(model, tmp_path)
    save_file({"n.weight": fp32_values.to(torch.bfloat16).float()}, str(tmp_path / "model.safetensors"))
    load_norms(model, tmp_path)
    assert torch.equal(model["n"].weight, fp32_values.to(torch.bfloat16).float())


def test_fx_traces_a_patched_promoting_norm():
    # The dtype test of the promotion cannot take a Proxy: it is a graph node, as the norms are.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = LlamaRMSNorm(48)

        def forward(self, x):
            return self.norm(x) * 2

    gen = torch.Generator().manual_seed(14)
    hf = Block().to(torch.bfloat16)
    with torch.no_grad():
        hf.norm.weight.copy_((1 + 0.5 * torch.randn(48, generator=gen)).to(torch.bfloat16))
    ours = copy.deepcopy(hf)
    patch(ours)
    gm = torch.fx.symbolic_trace(ours)
    assert "_promoted_hf_norm" in {getattr(n.target, "__name__", "") for n in gm.graph.nodes if n.op == "call_function"}
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = (3 * torch.randn(5, 48, generator=gen)).to(dtype)
            want, got = hf(x), gm(x)
            assert got.dtype == want.dtype and torch.equal(got, want), dtype
        # The graph takes the gain's dtype from the weight it is given: it follows a later cast.
        hf, gm = hf.half(), gm.half()
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = (3 * torch.randn(5, 48, generator=gen)).to(dtype)
            want, got = hf(x), gm(x)
            assert got.dtype == want.dtype and torch.equal(got, want), ("after half", dtype)


def test_hf_llama_norm_and_shared_modules():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(48, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 48))
    model = nn.Module()
    model.a = norm
    model.b = norm  # one module under two names stays one module
    rep = patch(model)
    assert [e.name for e in rep.replaced] == ["a", "b"] and model.a is model.b
    assert isinstance(model.a, dsnorm.RMSNorm) and model.a.cast == "hf" and model.a.eps == 1e-5
    x = torch.randn(6, 48, dtype=torch.bfloat16)
    assert torch.equal(model.a(x), norm(x))


def test_patch_rejects_non_modules():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        patch([nn.RMSNorm(4)])


# Kills: patching._probe skipping its `if fused:` half. A reference-looking class whose residual
# form rounds the sum first must be left alone, not replaced by dsnorm's fp32_sum form.
class RoundFirstRMSNorm(RMSNormRef):
    def forward(self, x, residual=None):
        if residual is None:
            return super().forward(x)
        s = (x.float() + residual.float()).to(x.dtype)  # round_first
        return super().forward(s), s


# The reference's class name, so patch() recognises it (a module-level ``RMSNorm`` is taken).
RoundFirstRMSNorm.__name__ = RoundFirstRMSNorm.__qualname__ = "RMSNorm"


def test_patch_probes_the_residual_form():
    g = torch.Generator().manual_seed(3)
    holder = nn.ModuleDict({"n": RoundFirstRMSNorm(256)})
    with torch.no_grad():
        holder["n"].weight.copy_(1 + 0.3 * torch.randn(256, generator=g))
    rep = dsnorm.patch(holder)
    assert not rep.replaced and isinstance(holder["n"], RoundFirstRMSNorm)
    assert "with residual" in rep.left[0].reason

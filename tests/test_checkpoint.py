"""dsnorm count / count_norms / load_norms on tiny synthetic checkpoints written here."""

import builtins
import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

import dsnorm
from dsnorm import cli
from dsnorm.checkpoint import (
    CheckpointError,
    classify,
    count_norms,
    load_norms,
    read_header,
    resolve_checkpoint,
)
from dsnorm.sites import config_from_dict, enumerate_sites

# A tiny V3.2-shaped model: 3 blocks (1 dense), widths 16 / 8 / 4, indexer keys of 4, one MTP layer.
HF_CFG = {"hidden_size": 16, "num_hidden_layers": 3, "first_k_dense_replace": 1, "q_lora_rank": 8,
          "kv_lora_rank": 4, "index_head_dim": 4, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6,
          "n_routed_experts": 4}
REF_CFG = {"dim": 16, "n_layers": 3, "n_dense_layers": 1, "q_lora_rank": 8, "kv_lora_rank": 4, "index_head_dim": 4}

# Written out by hand (not from the catalogue) so that the naming itself is under test.
HF_MAIN = (["model.norm.weight"] + [f"model.layers.{i}.{s}.weight" for i in range(3) for s in (
    "input_layernorm", "post_attention_layernorm", "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm")])
HF_K_NORM = [f"model.layers.{i}.self_attn.indexer.k_norm.{p}" for i in range(4) for p in ("weight", "bias")]
HF_MTP = [f"model.layers.3.{s}.weight" for s in ("enorm", "hnorm", "shared_head.norm", "input_layernorm",
                                                  "post_attention_layernorm", "self_attn.q_a_layernorm",
                                                  "self_attn.kv_a_layernorm")]
REF_ALL = (["norm.weight"] + [f"layers.{i}.{s}.weight" for i in range(3) for s in (
    "attn_norm", "ffn_norm", "attn.q_norm", "attn.kv_norm")]
    + [f"layers.{i}.attn.indexer.k_norm.{p}" for i in range(3) for p in ("weight", "bias")])
WIDTH = {"q_a_layernorm": 8, "q_norm": 8, "kv_a_layernorm": 4, "kv_norm": 4, "k_norm": 4}


def width(name):
    module = name.rsplit(".", 2)[-2]
    return WIDTH.get(module, 16)


def tensors(names, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    out = {n: (1 + 0.3 * torch.randn(width(n), generator=g)).to(dtype) for n in names}
    # Non-norm tensors must be ignored (and never read).
    out["model.embed_tokens.weight" if names[0].startswith("model.") else "embed.weight"] = torch.zeros(5, 16, dtype=dtype)
    return out


def hf_checkpoint(d, names=None, cfg=HF_CFG, **kw):
    os.makedirs(d, exist_ok=True)
    t = tensors(names or HF_MAIN + HF_K_NORM + HF_MTP, **kw)
    save_file(t, os.path.join(d, "model.safetensors"))
    if cfg is not None:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
    return t


def ref_checkpoint(d, mp=2, names=REF_ALL, drop=None):
    os.makedirs(d, exist_ok=True)
    t = tensors(names)
    for r in range(mp):
        shard = {k: v for k, v in t.items() if not (drop and drop == (r, k))}
        save_file(shard, os.path.join(d, f"model{r}-mp{mp}.safetensors"))
    return t


def kinds(rep):
    return sorted((m["kind"], m["tensor"]) for m in rep.mismatches)


def test_hand_written_names_match_the_catalogue():
    cfg = config_from_dict(HF_CFG)
    hf = {f"{s.hf_path}.{t}" for s in enumerate_sites(cfg) for t in s.tensors}
    assert hf == set(HF_MAIN + HF_K_NORM + HF_MTP)
    ref = {f"{s.ref_path}.{t}" for s in enumerate_sites(config_from_dict(REF_CFG), mtp=False) for t in s.tensors}
    assert ref == set(REF_ALL)
    assert classify("model.layers.3.shared_head.norm.weight") == ("huggingface", "shared_head.norm", 3, "weight")
    assert classify("layers.2.attn.q_norm.weight") == ("reference", "q_norm", 2, "weight")
    assert classify("model.layers.0.mlp.gate.weight") is None


def test_hf_checkpoint_with_mtp_matches(tmp_path):
    hf_checkpoint(tmp_path)
    rep = count_norms(tmp_path)
    assert rep.ok, rep.mismatches
    assert rep.naming == "huggingface" and rep.config_source.endswith("config.json")
    rows = {r["site"]: r for r in rep.sites}
    assert rows["q_norm"]["found_instances"] == 3 and rows["q_norm"]["shapes"] == ["[8]"]
    assert rows["q_norm"]["dtypes"] == ["BF16"] and rows["q_norm"]["params"] == 24
    assert rows["mtp.enorm"]["found_instances"] == 1 and rows["mtp.shared_head.norm"]["found_instances"] == 1
    assert rows["mtp.attn_norm"]["found_instances"] == 1
    assert rows["k_norm"]["norm_type"] == "layernorm" and rows["k_norm"]["params"] == 3 * 8
    t = rep.totals
    assert t["rmsnorm_instances_found"] == 13 and t["rmsnorm_params_found"] == 3 * (16 + 16 + 8 + 4) + 16
    assert t["mtp_instances_found"] == 8


def test_counting_reads_headers_only(tmp_path, monkeypatch):
    hf_checkpoint(tmp_path)
    shard = tmp_path / "model.safetensors"
    header_end = 8 + struct.unpack("<Q", shard.read_bytes()[:8])[0]
    read = []
    real_open = builtins.open

    class Tracking:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            read.append((self.f.tell(), len(data)))
            return data

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    def tracking_open(path, *a, **k):
        f = real_open(path, *a, **k)
        return Tracking(f) if str(path).endswith(".safetensors") else f

    monkeypatch.setattr("dsnorm.checkpoint.open", tracking_open, raising=False)
    assert count_norms(tmp_path).ok
    assert read and max(end for end, _ in read) <= header_end


def test_reference_model_parallel_checkpoint_counts_replicas_once(tmp_path):
    ref_checkpoint(tmp_path, mp=2)
    cfg = tmp_path.parent / "ref_cfg.json"
    cfg.write_text(json.dumps(REF_CFG))
    rep = count_norms(tmp_path, str(cfg))
    assert rep.ok, rep.mismatches
    assert rep.layout == "model-parallel" and rep.mp_size == 2 and rep.naming == "reference"
    assert rep.totals["norm_tensors_read"] == 2 * len(REF_ALL) and rep.totals["norm_tensors_distinct"] == len(REF_ALL)
    rows = {r["site"]: r for r in rep.sites}
    assert rows["attn_norm"]["found_instances"] == 3 and rows["norm"]["found_instances"] == 1
    assert not any(r["group"] == "mtp" for r in rep.sites)  # no MTP layer expected in a reference conversion


# A V3.2 checkpoint against a hand-written reference config without index_* fields: the indexer's
# k_norm tensors are extra, and the message says why (such a config is read as pre-V3.2).
def test_k_norm_extra_under_a_config_without_index_fields_says_why(tmp_path):
    ref_checkpoint(tmp_path / "ck")
    cfg = tmp_path / "no_index.json"
    cfg.write_text(json.dumps({k: v for k, v in REF_CFG.items() if not k.startswith("index_")}))
    rep = count_norms(tmp_path / "ck", str(cfg))
    extras = [m for m in rep.mismatches if m["kind"] == "extra"]
    assert extras and all(m["site"].endswith("k_norm") for m in extras)
    assert all("read as one from before V3.2" in m["detail"] and "add index_head_dim" in m["detail"] for m in extras)


def test_reference_checkpoint_problems(tmp_path):
    cfg = tmp_path / "ref_cfg.json"
    cfg.write_text(json.dumps(REF_CFG))
    # A norm missing from one model-parallel shard, an MTP-like extra layer, a missing rank.
    d = tmp_path / "a"
    ref_checkpoint(d, mp=3, names=REF_ALL + ["layers.3.attn_norm.weight"], drop=(1, "layers.1.ffn_norm.weight"))
    os.remove(d / "model2-mp3.safetensors")
    rep = count_norms(d, str(cfg))
    assert not rep.ok
    k = kinds(rep)
    assert ("missing_replica", "layers.1.ffn_norm.weight") in k
    assert ("extra", "layers.3.attn_norm.weight") in k
    assert ("missing_shard", None) in k


def test_sharded_with_index(tmp_path):
    t = tensors(HF_MAIN + HF_K_NORM + HF_MTP)
    names = sorted(t)
    a, b = names[: len(names) // 2], names[len(names) // 2:]
    save_file({n: t[n] for n in a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: t[n] for n in b}, str(tmp_path / "model-00002-of-00002.safetensors"))
    wm = {n: "model-00001-of-00002.safetensors" for n in a} | {n: "model-00002-of-00002.safetensors" for n in b}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (tmp_path / "config.json").write_text(json.dumps(HF_CFG))
    for path in (tmp_path, tmp_path / "model.safetensors.index.json"):
        rep = count_norms(path)
        assert rep.ok, rep.mismatches
        assert rep.layout == "index" and len(rep.files) == 2
    # The index disagreeing with a shard is a mismatch naming the tensor.
    wm["model.norm.weight"] = "model-00001-of-00002.safetensors" if "model.norm.weight" in b else "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    assert ("index_mismatch", "model.norm.weight") in kinds(count_norms(tmp_path))


def test_bad_index_files(tmp_path):
    hf_checkpoint(tmp_path)
    idx = tmp_path / "x.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        count_norms(idx)
    idx.write_text(json.dumps({"weight_map": {"model.norm.weight": "absent.safetensors"}}))
    with pytest.raises(CheckpointError, match="do not exist"):
        count_norms(idx)
    idx.write_text("[]")
    with pytest.raises(CheckpointError, match="no 'weight_map'"):
        count_norms(idx)
    with pytest.raises(CheckpointError, match="no such file"):
        count_norms(tmp_path / "nothing")


def test_missing_norm(tmp_path, capsys):
    names = [n for n in HF_MAIN + HF_K_NORM + HF_MTP if n != "model.layers.1.self_attn.kv_a_layernorm.weight"]
    hf_checkpoint(tmp_path, names)
    rep = count_norms(tmp_path)
    assert kinds(rep) == [("missing", "model.layers.1.self_attn.kv_a_layernorm.weight")]
    rows = {r["site"]: r for r in rep.sites}
    assert rows["kv_norm"]["found_instances"] == 2 and rows["kv_norm"]["mismatches"] == 1
    assert cli.main(["count", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "missing: model.layers.1.self_attn.kv_a_layernorm.weight" in out and "MISMATCH" in out


def test_missing_mtp_layer_and_extra_layer(tmp_path):
    hf_checkpoint(tmp_path / "a", HF_MAIN + HF_K_NORM)
    rep = count_norms(tmp_path / "a")
    # HF_K_NORM includes the MTP block's indexer LayerNorm (layer 3): only the MTP RMSNorms are missing.
    assert {m["tensor"] for m in rep.mismatches if m["kind"] == "missing"} == set(HF_MTP)
    assert not any(m["kind"] == "extra" for m in rep.mismatches)
    hf_checkpoint(tmp_path / "b", HF_MAIN + HF_K_NORM + HF_MTP + ["model.layers.4.enorm.weight", "model.layers.0.foo_norm.weight"])
    k = kinds(count_norms(tmp_path / "b"))
    assert k == [("extra", "model.layers.0.foo_norm.weight"), ("extra", "model.layers.4.enorm.weight")]


def test_report_fits_120_columns_with_long_tensor_names(tmp_path, capsys):
    # Long names in mismatch lines are wrapped, as the other tools' text is (a name is never broken).
    long = "model.layers.0." + ".".join(["a_rather_long_submodule_name"] * 2) + ".foo_norm.weight"
    hf_checkpoint(tmp_path, HF_MAIN + HF_K_NORM + HF_MTP + [long])
    assert [m["tensor"] for m in count_norms(tmp_path).mismatches] == [long]
    assert cli.main(["count", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    assert any(long in line for line in lines)


def test_wrong_shape(tmp_path, capsys):
    t = hf_checkpoint(tmp_path)
    t["model.layers.2.input_layernorm.weight"] = torch.ones(15, dtype=torch.bfloat16)
    save_file(t, str(tmp_path / "model.safetensors"))
    rep = count_norms(tmp_path)
    assert kinds(rep) == [("shape", "model.layers.2.input_layernorm.weight")]
    assert "shape [15], expected [16]" in rep.mismatches[0]["detail"]
    assert cli.main(["count", str(tmp_path), "--json", "-"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["mismatches"][0]["tensor"] == "model.layers.2.input_layernorm.weight"


def test_expectation_sources(tmp_path, capsys):
    # No config.json beside the file: --config, else the built-in 671B default.
    hf_checkpoint(tmp_path, cfg=None)
    cfg = tmp_path.parent / "hf_cfg.json"
    cfg.write_text(json.dumps(HF_CFG))
    assert count_norms(tmp_path / "model.safetensors", str(cfg)).ok
    assert cli.main(["count", str(tmp_path / "model.safetensors"), "--config", str(cfg)]) == 0
    capsys.readouterr()
    rep = count_norms(tmp_path)
    assert not rep.ok and "built-in config_671B_v3.2.json" in rep.config_source
    assert ("shape", "model.norm.weight") in kinds(rep)
    jpath = tmp_path.parent / "report.json"
    assert cli.main(["count", str(tmp_path), "--json", str(jpath)]) == 1
    data = json.loads(jpath.read_text())
    assert data["config"]["dim"] == 7168 and data["totals"]["rmsnorm_instances_expected"] == 245
    capsys.readouterr()
    assert cli.main(["count", str(tmp_path), "--json", str(tmp_path)]) == 2  # a directory: refused first
    out, err = capsys.readouterr()
    assert out == "" and "is a directory" in err



# Kills: "naming: huggingface" printed above "expectation: ... (reference names)": the checkpoint's
# tensor names and the config's field names, each called "names", read as a contradiction.
def test_count_names_what_it_compared(tmp_path, capsys):
    hf_checkpoint(tmp_path, cfg=None)
    assert cli.main(["count", str(tmp_path)]) == 1  # the built-in 671B config (reference field names)
    out = capsys.readouterr().out
    assert "tensor names: huggingface" in out
    flat = " ".join(out.split())
    assert ("compared with: the norm sites of built-in config_671B_v3.2.json (a config with reference field names), "
            "as huggingface tensor names") in flat
    assert "naming:" not in out and "(reference names)" not in out


def test_count_json_must_not_replace_what_it_reads(tmp_path, capsys):
    # Found by review: --json onto the checkpoint file replaced it with the report (exit 1).
    hf_checkpoint(tmp_path)
    ckpt = tmp_path / "model.safetensors"
    cfg = tmp_path.parent / "other_cfg.json"
    cfg.write_text(json.dumps(HF_CFG))
    before = {p: p.read_bytes() for p in (ckpt, tmp_path / "config.json", cfg)}
    for argv in ([str(tmp_path), "--json", str(ckpt)], [str(ckpt), "--json", str(ckpt)],
                 [str(tmp_path), "--json", str(tmp_path / "config.json")],
                 [str(tmp_path), "--config", str(cfg), "--json", str(cfg)]):
        assert cli.main(["count"] + argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and "the command reads (it would be overwritten)" in err
    assert all(p.read_bytes() == b for p, b in before.items())
    # Through an index (read when the directory is named, or named itself).
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {n: "model.safetensors" for n in HF_MAIN}}))
    kept = index.read_bytes()
    for argv in ([str(tmp_path), "--json", str(index)], [str(index), "--json", str(index)]):
        assert cli.main(["count"] + argv) == 2, argv
        assert "the command reads" in capsys.readouterr().err
    assert index.read_bytes() == kept


def test_a_named_config_wins_over_the_one_beside_the_checkpoint(tmp_path, capsys):
    # save_pretrained keeps num_nextn_predict_layers but writes no MTP weights: the caller corrects the
    # expectation with a config of their own, which must win; a path that does not load is an error.
    hf_checkpoint(tmp_path, names=HF_MAIN + [k for k in HF_K_NORM if ".layers.3." not in k])
    assert ("missing", "model.layers.3.enorm.weight") in kinds(count_norms(tmp_path))
    fixed = tmp_path.parent / "no_mtp.json"
    fixed.write_text(json.dumps({**HF_CFG, "num_nextn_predict_layers": 0}))
    rep = count_norms(tmp_path, str(fixed))
    assert rep.ok and rep.config_source == str(fixed) and "not the config.json beside" in rep.notes[0]
    assert cli.main(["count", str(tmp_path), "--config", str(fixed)]) == 0
    capsys.readouterr()
    with pytest.raises(ValueError, match="nonexistent"):
        count_norms(tmp_path, str(tmp_path / "nonexistent.json"))
    assert cli.main(["count", str(tmp_path), "--config", str(tmp_path / "nonexistent.json")]) == 2
    assert "nonexistent.json" in capsys.readouterr().err


def test_a_model_directory_names_its_config_json(tmp_path, capsys):
    # A porter points --config at the model directory, as from_pretrained takes it; it was refused
    # ("Is a directory"). Its config.json is read, and --json may not replace that file either.
    hf_checkpoint(tmp_path, names=HF_MAIN + [k for k in HF_K_NORM if ".layers.3." not in k])
    other = tmp_path.parent / "no_mtp_model"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**HF_CFG, "num_nextn_predict_layers": 0}))
    rep = count_norms(tmp_path, other)
    assert rep.ok and rep.config_source == str(other / "config.json")
    assert cli.main(["count", str(tmp_path), "--config", str(other)]) == 0
    assert cli.main(["sites", "--config", str(other), "--site", "q_norm"]) == 0
    capsys.readouterr()
    kept = (other / "config.json").read_bytes()
    for command in (["count", str(tmp_path)], ["sites"]):
        assert cli.main(command + ["--config", str(other), "--json", str(other / "config.json")]) == 2
        assert "is the --config file" in capsys.readouterr().err
    assert (other / "config.json").read_bytes() == kept
    empty = tmp_path.parent / "empty_model"
    empty.mkdir()
    assert cli.main(["sites", "--config", str(empty)]) == 2
    assert "empty_model/config.json: cannot read model config" in capsys.readouterr().err


def _write_raw(path, header_bytes, data=b"", length=None):
    n = len(header_bytes) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + header_bytes + data)
    return path


def _header(entries):
    return json.dumps(entries).encode()


@pytest.mark.parametrize("case, match", [
    ("short", "too short"),
    ("huge_length", "exceeds the"),
    ("length_past_end", "runs past the end"),
    ("bad_utf8", "not valid UTF-8"),
    ("bad_json", "not valid JSON"),
    ("deep_json", "nested too deeply|not valid JSON"),
    ("not_object", "not an object"),
    ("duplicate", "duplicate key"),
    ("bad_offsets", "data_offsets"),
    ("offsets_past_end", "run past"),
    ("size_mismatch", "needs 32 bytes"),
    ("overlap", "overlap"),
    ("bad_shape", "shape"),
])
def test_hostile_headers(tmp_path, case, match):
    p = tmp_path / "model.safetensors"
    norm = {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}
    if case == "short":
        p.write_bytes(b"\x01\x02")
    elif case == "huge_length":
        _write_raw(p, b"{}", length=2**63)
    elif case == "length_past_end":
        _write_raw(p, b"{}", length=4096)
    elif case == "bad_utf8":
        _write_raw(p, b'{"\xff": 1}')
    elif case == "bad_json":
        _write_raw(p, b'{"model.norm.weight": ')
    elif case == "deep_json":
        _write_raw(p, b"[" * 100000 + b"]" * 100000)
    elif case == "not_object":
        _write_raw(p, b"[1, 2]")
    elif case == "duplicate":
        _write_raw(p, b'{"model.norm.weight": %s, "model.norm.weight": %s}' % (_header(norm), _header(norm)), b"\0" * 32)
    elif case == "bad_offsets":
        _write_raw(p, _header({"model.norm.weight": {**norm, "data_offsets": [32, 0]}}), b"\0" * 32)
    elif case == "offsets_past_end":
        _write_raw(p, _header({"model.norm.weight": {**norm, "data_offsets": [0, 10**15]}}), b"\0" * 32)
    elif case == "size_mismatch":
        _write_raw(p, _header({"model.norm.weight": {**norm, "data_offsets": [0, 16]}}), b"\0" * 32)
    elif case == "overlap":
        _write_raw(p, _header({"model.norm.weight": norm, "model.layers.0.input_layernorm.weight": {
            **norm, "data_offsets": [16, 48]}}), b"\0" * 48)
    elif case == "bad_shape":
        _write_raw(p, _header({"model.norm.weight": {**norm, "shape": [-8]}}), b"\0" * 32)
    with pytest.raises(CheckpointError, match=match) as e:
        read_header(p)
    assert str(p) in str(e.value)


def test_truncated_file(tmp_path, capsys):
    hf_checkpoint(tmp_path)
    p = tmp_path / "model.safetensors"
    raw = p.read_bytes()
    p.write_bytes(raw[:-10])
    with pytest.raises(CheckpointError, match="truncated") as e:
        count_norms(tmp_path)
    assert "model.safetensors" in str(e.value)
    assert cli.main(["count", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "dsnorm count: error:" in err and "model.safetensors" in err


def test_hostile_header_via_cli(tmp_path, capsys):
    _write_raw(tmp_path / "evil.safetensors", b"{}", length=2**40)
    assert cli.main(["count", str(tmp_path / "evil.safetensors")]) == 2
    assert "exceeds the" in capsys.readouterr().err


def test_reader_agrees_with_safetensors(tmp_path):
    from safetensors import safe_open

    hf_checkpoint(tmp_path)
    h = read_header(tmp_path / "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(h.tensors)
        for k in f.keys():
            assert list(f.get_slice(k).get_shape()) == list(h.tensors[k].shape)
    assert resolve_checkpoint(tmp_path / "model.safetensors").layout == "file"


# ---------------------------------------------------------------------------------------------------
# load_norms

class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_norm = dsnorm.RMSNorm(8)
        self.kv_norm = dsnorm.RMSNorm(4)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Attn()
        self.attn_norm = dsnorm.RMSNorm(16)
        self.ffn_norm = dsnorm.RMSNorm(16)


class _RefModel(torch.nn.Module):
    """The reference module tree (norms only): layers.{i}.attn_norm, ..., norm."""

    def __init__(self, n=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(n))
        self.norm = dsnorm.RMSNorm(16)


def _norm_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("naming", ["reference", "huggingface"])
def test_load_norms_exact(tmp_path, naming):
    if naming == "reference":
        t = ref_checkpoint(tmp_path, mp=2)
    else:
        t = hf_checkpoint(tmp_path)
    model = _RefModel()
    rep = load_norms(model, tmp_path)
    assert len(rep.loaded) == 13 and rep.naming == naming
    w = model.layers[1].attn.q_norm.weight
    assert w.dtype == torch.float32
    src = t["layers.1.attn.q_norm.weight" if naming == "reference" else "model.layers.1.self_attn.q_a_layernorm.weight"]
    assert torch.equal(w, src.float())  # bf16 -> fp32 is exact
    assert torch.equal(model.norm.weight, t["norm.weight" if naming == "reference" else "model.norm.weight"].float())
    if naming == "huggingface":
        assert "model.layers.3.enorm.weight" in rep.unused  # MTP norms have no module here
    assert "loaded 13 norm gain(s)" in str(rep)


def test_load_norms_follows_the_index_over_a_stale_copy(tmp_path):
    # A norm stored in two shards: the copy in the shard the index names is loaded (the first shard
    # in file order used to win); a norm missing from its listed shard is taken from where it is.
    t = tensors(HF_MAIN)
    stale = {k: torch.zeros_like(v) for k, v in t.items() if k == "model.norm.weight"}
    save_file(stale, str(tmp_path / "a.safetensors"))
    save_file(t, str(tmp_path / "b.safetensors"))
    weight_map = {k: "b.safetensors" for k in t}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map | {"x": "a.safetensors"}}))
    model = _RefModel()
    rep = load_norms(model, tmp_path)
    assert len(rep.loaded) == 13
    assert torch.equal(model.norm.weight, t["model.norm.weight"].float())
    weight_map["model.layers.0.input_layernorm.weight"] = "a.safetensors"  # listed where it is not
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = _RefModel()
    assert len(load_norms(model, tmp_path).loaded) == 13
    assert torch.equal(model.layers[0].attn_norm.weight, t["model.layers.0.input_layernorm.weight"].float())
    assert torch.equal(model.norm.weight, t["model.norm.weight"].float())


def test_count_checks_the_copy_load_norms_takes(tmp_path):
    # A duplicated tensor whose indexed copy has the wrong shape: count judges that copy (it had
    # checked the first in file order and reported only the duplicate), as load_norms loads it.
    t = hf_checkpoint(tmp_path)
    save_file({"model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}, str(tmp_path / "zz.safetensors"))
    weight_map = {k: "model.safetensors" for k in t} | {"model.norm.weight": "zz.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    found = kinds(count_norms(tmp_path))
    assert ("duplicate", "model.norm.weight") in found and ("shape", "model.norm.weight") in found
    with pytest.raises(ValueError, match=r"norm: model\.norm\.weight has shape \[8\]"):
        load_norms(_RefModel(), tmp_path)


def test_load_norms_fp16_and_fp32(tmp_path):
    for dtype in (torch.float16, torch.float32):
        t = hf_checkpoint(tmp_path / str(dtype), dtype=dtype)
        model = _RefModel()
        load_norms(model, tmp_path / str(dtype))
        assert torch.equal(model.layers[2].ffn_norm.weight, t["model.layers.2.post_attention_layernorm.weight"].float())


def test_load_norms_f64_loads_only_exact_float32_values(tmp_path):
    # count accepts an F64 gain; load_norms loads it when every value is a float32, else names it.
    t = hf_checkpoint(tmp_path / "exact", dtype=torch.float64)  # bf16 values widened: exact in fp32
    model = _RefModel()
    load_norms(model, tmp_path / "exact")
    assert torch.equal(model.norm.weight, t["model.norm.weight"].float())
    t["model.norm.weight"] = t["model.norm.weight"] + 1e-12
    save_file(t, str(tmp_path / "exact" / "model.safetensors"))
    before = _norm_weights(model)
    with pytest.raises(ValueError, match=r"norm: model\.norm\.weight \(F64\) is not exactly representable"):
        load_norms(model, tmp_path / "exact")
    assert all(torch.equal(before[k], v) for k, v in _norm_weights(model).items())


def test_load_norms_refuses_meta_parameters(tmp_path):
    # A copy into a meta parameter keeps nothing: loading before materialising would report
    # success and lose every value.
    hf_checkpoint(tmp_path)
    with torch.device("meta"):
        model = _RefModel()
    with pytest.raises(ValueError, match=r"(?s)nothing loaded; 13 problem.*norm: weight is on the meta device.*to_empty"):
        load_norms(model, tmp_path)
    model = model.to_empty(device="cpu")
    assert len(load_norms(model, tmp_path).loaded) == 13
    # A meta-built model that patch left alone (it cannot check meta norms) is told the order.
    with torch.device("meta"):
        hf_like = torch.nn.Sequential(torch.nn.RMSNorm(16))
    rep = dsnorm.patch(hf_like)
    assert not rep.replaced and "to_empty" in rep.left[0].reason
    with pytest.raises(ValueError, match=r"no dsnorm.RMSNorm modules.*meta device.*to_empty.*then patch, then load_norms"):
        load_norms(hf_like, tmp_path)


def test_load_norms_all_or_nothing(tmp_path):
    t = hf_checkpoint(tmp_path / "shape")
    t["model.layers.2.self_attn.q_a_layernorm.weight"] = torch.ones(7, dtype=torch.bfloat16)
    save_file(t, str(tmp_path / "shape" / "model.safetensors"))
    model = _RefModel()
    before = _norm_weights(model)
    with pytest.raises(ValueError, match=r"(?s)nothing loaded.*layers\.2\.attn\.q_norm.*shape \[7\]") as e:
        load_norms(model, tmp_path / "shape")
    assert "model.layers.2.self_attn.q_a_layernorm.weight" in str(e.value)
    after = _norm_weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)

    hf_checkpoint(tmp_path / "missing", [n for n in HF_MAIN if n != "model.norm.weight"])
    with pytest.raises(ValueError, match=r"norm: missing \(looked for norm.weight or model.norm.weight\)"):
        load_norms(model, tmp_path / "missing")
    assert all(torch.equal(before[k], v) for k, v in _norm_weights(model).items())

    with pytest.raises(TypeError, match="torch.nn.Module"):
        load_norms("not a model", tmp_path / "missing")
    with pytest.raises(ValueError, match="no dsnorm.RMSNorm"):
        load_norms(torch.nn.Linear(2, 2), tmp_path / "missing")


def _two_norms(tmp_path, a_value, b_value):
    path = tmp_path / "two.safetensors"
    save_file({"a.weight": torch.full((8,), a_value), "b.weight": torch.full((8,), b_value)}, str(path))
    model = torch.nn.Module()
    model.a, model.b = dsnorm.RMSNorm(8), dsnorm.RMSNorm(8)
    return model, path


@pytest.mark.parametrize("setup", ["inference", "expanded", "tied", "overlapping"])
def test_load_norms_refuses_weights_it_cannot_write_whole(tmp_path, setup):
    # Found by review: each of these raised inside the copy loop (a already loaded, the error naming
    # no module) or, tied, kept only the last value while reporting both loaded.
    model, path = _two_norms(tmp_path, 2.0, 3.0)
    if setup == "inference":
        with torch.inference_mode():
            model.b = dsnorm.RMSNorm(8)
    elif setup == "expanded":
        model.b.weight = torch.nn.Parameter(torch.ones(1).expand(8))
    elif setup == "tied":
        model.b.weight = model.a.weight
    else:
        base = torch.ones(12)
        model.a.weight, model.b.weight = torch.nn.Parameter(base[:8]), torch.nn.Parameter(base[4:])
    before = {n: m.weight.detach().clone() for n, m in (("a", model.a), ("b", model.b))}
    why = {"inference": "inference tensor", "expanded": "share one memory location",
           "tied": "tied to a's.*different values", "overlapping": "overlaps a's in memory"}[setup]
    with pytest.raises(ValueError, match=rf"(?s)nothing loaded.*b: weight.*{why}"):
        load_norms(model, path)
    assert all(torch.equal(before[n], m.weight) for n, m in (("a", model.a), ("b", model.b)))


def test_load_norms_tied_gains_load_when_the_checkpoint_agrees(tmp_path):
    model, path = _two_norms(tmp_path, 2.0, 2.0)
    model.b.weight = model.a.weight
    assert len(load_norms(model, path).loaded) == 2
    assert torch.equal(model.a.weight, torch.full((8,), 2.0))
    # Under inference mode an inference-mode model loads.
    with torch.inference_mode():
        model.b = dsnorm.RMSNorm(8)
        assert len(load_norms(model, path).loaded) == 2
        assert torch.equal(model.b.weight, torch.full((8,), 2.0))


def test_load_norms_puts_back_what_it_wrote_when_a_write_fails():
    # The last line of defence behind the checks: a write that fails part-way (here an inference
    # tensor passed straight to the copy step) undoes the earlier writes and names the module.
    from dsnorm.checkpoint import _copy_all

    a = dsnorm.RMSNorm(4)
    with torch.inference_mode():
        b = dsnorm.RMSNorm(4)
    with pytest.raises(ValueError, match=r"nothing loaded; writing b.weight failed: RuntimeError"):
        _copy_all([("a", a, None), ("b", b, None)], [torch.full((4,), 2.0), torch.full((4,), 3.0)])
    assert torch.equal(a.weight, torch.ones(4)) and torch.equal(b.weight, torch.ones(4))


# Kills: read_header's overlap check as `b1 < e0 - 1` (tensors sharing one byte accepted).
def test_one_byte_overlap_is_refused(tmp_path):
    p = _write_raw(tmp_path / "m.safetensors", _header({
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [3, 7]},
    }), b"\0" * 8)
    with pytest.raises(CheckpointError, match="overlap"):
        read_header(p)


# Kills: resolve_checkpoint not reporting a model-parallel rank outside 0..N-1.
def test_model_parallel_rank_outside_world_size(tmp_path):
    ref_checkpoint(tmp_path / "c", mp=2)
    (tmp_path / "c" / "model2-mp2.safetensors").write_bytes((tmp_path / "c" / "model0-mp2.safetensors").read_bytes())
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(REF_CFG))
    rep = count_norms(tmp_path / "c", str(cfg))
    assert not rep.ok and ("extra_shard", None) in kinds(rep)


# ---------------------------------------------------------------------------------------------------
# From an adversarial review of the checkpoint tools (session 16)

def test_a_shape_of_many_dims_is_refused_by_name(tmp_path, capsys):
    # The exact product of 20,000 dims has 6,000 digits: the size check took time quadratic in the
    # dims, and its message could not print the number (a bare ValueError, no file named).
    p = _write_raw(tmp_path / "m.safetensors", _header({"t": {"dtype": "U8", "shape": [2] * 20000,
                                                              "data_offsets": [0, 8]}}), b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"element count overflows 64 bits") as e:
        read_header(p)
    assert str(p) in str(e.value) and "20,000 dims" in str(e.value)
    assert cli.main(["count", str(p)]) == 2
    assert "m.safetensors" in capsys.readouterr().err
    # A zero dim first makes it empty, however many dims come after it.
    p = _write_raw(tmp_path / "z.safetensors", _header({"t": {"dtype": "U8", "shape": [0] + [3] * 20000,
                                                              "data_offsets": [0, 0]}}))
    assert read_header(p).tensors["t"].numel == 0


def test_model_parallel_world_size_is_not_trusted_to_be_small(tmp_path):
    # N of model{i}-mp{N} comes from a file name: the missing ranks are listed up to a cap and
    # counted beyond it (range(N) was built: 10**12 exhausted memory).
    for n in (10**5, 10**12):
        d = tmp_path / str(n)
        ref_checkpoint(d, mp=1)
        os.rename(d / "model0-mp1.safetensors", d / f"model0-mp{n}.safetensors")
        problems = resolve_checkpoint(d).problems
        assert [p["kind"] for p in problems] == ["missing_shard"] * 65
        assert problems[0]["detail"] == f"model-parallel shard model1-mp{n}.safetensors is missing"
        assert f"and {n - 65:,} more of the {n:,}" in problems[-1]["detail"]


def _replicas(tmp_path, change):
    t = ref_checkpoint(tmp_path, mp=2)
    name = "layers.1.attn_norm.weight"
    save_file({**t, name: change(t[name])}, str(tmp_path / "model1-mp2.safetensors"))
    return t


@pytest.mark.parametrize("change, match", [
    (lambda v: v * 2, r"same dtype and shape, different values"),
    (lambda v: v.float(), r"model0-mp2.safetensors: BF16 \[16\]; model1-mp2.safetensors: F32 \[16\]"),
])
def test_load_norms_refuses_replicas_that_disagree(tmp_path, change, match):
    # Each rank of the reference loads its own copy: load_norms took rank 0's and never looked at
    # the others (count reports a dtype/shape difference, not a value one: it reads headers only).
    _replicas(tmp_path, change)
    model = _RefModel()
    before = _norm_weights(model)
    with pytest.raises(ValueError, match=r"layers\.1\.attn_norm: layers\.1\.attn_norm\.weight is stored in 2 "
                                         r"files that disagree: .*" + match):
        load_norms(model, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in _norm_weights(model).items())


def test_load_norms_refuses_a_stale_copy_no_index_settles(tmp_path):
    t = hf_checkpoint(tmp_path)
    save_file({"model.norm.weight": torch.zeros(16, dtype=torch.bfloat16)}, str(tmp_path / "model-old.safetensors"))
    assert ("duplicate", "model.norm.weight") in kinds(count_norms(tmp_path))
    model = _RefModel()
    with pytest.raises(ValueError, match=r"model\.norm\.weight is stored in 2 files that disagree"):
        load_norms(model, tmp_path)
    assert torch.equal(model.norm.weight, torch.ones(16))
    # The same bytes in both: nothing is in doubt.
    save_file({"model.norm.weight": t["model.norm.weight"]}, str(tmp_path / "model-old.safetensors"))
    load_norms(model, tmp_path)
    assert torch.equal(model.norm.weight, t["model.norm.weight"].float())


_U8_4 = {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}


@pytest.mark.parametrize("case, entries, data", [
    ("trailing bytes", {"a": _U8_4}, 8),
    ("gap between tensors", {"a": _U8_4, "b": {**_U8_4, "data_offsets": [6, 10]}}, 10),
    ("gap before the first", {"a": {**_U8_4, "data_offsets": [2, 6]}}, 6),
    ("data and no tensor", {}, 4),
    ("empty tensor inside another", {"a": _U8_4, "z": {"dtype": "U8", "shape": [0], "data_offsets": [2, 2]}}, 4),
    ("unknown dtype", {"a": {**_U8_4, "dtype": "I4"}}, 4),
    ("metadata not strings", {"__metadata__": {"format": 1}, "a": _U8_4}, 4),
    ("half a byte of F4", {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, 2),
    ("overflow before a zero dim", {"a": {"dtype": "U8", "shape": [2**33, 2**33, 0], "data_offsets": [0, 0]}}, 0),
    ("a dim of 2**64", {"a": {"dtype": "U8", "shape": [0, 2**64], "data_offsets": [0, 0]}}, 0),
    ("fine: the largest dim after a zero", {"a": {"dtype": "U8", "shape": [0, 2**64 - 1], "data_offsets": [0, 0]}}, 0),
    ("fine: whole bytes of F4 and F6", {"a": {"dtype": "F4", "shape": [2, 2], "data_offsets": [0, 2]},
                                        "b": {"dtype": "F6_E3M2", "shape": [4], "data_offsets": [2, 5]}}, 5),
    ("fine: null metadata", {"__metadata__": None, "a": _U8_4}, 4),
    ("fine: empty tensors at the ends", {"y": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}, "a": _U8_4,
                                         "z": {"dtype": "U8", "shape": [0], "data_offsets": [4, 4]}}, 4),
    ("fine: FNUZ fp8", {"a": {**_U8_4, "dtype": "F8_E4M3FNUZ"}, "b": {**_U8_4, "dtype": "F8_E5M2FNUZ",
                                                                      "data_offsets": [4, 8]}}, 8),
    ("fine: no tensors", {}, 0),
])
def test_header_rules_are_the_safetensors_librarys(tmp_path, case, entries, data):
    # count said OK for files safetensors (and with it transformers and the reference's loader)
    # refuses, and refused a null __metadata__ it takes.
    from safetensors import safe_open

    p = _write_raw(tmp_path / "m.safetensors", _header(entries), b"\0" * data)
    try:
        with safe_open(str(p), "pt"):
            pass
        theirs = None
    except Exception as e:  # safetensors raises its own SafetensorError
        theirs = e
    assert (theirs is None) == case.startswith("fine"), theirs
    if theirs is None:
        read_header(p)
    else:
        with pytest.raises(CheckpointError, match="not a valid safetensors file|unknown dtype 'I4'|__metadata__ is not"):
            read_header(p)


def test_report_escapes_control_characters_in_names(tmp_path, capsys):
    # A tensor name is untrusted text: printed raw, a newline and a terminal escape in it forged an
    # "OK" verdict line and hid the real one.
    t = hf_checkpoint(tmp_path)
    evil = "x.norm\n\nOK: the checkpoint's norm tensors match the config\x1b[8m.weight"
    save_file({**t, evil: torch.ones(4, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    assert cli.main(["count", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[8m" in out
    assert [line for line in out.splitlines() if line.startswith("OK")] == []
    assert out.splitlines()[-1] == "MISMATCH: the checkpoint does not match the config"


def test_count_errors_print_on_one_line(tmp_path, capsys):
    # An index naming a missing shard "x\nOK: ...": the error quoted the name raw, so stderr showed
    # the forged verdict on a line of its own.
    forged = "x\nOK: the checkpoint's norm tensors match the config\n\x1b[8m"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": forged}}))
    assert cli.main(["count", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dsnorm count: error: ") and "\x1b" not in err


def test_an_index_naming_a_shard_two_ways_is_one_shard(tmp_path):
    t = hf_checkpoint(tmp_path)
    weight_map = {k: ("./" if i % 2 else "") + "model.safetensors" for i, k in enumerate(t)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert len(resolve_checkpoint(tmp_path).files) == 1
    assert count_norms(tmp_path).ok


def test_load_norms_into_a_bare_module_finds_its_state_dict_key(tmp_path):
    w = (1 + torch.arange(16) / 16).bfloat16()
    save_file({"weight": w}, str(tmp_path / "n.safetensors"))
    norm = dsnorm.RMSNorm(16)
    rep = load_norms(norm, tmp_path / "n.safetensors")
    assert torch.equal(norm.weight, w.float())
    assert rep.loaded[0]["module"] == "<model itself>"
    save_file({"other": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match=r"<model itself>: missing \(looked for weight\)"):
        load_norms(dsnorm.RMSNorm(16), tmp_path / "other.safetensors")

"""The site catalogue: counts for the 671B default, both config namings, the CLI."""

import json
import os
import subprocess
import sys

import pytest

import dsnorm
from dsnorm import cli
from dsnorm.sites import (
    DEFAULT_CONFIG_NAME,
    config_from_dict,
    default_config_path,
    enumerate_sites,
    load_config,
    render_page,
    resolve_site,
    summarise,
    totals,
)

# The Hugging Face config.json of DeepSeek-V3.2-Exp, norm-relevant fields (same model as the default).
HF_671B = {
    "hidden_size": 7168, "num_hidden_layers": 61, "first_k_dense_replace": 3, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6, "index_head_dim": 128,
    "n_routed_experts": 256, "moe_layer_freq": 1, "model_type": "deepseek_v32", "qk_rope_head_dim": 64,
}


def test_default_config_is_the_shipped_671b_file():
    with open(default_config_path()) as f:
        raw = json.load(f)
    assert raw["dim"] == 7168 and raw["n_layers"] == 61 and raw["n_dense_layers"] == 3
    assert raw["q_lora_rank"] == 1536 and raw["kv_lora_rank"] == 512 and raw["index_head_dim"] == 128
    cfg = load_config()
    assert cfg.format == "reference" and DEFAULT_CONFIG_NAME in cfg.source
    assert (cfg.dim, cfg.n_layers, cfg.n_dense_layers, cfg.q_lora_rank, cfg.kv_lora_rank) == (7168, 61, 3, 1536, 512)


def test_671b_totals_match_the_issue():
    cfg = load_config()
    sites = enumerate_sites(cfg)
    rows = {r.key: r for r in summarise(sites)}
    assert rows["norm"].params == 7_168 and rows["norm"].instances == 1
    q = rows["q_norm"]
    assert q.per_instance == 1_536 and q.moe == 58 and q.dense == 3
    assert q.per_instance * q.moe == 89_088 and q.params == 93_696
    t = totals(cfg, sites)
    assert t["params"] == 61 * (7_168 + 7_168 + 1_536 + 512) + 7_168 == 1_006_592
    assert t["instances"] == 245
    assert t["formula"] == "61 × (7,168 + 7,168 + 1,536 + 512) + 7,168 = 1,006,592"
    # The indexer LayerNorm is named but kept out of the RMSNorm totals.
    assert rows["k_norm"].norm_type == "layernorm" and rows["k_norm"].per_instance == 256
    assert t["layernorm_instances"] == 61
    # The MTP layer is listed separately: enorm, hnorm, shared_head.norm and its block's 4 RMSNorms.
    mtp = [s for s in sites if s.group == "mtp"]
    assert {s.hf_path for s in mtp if s.norm_type == "rmsnorm"} == {
        "model.layers.61.enorm", "model.layers.61.hnorm", "model.layers.61.shared_head.norm",
        "model.layers.61.input_layernorm", "model.layers.61.post_attention_layernorm",
        "model.layers.61.self_attn.q_a_layernorm", "model.layers.61.self_attn.kv_a_layernorm",
    }
    assert all(s.ref_path is None for s in mtp)
    assert t["mtp_rmsnorm_instances"] == 7 and t["mtp_rmsnorm_params"] == 4 * 7168 + 7168 + 1536 + 512


def test_site_paths_kinds_and_forms():
    sites = enumerate_sites(load_config(), mtp=False)
    by_ref = {s.ref_path: s for s in sites}
    s = by_ref["layers.0.attn_norm"]
    assert s.hf_path == "model.layers.0.input_layernorm" and s.block == "dense" and s.form == "plain"
    s = by_ref["layers.3.attn_norm"]
    assert s.block == "moe" and s.form == "fused"
    assert by_ref["layers.2.ffn_norm"].hf_path == "model.layers.2.post_attention_layernorm"
    assert by_ref["layers.2.ffn_norm"].block == "dense" and by_ref["layers.2.ffn_norm"].form == "fused"
    s = by_ref["layers.60.attn.q_norm"]
    assert s.hf_path == "model.layers.60.self_attn.q_a_layernorm" and s.width == 1536 and s.form == "plain"
    assert by_ref["layers.7.attn.kv_norm"].hf_path == "model.layers.7.self_attn.kv_a_layernorm"
    assert by_ref["layers.7.attn.kv_norm"].width == 512
    assert by_ref["norm"].hf_path == "model.norm" and by_ref["norm"].form == "fused" and by_ref["norm"].block is None
    assert by_ref["layers.5.attn.indexer.k_norm"].tensors == ("weight", "bias")
    assert by_ref["norm"].to_dict()["input_shape"] == ["B", "T", 7168]


def test_hf_config_gives_the_same_main_sites():
    ref = enumerate_sites(load_config())
    hf = enumerate_sites(config_from_dict(HF_671B, "hf"))
    assert [(s.key, s.hf_path, s.width, s.block, s.form) for s in hf] == [
        (s.key, s.hf_path, s.width, s.block, s.form) for s in ref]
    assert totals(config_from_dict(HF_671B))["params"] == 1_006_592


def test_hf_config_fields_change_the_sites():
    cfg = config_from_dict({**HF_671B, "num_hidden_layers": 4, "first_k_dense_replace": 1, "q_lora_rank": None,
                            "num_nextn_predict_layers": 2, "hidden_size": 256, "rms_norm_eps": 1e-5})
    sites = enumerate_sites(cfg)
    assert not any(s.key == "q_norm" for s in sites)  # no query latent: no q_norm (V2-Lite style)
    assert sum(1 for s in sites if s.key == "mtp.enorm") == 2
    assert {s.layer for s in sites if s.group == "mtp"} == {4, 5}
    t = totals(cfg, sites)
    assert t["params"] == 4 * (256 + 256 + 512) + 256 and t["instances"] == 4 * 3 + 1
    assert t["dense_blocks"] == 1 and t["moe_blocks"] == 3
    assert next(s for s in sites if s.key == "attn_norm").eps == 1e-5
    assert next(s for s in sites if s.key == "kv_norm").eps == 1e-6  # HF's latent norms use the default eps


# Kills: a reference config from before V3.2 (DeepSeek-V3's inference/configs, no index_* field)
# read with V3.2's ModelArgs default index_head_dim 128: an indexer k_norm in every layer, and
# `dsnorm count` reported a V3 checkpoint's 122 missing k_norm tensors.
def test_a_reference_config_without_indexer_fields_has_no_indexer():
    raw = json.loads(open(default_config_path()).read())
    v3 = {k: v for k, v in raw.items() if not k.startswith("index_")}
    assert len(v3) < len(raw)  # the V3.2 config states its indexer
    cfg = config_from_dict(v3, "config_671B.json")
    assert cfg.index_head_dim == 0
    assert not any("k_norm" in s.key for s in enumerate_sites(cfg))
    assert config_from_dict(raw, "v3.2").index_head_dim == raw["index_head_dim"]
    # Any indexer field says V3.2: the others take ModelArgs' defaults.
    assert config_from_dict({**v3, "index_n_heads": 64}, "partial").index_head_dim == 128


def test_more_dense_layers_than_layers_makes_every_block_dense():
    # A truncated copy of the 671B config (n_layers 2, n_dense_layers left at 3) is a usual smoke test;
    # the reference (layer_id < n_dense_layers) and transformers build every block dense.
    raw = json.loads(open(default_config_path()).read())
    for cfg in (config_from_dict({**raw, "n_layers": 2}, "ref"),
                config_from_dict({**HF_671B, "num_hidden_layers": 2}, "hf")):
        t = totals(cfg, enumerate_sites(cfg))
        assert (t["dense_blocks"], t["moe_blocks"]) == (2, 0)


# Kills: kv_norm's input catalogued as a contiguous [B, T, 512] (ModelConfig ignored qk_rope_head_dim).
# The reference MLA.forward normalises kv of `kv, k_pe = torch.split(self.wkv_a(x), [kv_lora_rank,
# qk_rope_head_dim], dim=-1)`: the first 512 of each 576-wide row, a view whose rows are 576 apart.
def test_671b_kv_norm_input_is_a_strided_slice_of_wkv_a():
    with open(default_config_path()) as f:
        assert json.load(f)["qk_rope_head_dim"] == 64
    cfg = load_config()
    assert cfg.qk_rope_head_dim == 64 and cfg.to_dict()["qk_rope_head_dim"] == 64
    sites = enumerate_sites(cfg)
    strided = [s for s in sites if s.input_row_stride != s.width]
    assert {s.key for s in strided} == {"kv_norm", "mtp.kv_norm"} and len(strided) == 61 + 1
    for s in sites:
        d = s.to_dict()
        assert d["input_row_stride"] == s.input_row_stride
        assert d["input_row_stride"] == (576 if s.key.endswith("kv_norm") else s.width), s.hf_path
        assert d["input_contiguous"] is (not s.key.endswith("kv_norm"))
        assert (d["input_slice_of"] is None) is (not s.key.endswith("kv_norm"))
        # The existing keys stay as they were: the shape is the view's, the output is contiguous.
        assert d["input_shape"] == d["output_shape"] == ["B", "T", s.width] and "residual" in d
    kv = next(s for s in sites if s.ref_path == "layers.7.attn.kv_norm").to_dict()
    assert kv["width"] == 512 and kv["input_slice_of"] == {
        "module_ref_path": "layers.7.attn.wkv_a", "module_hf_path": "model.layers.7.self_attn.kv_a_proj_with_mqa",
        "output_width": 576, "column_start": 0, "column_stop": 512,
        "description": kv["input_slice_of"]["description"],
    }
    for text in ("first 512 of the 576 columns of wkv_a(x)", "kv_lora_rank 512 + qk_rope_head_dim 64", "k_pe",
                 "strided view", "rows 576 elements apart", "not copied"):
        assert text in kv["input_slice_of"]["description"], text
    mtp_kv = next(s for s in sites if s.key == "mtp.kv_norm").to_dict()["input_slice_of"]
    assert mtp_kv["module_ref_path"] is None
    assert mtp_kv["module_hf_path"] == "model.layers.61.self_attn.kv_a_proj_with_mqa"
    # Summary rows: the same keys, paths as layer patterns.
    rows = {r.key: r.to_dict() for r in summarise(sites)}
    assert rows["kv_norm"]["input_row_stride"] == 576 and rows["kv_norm"]["input_contiguous"] is False
    assert rows["kv_norm"]["input_slice_of"]["module_ref_path"] == "layers.{i}.attn.wkv_a"
    assert rows["kv_norm"]["input_slice_of"]["module_hf_path"] == "model.layers.{i}.self_attn.kv_a_proj_with_mqa"
    assert rows["kv_norm"]["input_shape"] == ["B", "T", 512] and rows["kv_norm"]["params_per_instance"] == 512
    for key, r in rows.items():
        if not key.endswith("kv_norm"):
            got = (r["input_row_stride"], r["input_contiguous"], r["input_slice_of"])
            assert got == (r["width"], True, None), key


def _kv(cfg):
    return next(s for s in enumerate_sites(cfg) if s.key == "kv_norm")


def test_qk_rope_head_dim_sets_the_kv_norm_stride():
    raw = json.loads(open(default_config_path()).read())
    for cfg in (config_from_dict({**raw, "qk_rope_head_dim": 32, "kv_lora_rank": 256}, "ref"),
                config_from_dict({**HF_671B, "qk_rope_head_dim": 32, "kv_lora_rank": 256}, "hf")):
        kv = _kv(cfg)
        assert cfg.qk_rope_head_dim == 32 and kv.width == 256 and kv.input_row_stride == 288
        sl = kv.to_dict()["input_slice_of"]
        assert (sl["output_width"], sl["column_start"], sl["column_stop"]) == (288, 0, 256)
        assert "rows 288 elements apart" in sl["description"]
        assert all(s.input_row_stride == s.width for s in enumerate_sites(cfg) if not s.key.endswith("kv_norm"))
    # Absent: the reference ModelArgs default (and transformers' DeepseekV3Config's), 64, in both namings.
    no_rope = {k: v for k, v in raw.items() if k != "qk_rope_head_dim"}
    hf_no_rope = {k: v for k, v in HF_671B.items() if k != "qk_rope_head_dim"}
    assert config_from_dict(no_rope).qk_rope_head_dim == config_from_dict(hf_no_rope).qk_rope_head_dim == 64
    assert _kv(config_from_dict(no_rope)).input_row_stride == 576
    assert _kv(config_from_dict(hf_no_rope)).input_row_stride == 576
    # No rotary key: the split's first part is the whole row, contiguous.
    flat = _kv(config_from_dict({**raw, "qk_rope_head_dim": 0}))
    assert flat.input_row_stride == 512 and flat.to_dict()["input_contiguous"] is True


def test_hf_config_kv_norm_slice_names_kv_a_proj_with_mqa():
    cfg = config_from_dict(HF_671B, "hf")
    assert cfg.format == "huggingface" and cfg.qk_rope_head_dim == 64
    kv = next(s for s in enumerate_sites(cfg) if s.hf_path == "model.layers.3.self_attn.kv_a_layernorm")
    assert kv.input_row_stride == 576 and kv.input_slice is not None
    assert kv.input_slice.module_hf_path == "model.layers.3.self_attn.kv_a_proj_with_mqa"
    assert kv.input_slice.module_ref_path == "layers.3.attn.wkv_a"
    # Every site's JSON, the new input keys included, is the reference config's.
    assert [s.to_dict() for s in enumerate_sites(cfg)] == [s.to_dict() for s in enumerate_sites(load_config())]


@pytest.mark.parametrize("bad", [
    {"qk_rope_head_dim": "64"}, {"qk_rope_head_dim": True}, {"qk_rope_head_dim": -1},
    {"qk_rope_head_dim": None}, {"qk_rope_head_dim": 64.0}, {"qk_rope_head_dim": 1 << 30},
])
@pytest.mark.parametrize("base", ["ref", "hf"])
def test_bad_qk_rope_head_dim_is_refused_by_name(bad, base):
    raw = json.loads(open(default_config_path()).read()) if base == "ref" else HF_671B
    with pytest.raises(ValueError, match=r"cfg\.json: config field 'qk_rope_head_dim'"):
        config_from_dict({**raw, **bad}, "cfg.json")


def test_kv_norm_stride_in_table_page_and_json(tmp_path, capsys):
    for argv in (["sites", "--wide"], ["sites", "--markdown"], ["sites"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        flat = " ".join(out.split())  # the default text wraps its prose
        assert "qk_rope_head_dim 64" in flat
        if argv == ["sites"]:  # the input width alone, in a table that fits 120 columns
            lines = [ln for ln in out.splitlines() if "512 of 576" in ln and "kv_norm" in ln]
        else:
            lines = [ln for ln in out.splitlines() if " of " in ln and "[B, T," in ln and "->" in ln]
            # kv_norm's row and the MTP block's, nothing else; the output stays [B, T, 512].
            assert all("[B, T, 512 of 576] -> [B, T, 512]" in ln for ln in lines), lines
        assert len(lines) == 2 and all("kv_norm" in ln for ln in lines), lines
        assert "rows 576 elements apart, not copied" in flat and "kv_a_proj_with_mqa" in flat
    assert cli.main(["sites", "--site", "kv_a_layernorm"]) == 0
    page = " ".join(capsys.readouterr().out.split())
    for text in ("in: x [B batch, T positions, 512]", "x (row stride 576): the first 512 of the 576 columns",
                 "decode (one position): [B, 1, 512 of 576]", "y is contiguous", "strided view the split returns"):
        assert text in page, text
    assert "x and y contiguous (row stride 1,536)" in render_page(load_config(), "q_norm")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**HF_671B, "qk_rope_head_dim": 32}))
    assert cli.main(["sites", "--config", str(cfg), "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["qk_rope_head_dim"] == 32
    row = next(r for r in data["summary"] if r["key"] == "kv_norm")
    assert row["input_row_stride"] == 544 and row["input_slice_of"]["output_width"] == 544
    assert cli.main(["sites", "--config", str(cfg), "--wide"]) == 0
    assert "[B, T, 512 of 544] -> [B, T, 512]" in capsys.readouterr().out
    # With no rotary key nothing is strided: no "of" in the table, no note.
    cfg.write_text(json.dumps({**HF_671B, "qk_rope_head_dim": 0}))
    assert cli.main(["sites", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert " of " not in out.split("Totals")[0] and "strided" not in out


@pytest.mark.parametrize("bad, msg", [
    ({"vocab_size": 10}, "neither reference"),
    ({"dim": 64, "hidden_size": 64}, "mixes"),
    ({"dim": 64}, "'n_layers' is missing"),
    ({"dim": "64", "n_layers": 2}, "must be an integer"),
    ({"dim": 64, "n_layers": True}, "must be an integer"),
    ({"dim": 0, "n_layers": 2}, "outside"),
    ({"hidden_size": 64, "num_hidden_layers": 2, "kv_lora_rank": 8, "rms_norm_eps": "x"}, "rms_norm_eps"),
    ({"hidden_size": 64, "num_hidden_layers": 2, "kv_lora_rank": 8, "rms_norm_eps": 0},
     r"rms_norm_eps' must be a number in \(0, 1\)"),
    ({"dim": 64, "n_layers": 10**9}, "outside"),
])
def test_bad_configs_are_refused(bad, msg):
    with pytest.raises(ValueError, match=msg):
        config_from_dict(bad, "cfg.json")


def test_bad_config_files(tmp_path):
    with pytest.raises(TypeError, match="JSON object"):
        config_from_dict([1, 2])
    p = tmp_path / "c.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match=r"c\.json.*not valid JSON"):
        load_config(p)
    with pytest.raises(ValueError, match="cannot read"):
        load_config(tmp_path / "absent.json")


def test_site_names_resolve():
    cfg = load_config()
    for name in ("q_norm", "q_a_layernorm", "layers.4.attn.q_norm", "model.layers.4.self_attn.q_a_layernorm",
                 "model.layers.{i}.self_attn.q_a_layernorm"):
        assert resolve_site(name, cfg) == "q_norm"
    assert resolve_site("enorm", cfg) == "mtp.enorm"
    assert resolve_site("model.norm", cfg) == "norm"
    # Each block norm by its module path below the block, in either naming (the indexer's k_norm
    # by its reference path attn.indexer.k_norm was unknown).
    from dsnorm.sites import HF_SUFFIX, REF_SUFFIX

    for key in REF_SUFFIX:
        assert resolve_site(REF_SUFFIX[key], cfg) == key and resolve_site(HF_SUFFIX[key], cfg) == key
    assert resolve_site("attn.indexer.k_norm", cfg) == "k_norm"
    with pytest.raises(ValueError, match="unknown site 'w_norm'"):
        resolve_site("w_norm", cfg)


def test_q_norm_page():
    page = render_page(load_config(), "q_norm")
    for text in ("Query latent RMSNorm", "layers.{i}.attn.q_norm", "model.layers.{i}.self_attn.q_a_layernorm",
                 "d = 1,536", "ε = 1e-06", "in:  x [B batch, T positions, 1,536]", "decode (one position): [B, 1, 1,536]",
                 "× 58 MoE blocks", "89,088", "× 61 blocks", "93,696", "wq_a", "Where it sits"):
        assert text in page, text
    fused = render_page(load_config(), "attn_norm")
    assert "s       = x + residual" in fused and "residual_out" in fused and "1 instance sees no residual" in fused
    assert "LayerNorm" in render_page(load_config(), "k_norm")


def test_cli_default_totals(capsys):
    assert cli.main(["sites"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # lines are wrapped to 120 columns
    assert "final norm: 7,168" in out
    assert "× 58 MoE blocks = 89,088" in out and "× 61 blocks = 93,696" in out
    assert "61 × (7,168 + 7,168 + 1,536 + 512) + 7,168 = 1,006,592 in 245 instances" in out
    assert "model.layers.61.enorm" in out and "model.layers.61.shared_head.norm" in out
    assert "LayerNorm (weight + bias)" in out


# Kills: the default table 170 columns wide, its preamble one 550-character line (issue 40).
@pytest.mark.parametrize("config", [None, "hf"])
def test_cli_default_output_fits_120_columns(config, tmp_path, capsys):
    argv = ["sites"]
    if config == "hf":
        path = tmp_path / "config.json"
        path.write_text(json.dumps(HF_671B))
        argv += ["--config", str(path)]
    pages = []
    for extra in ([], ["--site", "kv_norm"], ["--site", "attn_norm"], ["--site", "mtp.enorm"], ["--site", "k_norm"]):
        assert cli.main(argv + extra) == 0
        pages.append(capsys.readouterr().out)
    for out in pages:
        assert max(len(line) for line in out.splitlines()) <= 120, max(out.splitlines(), key=len)
    # The paths in the config's naming; the MTP rows (no reference module) in Hugging Face's.
    table = pages[0]
    assert ("model.layers.{i}.self_attn.q_a_layernorm" in table) == (config == "hf")
    assert ("layers.{i}.attn.q_norm " in table) == (config is None)
    assert "model.layers.61.self_attn.kv_a_layernorm" in table
    # --wide and Markdown keep every column: both namings, shapes, the dense / MoE counts.
    for extra in (["--wide"], ["--markdown"]):
        assert cli.main(argv + extra) == 0
        out = capsys.readouterr().out
        for text in ("reference path", "Hugging Face path", "in -> out", "dense", "MoE",
                     "layers.{i}.attn.q_norm", "model.layers.{i}.self_attn.q_a_layernorm"):
            assert text in out, (extra, text)
    assert max(len(line) for line in out.splitlines()) > 120  # Markdown rows are not wrapped


def test_cli_markdown_json_site_and_config(tmp_path, capsys):
    assert cli.main(["sites", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| site | reference path |" in out and "| q_norm | layers.{i}.attn.q_norm |" in out
    jpath = tmp_path / "sites.json"
    assert cli.main(["sites", "--json", str(jpath)]) == 0
    data = json.loads(jpath.read_text())
    assert data["totals"]["params"] == 1_006_592 and data["totals"]["instances"] == 245
    assert len([s for s in data["sites"] if s["group"] == "main" and s["norm_type"] == "rmsnorm"]) == 245
    capsys.readouterr()
    assert cli.main(["sites", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["dim"] == 7168
    assert cli.main(["sites", "--site", "q_norm"]) == 0
    assert "89,088" in capsys.readouterr().out
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**HF_671B, "num_hidden_layers": 2, "first_k_dense_replace": 1, "hidden_size": 64,
                               "q_lora_rank": 32, "kv_lora_rank": 16}))
    assert cli.main(["sites", "--config", str(cfg)]) == 0
    assert "2 × (64 + 64 + 32 + 16) + 64 = 416 in 9 instances" in capsys.readouterr().out
    assert cli.main(["sites", "--site", "nope"]) == 2
    assert "unknown site 'nope'" in capsys.readouterr().err
    assert cli.main(["sites", "--config", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    for bad, why in ((tmp_path, "is a directory"), (tmp_path / "no" / "x.json", "no such directory")):
        assert cli.main(["sites", "--json", str(bad)]) == 2  # refused before anything is printed
        out, err = capsys.readouterr()
        assert out == "" and why in err


def test_cli_subprocess():
    # The installed package (not a source tree put on the path), as `python -m dsnorm` too.
    p = subprocess.run([sys.executable, "-m", "dsnorm", "sites"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "= 1,006,592 in 245 instances" in p.stdout
    p = subprocess.run([sys.executable, "-m", "dsnorm", "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == f"dsnorm {dsnorm.__version__}", (p.stdout, p.stderr)


def test_cli_output_into_a_closed_pipe_stops_quietly():
    # `dsnorm sites --json - | head -c 10`: the reader closes the pipe after 10 bytes; the command
    # printed a BrokenPipeError traceback (and another at exit). Now it stops with SIGPIPE's status.
    for json_path, first in (("-", b'{\n "config'), ("/dev/stdout", b"DeepSeek-V")):
        proc = subprocess.Popen([sys.executable, "-m", "dsnorm", "sites", "--json", json_path],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout.read(10) == first
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141 and err == "", (json_path, err)


HF_SMALL = {
    "hidden_size": 64, "num_hidden_layers": 6, "first_k_dense_replace": 1, "q_lora_rank": 32,
    "kv_lora_rank": 16, "num_nextn_predict_layers": 1, "n_routed_experts": 8, "moe_layer_freq": 2,
}


# Kills: ModelConfig.block_kind ignoring moe_layer_freq (every test config has freq 1).
def test_moe_layer_freq_alternates_blocks():
    from dsnorm.sites import totals

    cfg = config_from_dict(HF_SMALL, "hf")
    assert [cfg.block_kind(i) for i in range(6)] == ["dense", "dense", "moe", "dense", "moe", "dense"]
    t = totals(cfg, enumerate_sites(cfg))
    assert (t["dense_blocks"], t["moe_blocks"]) == (4, 2)


# Kills: the MTP block's attn_norm listed as fused (it starts a new residual stream: plain).
def test_mtp_block_attn_norm_is_plain():
    mtp = {s.key: s for s in enumerate_sites(load_config()) if s.group == "mtp"}
    assert mtp["mtp.attn_norm"].form == "plain" and mtp["mtp.ffn_norm"].form == "fused"


def test_sites_json_must_not_replace_its_config(tmp_path, capsys, monkeypatch):
    # Found by review: --json onto --config rewrote the config as the catalogue.
    cfg = tmp_path / "c.json"
    from dsnorm.sites import default_config_path

    with open(default_config_path(), encoding="utf-8") as f:
        cfg.write_text(f.read())
    before = cfg.read_bytes()
    os.symlink(cfg, tmp_path / "link.json")
    for out in (cfg, tmp_path / "link.json"):
        assert cli.main(["sites", "--config", str(cfg), "--json", str(out)]) == 2
        assert "is the --config file" in capsys.readouterr().err
    assert cfg.read_bytes() == before
    # Nor the built-in config it reads without --config (the packaged file in an editable install).
    # A copy stands in for the packaged file, so that a failing check overwrites only the copy.
    import dsnorm.sites as sites

    builtin = tmp_path / "builtin.json"
    builtin.write_bytes(before)
    monkeypatch.setattr(sites, "default_config_path", lambda: str(builtin))
    assert cli.main(["sites", "--json", str(builtin)]) == 2
    assert "is the built-in config file" in capsys.readouterr().err
    assert builtin.read_bytes() == before


def test_json_to_dev_stdout_follows_the_table(tmp_path):
    # stdout redirected to a file, --json /dev/stdout: the JSON goes after the table. A rename over
    # the file lost the table; a pipe made the first version fail (mkstemp in /proc).
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        proc = subprocess.run([sys.executable, "-m", "dsnorm.cli", "sites", "--json", "/dev/stdout"],
                              stdout=f, stderr=subprocess.PIPE, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    table, _, rest = text.partition("\n{\n")
    assert "RMSNorm sites" in table and json.loads("{\n" + rest)["config"]["dim"] == 7168
    proc = subprocess.run(f"{sys.executable} -m dsnorm.cli sites --json /dev/stdout | cat", shell=True,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "RMSNorm sites" in proc.stdout and '"dim": 7168' in proc.stdout

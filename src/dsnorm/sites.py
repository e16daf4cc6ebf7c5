"""The RMSNorm sites of DeepSeek-V3.2-Exp, enumerated from a model config.

Every norm instance of the model, ``y = weight * x / sqrt(mean(x^2) + eps)`` over its last axis,
is listed with its module path in the reference naming (``inference/model.py``: ``layers.{i}.attn_norm``,
``layers.{i}.ffn_norm``, ``layers.{i}.attn.q_norm``, ``layers.{i}.attn.kv_norm``, ``norm``) and in the
Hugging Face naming (``model.layers.{i}.input_layernorm``, ``post_attention_layernorm``,
``self_attn.q_a_layernorm``, ``self_attn.kv_a_layernorm``, ``model.norm``), the kind of block it sits in
(dense for the first ``n_dense_layers`` blocks, MoE after), its form (plain, or fused with the residual
addition), its width, its input/output shapes, its input's row stride and its parameter count.

Every input is contiguous (row stride = width) but ``kv_norm``'s: MLA splits ``wkv_a(x)``, ``kv_lora_rank +
qk_rope_head_dim`` columns wide, into the key-value latent and the rotary key ``k_pe`` with ``torch.split``,
and normalises the latent, the first ``kv_lora_rank`` columns, as the strided view the split returns
(rows ``kv_lora_rank + qk_rope_head_dim`` elements apart, not copied). Outputs are contiguous.

Two families are kept apart from the main-model RMSNorm totals:

* the indexer's ``k_norm`` is a LayerNorm (weight and bias), named but not counted as an RMSNorm;
* the multi-token-prediction (MTP) layer of the Hugging Face checkpoint (``model.layers.{n_layers}``:
  ``enorm``, ``hnorm``, ``shared_head.norm`` and its own block's norms) has no reference module and is
  listed separately.

The 671B V3.2-Exp config ships in ``dsnorm/configs/config_671B_v3.2.json`` and is the default.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, replace
from typing import Any, Iterable, Optional, Sequence, Union, overload

from dsnorm.output_files import json_path_refused, write_output
from dsnorm.terminal import COLUMNS, wrap
from dsnorm.terminal import table as text_table

DEFAULT_CONFIG_NAME = "config_671B_v3.2.json"
# A model config is a few KB; a cap keeps a hostile or mistaken path (a checkpoint shard) from being read whole.
MAX_CONFIG_BYTES = 4 << 20
# Bounds that no real model reaches but that keep a hostile config from enumerating billions of sites.
MAX_WIDTH = 1 << 24
MAX_LAYERS = 1 << 16
# The reference RMSNorm and the MLA latent norms of the HF code always use this eps.
REFERENCE_EPS = 1e-6
# ModelArgs.qk_rope_head_dim of the reference, and DeepseekV3Config's / DeepseekV32Config's default.
DEFAULT_QK_ROPE_HEAD_DIM = 64

# Pinned reference revision and line ranges the seed pages cite (inference/model.py).
REFERENCE_REVISION = "87e509a2e5a1"

_REF_FIELDS = ("dim", "n_layers")
_HF_FIELDS = ("hidden_size", "num_hidden_layers")


@dataclass(frozen=True)
class ModelConfig:
    """The config fields that decide the norm sites.

    Attributes:
        dim: model width (reference ``dim``, HF ``hidden_size``).
        n_layers: transformer blocks of the main model (``n_layers`` / ``num_hidden_layers``).
        n_dense_layers: leading dense-MLP blocks (``n_dense_layers`` / ``first_k_dense_replace``).
        q_lora_rank: query latent width; 0 when queries are not compressed (no ``q_norm``).
        kv_lora_rank: key-value latent width (``kv_norm``).
        qk_rope_head_dim: width of the shared rotary key ``k_pe`` (same name in both namings): ``wkv_a``
            (HF ``kv_a_proj_with_mqa``) outputs ``kv_lora_rank + qk_rope_head_dim`` columns, and
            ``kv_norm`` reads the first ``kv_lora_rank`` of them in place, so this sets its input's row stride.
        index_head_dim: indexer key width (its LayerNorm ``k_norm``); 0 when there is no indexer.
        n_mtp_layers: multi-token-prediction layers of the HF checkpoint (``num_nextn_predict_layers``).
        mtp_stated: whether the config states ``n_mtp_layers`` (reference configs do not: the
            reference code has no MTP layer; the V3.2-Exp HF release has one, assumed then).
        eps: eps of the width-``dim`` norms (HF ``rms_norm_eps``; the reference uses 1e-6).
        moe_layer_freq: HF ``moe_layer_freq`` (a block ``i >= n_dense_layers`` is MoE when
            ``i % moe_layer_freq == 0``); 1 in every DeepSeek-V3 config.
        has_moe: False when the config has no routed experts (every block dense).
        format: ``"reference"`` or ``"huggingface"``: which field names the config used.
        source: the file it came from, or ``"built-in <name>"``.
    """

    dim: int
    n_layers: int
    n_dense_layers: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    n_mtp_layers: int
    mtp_stated: bool
    eps: float
    moe_layer_freq: int
    has_moe: bool
    format: str
    source: str

    def block_kind(self, layer: int) -> str:
        """``"dense"`` or ``"moe"``: the feed-forward kind of block ``layer`` (MTP layers included)."""
        if not self.has_moe or layer < self.n_dense_layers or layer % self.moe_layer_freq != 0:
            return "dense"
        return "moe"

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def _field(d: dict, key: str, source: str, default: Any = None, *, minimum: int = 0, allow_none: bool = False) -> int:
    if key not in d:
        if default is None:
            raise ValueError(f"{source}: config field {key!r} is missing")
        return default
    value = d[key]
    if value is None and allow_none:
        return 0
    # bool is an int subclass; true/false in a width field is a broken config, not 1/0.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: config field {key!r} must be an integer, got {value!r}")
    limit = MAX_LAYERS if "layer" in key or key in ("first_k_dense_replace", "moe_layer_freq") else MAX_WIDTH
    if not minimum <= value <= limit:
        raise ValueError(f"{source}: config field {key!r} = {value} is outside [{minimum}, {limit}]")
    return value


# The V3.2 reference config's indexer fields; a reference config without any of them predates V3.2.
_REF_INDEX_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")


def config_from_dict(d: dict, source: str = "<dict>") -> ModelConfig:
    """Read a model config in either naming into a :class:`ModelConfig`.

    Args:
        d: the parsed JSON object: reference field names (``dim``, ``n_layers``, ``n_dense_layers``,
            ``q_lora_rank``, ``kv_lora_rank``, ``qk_rope_head_dim``, ``index_head_dim``) or Hugging Face
            names (``hidden_size``, ``num_hidden_layers``, ``first_k_dense_replace``, ``q_lora_rank``,
            ``kv_lora_rank``, ``qk_rope_head_dim``, ``num_nextn_predict_layers``, ``rms_norm_eps``,
            ``index_head_dim``). Missing optional fields take the reference ``ModelArgs`` defaults
            (reference names; but a reference config with none of ``index_n_heads``,
            ``index_head_dim``, ``index_topk`` predates V3.2 and has no indexer) or are treated as
            absent (HF names: no indexer, no MTP layer); a missing ``qk_rope_head_dim`` is 64 in both
            (``ModelArgs``' and ``transformers``' DeepseekV3Config default).
        source: named in error messages.

    Raises:
        TypeError: ``d`` is not a dict.
        ValueError: neither naming, both namings, a missing or non-integer field, or inconsistent values.
    """
    if not isinstance(d, dict):
        raise TypeError(f"{source}: a model config must be a JSON object, got {type(d).__name__}")
    is_ref = any(k in d for k in _REF_FIELDS)
    is_hf = any(k in d for k in _HF_FIELDS)
    if is_ref and is_hf:
        raise ValueError(f"{source}: config mixes reference fields {_REF_FIELDS} and Hugging Face fields {_HF_FIELDS}")
    if is_ref:
        # Defaults are those of the reference ModelArgs, which is what the reference code would build.
        dim = _field(d, "dim", source, minimum=1)
        n_layers = _field(d, "n_layers", source, minimum=1)
        n_dense = _field(d, "n_dense_layers", source, 1)
        q_rank = _field(d, "q_lora_rank", source, 0)
        kv_rank = _field(d, "kv_lora_rank", source, 512, minimum=1)
        rope_dim = _field(d, "qk_rope_head_dim", source, DEFAULT_QK_ROPE_HEAD_DIM)
        # V3.2's ModelArgs defaults to an indexer (index_head_dim 128), but the reference configs
        # from before V3.2 (DeepSeek-V3's inference/configs: 16B, 236B, 671B) have no index_* field
        # and no indexer: without any of those fields the config is read as one of them.
        has_indexer = any(k in d for k in _REF_INDEX_FIELDS)
        index_dim = _field(d, "index_head_dim", source, 128 if has_indexer else 0)
        n_routed = _field(d, "n_routed_experts", source, 64)
        n_mtp, mtp_stated = 1, False
        eps, freq, fmt = REFERENCE_EPS, 1, "reference"
    elif is_hf:
        dim = _field(d, "hidden_size", source, minimum=1)
        n_layers = _field(d, "num_hidden_layers", source, minimum=1)
        n_dense = _field(d, "first_k_dense_replace", source, 0)
        q_rank = _field(d, "q_lora_rank", source, 0, allow_none=True)
        kv_rank = _field(d, "kv_lora_rank", source, minimum=1)
        # No None here (unlike q_lora_rank): transformers has no "no rotary key" setting to map it to.
        rope_dim = _field(d, "qk_rope_head_dim", source, DEFAULT_QK_ROPE_HEAD_DIM)
        index_dim = _field(d, "index_head_dim", source, 0, allow_none=True)
        n_routed = _field(d, "n_routed_experts", source, 0, allow_none=True)
        n_mtp = _field(d, "num_nextn_predict_layers", source, 0, allow_none=True)
        mtp_stated = True
        eps = d.get("rms_norm_eps", REFERENCE_EPS)
        # eps > 0, as dsnorm's own eps (a zero row would divide by 0).
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"{source}: config field 'rms_norm_eps' must be a number in (0, 1), got {eps!r}")
        eps = float(eps)
        freq = _field(d, "moe_layer_freq", source, 1, minimum=1)
        fmt = "huggingface"
    else:
        raise ValueError(
            f"{source}: not a DeepSeek config: neither reference fields {_REF_FIELDS} "
            f"nor Hugging Face fields {_HF_FIELDS} are present"
        )
    # n_dense > n_layers is a valid config (a truncated smoke-test copy of the 671B one): every block
    # is then dense, as the reference (layer_id < n_dense_layers) and transformers build it.
    if n_layers + n_mtp > MAX_LAYERS:
        raise ValueError(f"{source}: {n_layers} + {n_mtp} layers is more than {MAX_LAYERS}")
    return ModelConfig(
        dim=dim, n_layers=n_layers, n_dense_layers=n_dense, q_lora_rank=q_rank, kv_lora_rank=kv_rank,
        qk_rope_head_dim=rope_dim, index_head_dim=index_dim, n_mtp_layers=n_mtp, mtp_stated=mtp_stated, eps=eps,
        moe_layer_freq=freq, has_moe=n_routed > 0, format=fmt, source=source,
    )


def read_json_file(path: str, what: str = "JSON file", max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """Parse a small JSON file, refusing files over ``max_bytes`` (error messages name ``path``)."""
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            raise ValueError(f"{path}: {what} is {size:,} bytes, more than the {max_bytes:,}-byte cap")
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(f"{path}: cannot read {what}: {e.strerror or e}") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: {what} is not valid JSON: {e}") from None


def default_config_path() -> str:
    """Path of the built-in 671B DeepSeek-V3.2-Exp config (reference field names)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", DEFAULT_CONFIG_NAME)


@overload
def config_file(path: None) -> None: ...
@overload
def config_file(path: Union[str, os.PathLike[str]]) -> str: ...
@overload
def config_file(path: Optional[Union[str, os.PathLike[str]]]) -> Optional[str]: ...


def config_file(path: Optional[Union[str, os.PathLike[str]]]) -> Optional[str]:
    """The file a config path names: the path itself, or a model directory's ``config.json`` (the
    file ``transformers``' ``from_pretrained`` reads from a checkpoint directory); None for None."""
    if path is None:
        return None
    path = os.fspath(path)
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def load_config(path: Optional[Union[str, os.PathLike[str]]] = None) -> ModelConfig:
    """Load a model config file (reference or HF names); ``None`` loads the built-in 671B default.

    Args:
        path: a JSON file path, a model directory holding ``config.json``, or ``None``.

    Raises:
        ValueError: unreadable, oversized or invalid JSON, or not a DeepSeek config.
    """
    if path is None:
        return config_from_dict(read_json_file(default_config_path(), "built-in config"), f"built-in {DEFAULT_CONFIG_NAME}")
    path = config_file(path)
    return config_from_dict(read_json_file(path, "model config"), path)


@dataclass(frozen=True)
class InputSlice:
    """A norm input that is a column slice of another module's output, read in place.

    ``x = out[..., column_start:column_stop]`` of an output ``out`` that is ``output_width`` columns
    wide and contiguous: a strided view whose rows are ``output_width`` elements apart (no copy), so a
    kernel or buffer sized from the norm's width alone would read the wrong elements.

    Attributes:
        module_ref_path: the producing module in the reference naming (``layers.{i}.attn.wkv_a``),
            ``None`` where there is no reference module (MTP).
        module_hf_path: the producing module in the Hugging Face naming
            (``model.layers.{i}.self_attn.kv_a_proj_with_mqa``).
        output_width: columns of the producing module's output: the input's row stride in elements.
        column_start: first column of the slice.
        column_stop: one past its last column (``column_stop - column_start`` is the norm's width).
        description: the slice in words, with the config fields that size it.
    """

    module_ref_path: Optional[str]
    module_hf_path: str
    output_width: int
    column_start: int
    column_stop: int
    description: str

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def _input_row_stride(width: int, input_slice: Optional[InputSlice]) -> int:
    """Elements from one input row to the next: the producing output's width for a sliced input."""
    return input_slice.output_width if input_slice is not None else width


def _input_keys(width: int, input_slice: Optional[InputSlice]) -> dict[str, Any]:
    """The input-layout keys of a site's or a summary row's JSON (added after the original keys)."""
    stride = _input_row_stride(width, input_slice)
    return {
        "input_row_stride": stride, "input_contiguous": stride == width,
        "input_slice_of": input_slice.to_dict() if input_slice is not None else None,
    }


@dataclass(frozen=True)
class Site:
    """One norm instance of the model.

    Attributes:
        key: the canonical site name, reference style: ``attn_norm``, ``ffn_norm``, ``q_norm``,
            ``kv_norm``, ``norm``, ``k_norm`` (indexer LayerNorm); MTP sites are prefixed ``mtp.``
            (``mtp.enorm``, ``mtp.hnorm``, ``mtp.shared_head.norm``, ``mtp.attn_norm``, ...).
        group: ``"main"`` or ``"mtp"``.
        layer: block index (MTP layers continue after the main blocks), ``None`` for the final norm.
        ref_path: module path in the reference code, ``None`` for MTP sites (no reference module).
        hf_path: module path in the Hugging Face checkpoint.
        block: ``"dense"``, ``"moe"`` or ``None`` (final norm, MTP ``enorm``/``hnorm``/``shared_head``).
        form: ``"plain"`` (``y = norm(x)``) or ``"fused"`` (``s = x + residual``; ``y = norm(s)``,
            ``s`` returned as the new residual).
        norm_type: ``"rmsnorm"`` or ``"layernorm"``.
        width: normalised width (last axis).
        eps: epsilon added to the mean square (variance for LayerNorm).
        tensors: parameter tensor names under the module (``("weight",)``, LayerNorm adds ``"bias"``).
        input_slice: where ``x`` is a column slice of another module's output (``kv_norm``: the first
            ``kv_lora_rank`` columns of ``wkv_a(x)``), that slice; ``None`` for a contiguous input.
    """

    key: str
    group: str
    layer: Optional[int]
    ref_path: Optional[str]
    hf_path: str
    block: Optional[str]
    form: str
    norm_type: str
    width: int
    eps: float
    tensors: tuple[str, ...]
    # Last and defaulted, so that a Site built positionally before this field existed still builds.
    input_slice: Optional[InputSlice] = None

    @property
    def params(self) -> int:
        """Parameters of this instance: one gain per feature (LayerNorm: gain and bias)."""
        return self.width * len(self.tensors)

    @property
    def shape(self) -> list[Union[str, int]]:
        """Input and output shape of ``x``/``y`` (and of the residual in the fused form): ``[B, T, width]``."""
        return ["B", "T", self.width]

    @property
    def input_row_stride(self) -> int:
        """Elements from one row of ``x`` to the next: the producing output's width for a sliced input
        (``kv_norm``: ``kv_lora_rank + qk_rope_head_dim``), else ``width`` (contiguous). The output
        ``y`` (and a fused norm's residual) is always contiguous."""
        return _input_row_stride(self.width, self.input_slice)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "group": self.group, "layer": self.layer, "ref_path": self.ref_path,
            "hf_path": self.hf_path, "block": self.block, "form": self.form, "norm_type": self.norm_type,
            "width": self.width, "eps": self.eps, "tensors": list(self.tensors), "params": self.params,
            "input_shape": self.shape, "output_shape": self.shape,
            "residual": self.form == "fused",
            **_input_keys(self.width, self.input_slice),
        }


# Main-model block norms: key, reference module suffix, HF module suffix, width field, eps source.
_BLOCK_NORMS = (
    ("attn_norm", "attn_norm", "input_layernorm"),
    ("ffn_norm", "ffn_norm", "post_attention_layernorm"),
    ("q_norm", "attn.q_norm", "self_attn.q_a_layernorm"),
    ("kv_norm", "attn.kv_norm", "self_attn.kv_a_layernorm"),
    ("k_norm", "attn.indexer.k_norm", "self_attn.indexer.k_norm"),
)
REF_SUFFIX = {k: r for k, r, _ in _BLOCK_NORMS}
HF_SUFFIX = {k: h for k, _, h in _BLOCK_NORMS}
MTP_OWN = ("enorm", "hnorm", "shared_head.norm")
MAIN_RMS_KEYS = ("attn_norm", "ffn_norm", "q_norm", "kv_norm", "norm")


def _block_sites(cfg: ModelConfig, layer: int, group: str) -> list[Site]:
    kind = cfg.block_kind(layer)
    prefix = "" if group == "main" else "mtp."
    first = layer == 0 if group == "main" else True
    ref = (lambda s: f"layers.{layer}.{s}") if group == "main" else (lambda s: None)
    hf = lambda s: f"model.layers.{layer}.{s}"  # noqa: E731
    out = [
        # Block 0 (and the MTP block) starts the residual stream: its attn_norm sees no residual.
        Site(prefix + "attn_norm", group, layer, ref("attn_norm"), hf("input_layernorm"), kind,
             "plain" if first else "fused", "rmsnorm", cfg.dim, cfg.eps, ("weight",)),
        Site(prefix + "ffn_norm", group, layer, ref("ffn_norm"), hf("post_attention_layernorm"), kind,
             "fused", "rmsnorm", cfg.dim, cfg.eps, ("weight",)),
    ]
    if cfg.q_lora_rank:
        out.append(Site(prefix + "q_norm", group, layer, ref("attn.q_norm"), hf("self_attn.q_a_layernorm"), kind,
                        "plain", "rmsnorm", cfg.q_lora_rank, REFERENCE_EPS, ("weight",)))
    # MLA: kv, k_pe = torch.split(wkv_a(x), [kv_lora_rank, qk_rope_head_dim], dim=-1); kv = kv_norm(kv).
    # The split returns views, not copies: kv_norm reads the latent in place, its rows as far apart as
    # wkv_a's output rows (kv_lora_rank + qk_rope_head_dim elements).
    kv_out = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    kv_slice = InputSlice(
        ref("attn.wkv_a"), hf("self_attn.kv_a_proj_with_mqa"), kv_out, 0, cfg.kv_lora_rank,
        f"the first {cfg.kv_lora_rank:,} of the {kv_out:,} columns of wkv_a(x) (Hugging Face: kv_a_proj_with_mqa; "
        f"kv_lora_rank {cfg.kv_lora_rank:,} + qk_rope_head_dim {cfg.qk_rope_head_dim:,}, the last "
        f"{cfg.qk_rope_head_dim:,} being k_pe, the shared rotary key): torch.split's strided view, "
        f"rows {kv_out:,} elements apart, not copied",
    )
    out.append(Site(prefix + "kv_norm", group, layer, ref("attn.kv_norm"), hf("self_attn.kv_a_layernorm"), kind,
                    "plain", "rmsnorm", cfg.kv_lora_rank, REFERENCE_EPS, ("weight",), kv_slice))
    if cfg.index_head_dim:
        out.append(Site(prefix + "k_norm", group, layer, ref("attn.indexer.k_norm"), hf("self_attn.indexer.k_norm"),
                        kind, "plain", "layernorm", cfg.index_head_dim, REFERENCE_EPS, ("weight", "bias")))
    return out


def enumerate_sites(cfg: ModelConfig, *, mtp: bool = True) -> list[Site]:
    """Every norm instance of the model described by ``cfg``, in forward order.

    Args:
        cfg: a :class:`ModelConfig` (see :func:`load_config`).
        mtp: include the HF checkpoint's multi-token-prediction layers (group ``"mtp"``).

    Returns:
        list of :class:`Site`: per block ``attn_norm``, ``ffn_norm``, ``q_norm``, ``kv_norm`` and the
        indexer's LayerNorm ``k_norm``, then the final ``norm``, then the MTP layers' sites.
    """
    sites = []
    for layer in range(cfg.n_layers):
        sites.extend(_block_sites(cfg, layer, "main"))
    # The final norm adds the last block's FFN output to the residual before normalising.
    sites.append(Site("norm", "main", None, "norm", "model.norm", None, "fused", "rmsnorm", cfg.dim, cfg.eps, ("weight",)))
    if mtp:
        for j in range(cfg.n_mtp_layers):
            layer = cfg.n_layers + j
            hf = f"model.layers.{layer}."
            sites.append(Site("mtp.enorm", "mtp", layer, None, hf + "enorm", None, "plain", "rmsnorm",
                              cfg.dim, cfg.eps, ("weight",)))
            sites.append(Site("mtp.hnorm", "mtp", layer, None, hf + "hnorm", None, "plain", "rmsnorm",
                              cfg.dim, cfg.eps, ("weight",)))
            sites.extend(_block_sites(cfg, layer, "mtp"))
            sites.append(Site("mtp.shared_head.norm", "mtp", layer, None, hf + "shared_head.norm", None, "plain",
                              "rmsnorm", cfg.dim, cfg.eps, ("weight",)))
    return sites


@dataclass(frozen=True)
class SiteSummary:
    """All instances of one site key: counts per block kind and parameter totals."""

    key: str
    group: str
    norm_type: str
    ref_path: Optional[str]
    hf_path: str
    width: int
    per_instance: int
    instances: int
    dense: int
    moe: int
    plain: int
    fused: int
    # As Site's: the paths in it are patterns (layers.{i}) when the row covers several layers.
    input_slice: Optional[InputSlice] = None

    @property
    def params(self) -> int:
        return self.per_instance * self.instances

    @property
    def input_row_stride(self) -> int:
        """As :attr:`Site.input_row_stride`: elements between consecutive rows of the input."""
        return _input_row_stride(self.width, self.input_slice)

    @property
    def form(self) -> str:
        if self.plain and self.fused:
            return f"fused ({self.plain} plain)"
        return "fused" if self.fused else "plain"

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "group": self.group, "norm_type": self.norm_type, "ref_path": self.ref_path,
            "hf_path": self.hf_path, "width": self.width, "params_per_instance": self.per_instance,
            "instances": self.instances, "dense_blocks": self.dense, "moe_blocks": self.moe,
            "plain_instances": self.plain, "fused_instances": self.fused, "params": self.params,
            "input_shape": ["B", "T", self.width], "output_shape": ["B", "T", self.width],
            **_input_keys(self.width, self.input_slice),
        }


def _pattern(path: Optional[str], layer: Optional[int]) -> Optional[str]:
    if path is None or layer is None:
        return path
    return re.sub(rf"\blayers\.{layer}\b", "layers.{i}", path, count=1)


def summarise(sites: Iterable[Site]) -> list[SiteSummary]:
    """Group ``sites`` by key (first-seen order) into :class:`SiteSummary` rows."""
    rows: dict = {}
    for s in sites:
        r = rows.get(s.key)
        if r is None:
            rows[s.key] = r = {
                "key": s.key, "group": s.group, "norm_type": s.norm_type, "ref_path": s.ref_path,
                "hf_path": s.hf_path, "width": s.width, "per_instance": s.params, "layer": s.layer,
                "instances": 0, "dense": 0, "moe": 0, "plain": 0, "fused": 0, "input_slice": s.input_slice,
            }
        r["instances"] += 1
        if s.block is not None:
            r[s.block] += 1
        r[s.form] += 1
        if r["layer"] != s.layer:
            # Several layers: show the path with the layer index as a placeholder.
            r["ref_path"] = _pattern(r["ref_path"], r["layer"])
            r["hf_path"] = _pattern(r["hf_path"], r["layer"])
            if r["input_slice"] is not None:
                sl = r["input_slice"]
                r["input_slice"] = replace(sl, module_ref_path=_pattern(sl.module_ref_path, r["layer"]),
                                           module_hf_path=_pattern(sl.module_hf_path, r["layer"]))
            r["layer"] = s.layer
    for r in rows.values():
        del r["layer"]
    return [SiteSummary(**r) for r in rows.values()]


def totals(cfg: ModelConfig, sites: Optional[Sequence[Site]] = None) -> dict[str, Any]:
    """Main-model RMSNorm totals: instances, parameters and the formula they follow.

    ``params = n_layers * (sum of the per-block RMSNorm widths) + dim`` (the final norm); the indexer
    LayerNorm and the MTP layers are reported apart (``layernorm_*``, ``mtp_*``).
    """
    sites = enumerate_sites(cfg) if sites is None else sites
    main = [s for s in sites if s.group == "main" and s.norm_type == "rmsnorm"]
    block_widths = [s.width for s in main if s.layer == 0]
    mtp = [s for s in sites if s.group == "mtp"]
    ln = [s for s in sites if s.group == "main" and s.norm_type == "layernorm"]
    params = sum(s.params for s in main)
    widths = " + ".join(f"{w:,}" for w in block_widths)
    return {
        "instances": len(main),
        "params": params,
        "formula": f"{cfg.n_layers} × ({widths}) + {cfg.dim:,} = {params:,}",
        "blocks": cfg.n_layers,
        "dense_blocks": sum(1 for i in range(cfg.n_layers) if cfg.block_kind(i) == "dense"),
        "moe_blocks": sum(1 for i in range(cfg.n_layers) if cfg.block_kind(i) == "moe"),
        "layernorm_instances": len(ln),
        "layernorm_params": sum(s.params for s in ln),
        "mtp_layers": cfg.n_mtp_layers,
        "mtp_rmsnorm_instances": sum(1 for s in mtp if s.norm_type == "rmsnorm"),
        "mtp_rmsnorm_params": sum(s.params for s in mtp if s.norm_type == "rmsnorm"),
    }


def catalog(cfg: ModelConfig) -> dict[str, Any]:
    """The whole catalogue as plain data: config, every instance, per-site rows and totals (JSON-ready)."""
    sites = enumerate_sites(cfg)
    return {
        "config": cfg.to_dict(),
        "summary": [r.to_dict() for r in summarise(sites)],
        "totals": totals(cfg, sites),
        "sites": [s.to_dict() for s in sites],
    }


# ---------------------------------------------------------------------------------------------------
# Text rendering

_TITLES = {
    "attn_norm": "Attention-input RMSNorm",
    "ffn_norm": "FFN-input RMSNorm",
    "q_norm": "Query latent RMSNorm",
    "kv_norm": "Key-value latent RMSNorm",
    "norm": "Final RMSNorm",
    "k_norm": "Indexer key LayerNorm (not an RMSNorm)",
    "mtp.enorm": "MTP embedding RMSNorm",
    "mtp.hnorm": "MTP hidden-state RMSNorm",
    "mtp.shared_head.norm": "MTP output RMSNorm",
}

_WHERE = {
    "attn_norm": (
        "Start of every block, before MLA (model.py 826-851). Block 0 normalises the embedding with no "
        "residual (plain); blocks 1 and up first add the previous block's FFN output to the residual "
        "stream in float32 and return that sum as the new residual (fused)."
    ),
    "ffn_norm": (
        "After MLA in every block: adds the attention output to the residual stream, normalises, and "
        "feeds the dense MLP (first n_dense_layers blocks) or the MoE (the rest) (model.py 826-851)."
    ),
    "q_norm": (
        "Inside MLA in every block (dense and MoE): qr = q_norm(wq_a(x)) compresses the query to the "
        "latent, normalises it, then wq_b expands it to the heads; the indexer reads the same qr "
        "(model.py 523-539, 560-564)."
    ),
    "kv_norm": (
        "Inside MLA in every block: kv, k_pe = torch.split(wkv_a(x), [kv_lora_rank, qk_rope_head_dim], "
        "dim=-1) splits wkv_a's output into the key-value latent and the shared rotary key; the latent "
        "is normalised as the strided view the split returns (the first kv_lora_rank columns of each "
        "row, rows kv_lora_rank + qk_rope_head_dim elements apart, not copied), then cached (kv_cache) "
        "before wkv_b (model.py 523-539). Hugging Face does the same to kv_a_proj_with_mqa's output."
    ),
    "norm": (
        "After the last block: adds its FFN output to the residual stream, normalises, and the untied "
        "head projects to the vocabulary; the reference generator keeps only the last position "
        "(model.py 880-908)."
    ),
    "k_norm": (
        "Inside every MLA's indexer: k = k_norm(wk(x)), a LayerNorm with weight and bias in float32 "
        "(F.layer_norm), named here for completeness and not counted as an RMSNorm."
    ),
}


def _fmt(n: int) -> str:
    return f"{n:,}"


def _in_width(width: int, row_stride: int) -> str:
    """The last axis of a norm input: ``512``, or ``512 of 576`` for a strided slice (the README's notation)."""
    return f"{width}" if row_stride == width else f"{width} of {row_stride}"


def _table(headers: list, rows: list, markdown: bool) -> list:
    if markdown:
        out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        return out
    return text_table(headers, rows)


def _prose(text: str, markdown: bool, hanging: str = "") -> list:
    """A paragraph: one line in Markdown (a renderer wraps it), wrapped to ``COLUMNS`` in text, its
    lines after the first indented by ``hanging``."""
    return [text] if markdown else wrap(text, subsequent=hanging)


def render_table(cfg: ModelConfig, markdown: bool = False, wide: bool = False) -> str:
    """The sites table with per-instance parameters, instance counts and totals, as text or Markdown.

    Plain text fits ``terminal.COLUMNS`` characters a line: each site's module path in the naming of
    the config's fields (Hugging Face for a Hugging Face config, else the reference's) and its input
    width. ``wide`` (and Markdown) keep every column: both paths, the input and output shapes, the
    dense / MoE instance counts.
    """
    sites = enumerate_sites(cfg)
    rows = summarise(sites)
    t = totals(cfg, sites)
    shape = lambda w: f"[B, T, {w}]"  # noqa: E731
    full = wide or markdown
    hf_names = cfg.format == "huggingface"
    if full:
        headers = ["site", "reference path", "Hugging Face path", "form", "width", "in -> out",
                   "params/inst", "dense", "MoE", "instances", "params"]
    else:
        headers = ["site", "Hugging Face path" if hf_names else "reference path", "form", "input width",
                   "per inst.", "instances", "params"]

    def cells(r: SiteSummary) -> list:
        in_block = r.dense + r.moe > 0
        form = r.form + (" LayerNorm" if r.norm_type == "layernorm" else "")
        if not full:
            # The MTP layer has no reference module: its rows show the Hugging Face path.
            path = r.hf_path if hf_names or not r.ref_path else r.ref_path
            return [r.key, path, "LayerNorm" if r.norm_type == "layernorm" else r.form,
                    _in_width(r.width, r.input_row_stride), _fmt(r.per_instance), r.instances, _fmt(r.params)]
        # A strided input shows as "[B, T, 512 of 576]" (rows 576 apart); the note under the header explains it.
        return [r.key, r.ref_path or "-", r.hf_path, form, r.width,
                f"{shape(_in_width(r.width, r.input_row_stride))} -> {shape(r.width)}",
                _fmt(r.per_instance), r.dense if in_block else "-", r.moe if in_block else "-",
                r.instances, _fmt(r.params)]

    # One sentence for the strided input (kv_norm; the MTP block's copy of it reads the same slice).
    strided_note = ""
    for r in rows:
        if r.input_slice is not None and r.input_row_stride != r.width:
            strided_note = (f" Rows are contiguous (row stride = width) but {r.key}'s: its input "
                            f"[B, T, {_in_width(r.width, r.input_row_stride)}] is {r.input_slice.description}.")
            break

    h1 = "## " if markdown else ""
    out = _prose(f"{h1}DeepSeek-V3.2-Exp RMSNorm sites (config: {cfg.source}, {cfg.format} names)", markdown)
    out.append("")
    out += _prose(
        f"dim {cfg.dim:,}; {t['blocks']} blocks ({t['dense_blocks']} dense, {t['moe_blocks']} MoE); "
        f"q_lora_rank {cfg.q_lora_rank:,}; kv_lora_rank {cfg.kv_lora_rank:,}; "
        f"qk_rope_head_dim {cfg.qk_rope_head_dim:,}; eps {cfg.eps:g}. "
        "Shapes: B batch, T positions (decode: T = 1); a fused norm also takes and returns the residual "
        "stream in the same shape." + ("" if full else " The output is [B, T, width], contiguous.")
        + strided_note
        + ("" if full else " (--wide: both namings, the shapes and the dense / MoE counts.)"), markdown)
    out.append("")
    main = [r for r in rows if r.group == "main" and r.norm_type == "rmsnorm"]
    out += _table(headers, [cells(r) for r in main], markdown)
    out += [""]
    q = next((r for r in main if r.key == "q_norm"), None)
    final = next(r for r in main if r.key == "norm")
    out.append(f"{h1}Totals" if markdown else "Totals")
    bullet = "- " if markdown else "  "
    item = lambda text: _prose(bullet + text, markdown, "    ")  # noqa: E731
    out += item(f"final norm: {_fmt(final.params)}")
    if q is not None:
        parts = []
        if q.moe:
            parts.append(f"× {q.moe} MoE blocks = {_fmt(q.per_instance * q.moe)}")
        if q.dense:
            parts.append(f"× {q.dense} dense blocks = {_fmt(q.per_instance * q.dense)}")
        parts.append(f"× {q.instances} blocks = {_fmt(q.params)}")
        out += item(f"query-latent norm (q_norm): {_fmt(q.per_instance)} per instance; " + "; ".join(parts))
    out += item(f"all main-model RMSNorm parameters: {t['formula']} in {t['instances']} instances")
    ln = [r for r in rows if r.group == "main" and r.norm_type == "layernorm"]
    for r in ln:
        out += item(
            f"not counted above: indexer {r.key} ({r.ref_path} / {r.hf_path}) is a LayerNorm "
            f"(weight + bias): {r.instances} × 2 × {r.width:,} = {_fmt(r.params)} parameters"
        )
    mtp = [r for r in rows if r.group == "mtp"]
    if mtp:
        note = "" if cfg.mtp_stated else " (not stated by a reference config; the V3.2-Exp HF release has 1)"
        out += [""] + _prose(f"{h1}Multi-token-prediction layer{'s' if cfg.n_mtp_layers > 1 else ''} of the Hugging "
                             f"Face checkpoint: model.layers.{cfg.n_layers}{'' if cfg.n_mtp_layers == 1 else '...'}"
                             f"{note}; no reference module (not in the main totals)", markdown) + [""]
        mtp_headers = headers if full else [headers[0], "Hugging Face path"] + headers[2:]
        out += _table(mtp_headers, [cells(r) for r in mtp], markdown)
        out += [""] + item(f"MTP RMSNorm: {t['mtp_rmsnorm_instances']} instances, {_fmt(t['mtp_rmsnorm_params'])} parameters"
                           + ("; plus the MTP block's indexer LayerNorm" if any(r.norm_type == "layernorm" for r in mtp) else ""))
    return "\n".join(out) + "\n"


_ALIASES = {
    "q_a_layernorm": "q_norm", "kv_a_layernorm": "kv_norm", "final": "norm", "final_norm": "norm",
    "model.norm": "norm", "indexer.k_norm": "k_norm", "enorm": "mtp.enorm", "hnorm": "mtp.hnorm",
    "shared_head.norm": "mtp.shared_head.norm",
}
# Every block norm's module path below the block, in both namings (input_layernorm, attn.q_norm,
# self_attn.kv_a_layernorm, attn.indexer.k_norm, ...).
_ALIASES.update({suffix: key for key, ref, hf in _BLOCK_NORMS for suffix in (ref, hf) if suffix != key})


def resolve_site(name: str, cfg: ModelConfig) -> str:
    """The canonical site key for ``name``: a key, an HF module name, or a full module path of either naming."""
    keys = [r.key for r in summarise(enumerate_sites(cfg))]
    if name in keys:
        return name
    if name in _ALIASES and _ALIASES[name] in keys:
        return _ALIASES[name]
    for s in enumerate_sites(cfg):
        if name in (s.ref_path, s.hf_path) or name in (_pattern(s.ref_path, s.layer), _pattern(s.hf_path, s.layer)):
            return s.key
    raise ValueError(f"unknown site {name!r}; known sites: {', '.join(keys)}")


def render_page(cfg: ModelConfig, key: str, markdown: bool = False) -> str:
    """One site's page: formula, in/out shapes, per-instance accounting and where it sits in the block.

    Args:
        cfg: the model config.
        key: a canonical site key or alias (see :func:`resolve_site`).
    """
    key = resolve_site(key, cfg)
    sites = [s for s in enumerate_sites(cfg) if s.key == key]
    r = summarise(sites)[0]
    s0 = sites[0]
    w = r.width
    h = "## " if markdown else ""
    fence = ["```"] if markdown else []
    out = [f"{'# ' if markdown else ''}DeepSeek-V3.2-Exp · {_TITLES.get(key, key)}", ""]
    out.append(f"site: {key}    reference: {r.ref_path or '- (no reference module: HF checkpoint only)'}    "
               f"Hugging Face: {r.hf_path}")
    out.append("")
    out.append(f"{h}Formula")
    out += fence
    if r.norm_type == "layernorm":
        out += [f"mu(x)   = (1/d) Σ_j x_j                         d = {w:,}",
                "var(x)  = (1/d) Σ_j (x_j - mu(x))²",
                f"y       = γ ⊙ (x - mu(x)) / sqrt(var(x) + ε) + β   ε = {s0.eps:g}",
                "computed in float32 (F.layer_norm of x.float()), cast back to x.dtype"]
    else:
        if r.fused:
            out += ["s       = x + residual                       (float32, unrounded)"]
        v = "s" if r.fused else "x"
        out += [f"m2({v})   = (1/d) Σ_j {v}_j²                      d = {w:,}",
                f"y       = γ ⊙ {v} / sqrt(m2({v}) + ε)            ε = {s0.eps:g}"]
        if r.fused:
            out += ["residual_out = s.to(x.dtype)"]
        out += ["normalised in float32, multiplied by the float32 gain γ in float32, cast once to x.dtype "
                "(model.py 280-306)"]
        if r.fused and r.plain:
            out += [f"({r.plain} instance{'s see' if r.plain > 1 else ' sees'} no residual: "
                    f"y = γ ⊙ x / sqrt(m2(x) + ε))"]
    out += fence
    out += ["", f"{h}Shapes"]
    out.append(f"in:  x [B batch, T positions, {w:,}]" + (" + residual [B, T, " + f"{w:,}]" if r.fused else ""))
    out.append(f"out: y [B batch, T positions, {w:,}]" + (" + residual [B, T, " + f"{w:,}]" if r.fused else ""))
    stride = r.input_row_stride
    if r.input_slice is not None and stride != w:
        out.append(f"x (row stride {stride:,}): {r.input_slice.description}. y is contiguous.")
    else:
        out.append(f"x and y contiguous (row stride {w:,})")
    out.append(f"decode (one position): [B, 1, {w:,}" + (f" of {stride:,}" if stride != w else "") + "]")
    out += ["", f"{h}Parameters", f"{_fmt(r.per_instance)} parameters per instance.", ""]
    rows = [["Learned gain γ", _fmt(w), _fmt(w)]]
    if r.norm_type == "layernorm":
        rows.append(["Learned bias β", _fmt(w), _fmt(w)])
    rows.append(["Per-instance total", "", _fmt(r.per_instance)])
    if r.dense and r.moe:
        rows.append([f"× {r.dense} dense blocks", f"{r.dense} × {_fmt(r.per_instance)}", _fmt(r.dense * r.per_instance)])
        rows.append([f"× {r.moe} MoE blocks", f"{r.moe} × {_fmt(r.per_instance)}", _fmt(r.moe * r.per_instance)])
    if r.instances > 1 or r.dense or r.moe:
        what = "blocks" if (r.dense or r.moe) else "instances"
        if r.group == "mtp":
            what = "MTP layers"
        rows.append([f"× {r.instances} {what}", f"{r.instances} × {_fmt(r.per_instance)}", _fmt(r.params)])
    out += _table(["Component", "Calculation", "Parameters"], rows, markdown)
    out.append("")
    out.append(f"Each instance owns its gain vector{' and bias' if r.norm_type == 'layernorm' else ''}; counted from the config "
               "(check a checkpoint with `dsnorm count PATH`).")
    out += ["", f"{h}Where it sits"]
    if key in _WHERE:
        out.append(_WHERE[key])
    elif key.startswith("mtp."):
        base = key[4:]
        out.append(
            f"Multi-token-prediction layer model.layers.{cfg.n_layers} of the Hugging Face checkpoint "
            "(DeepSeek-V3 MTP module: enorm normalises the next token's embedding, hnorm the main model's "
            "last hidden state, eh_proj joins them, one transformer block follows, shared_head.norm "
            "precedes the shared output head). No module in the reference inference code; the reference "
            "conversion drops it." + (f" Within the MTP block: {_WHERE[base]}" if base in _WHERE else "")
        )
    out.append("")
    out.append(f"Source: deepseek-ai/DeepSeek-V3.2-Exp inference/model.py @ {REFERENCE_REVISION}; "
               f"config: {cfg.source}.")
    if not markdown:  # prose wrapped to the terminal; the formula and the table are narrower already
        out = [piece for line in out for piece in (wrap(line) if len(line) > COLUMNS else [line])]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------
# CLI: dsnorm sites


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``dsnorm sites``."""
    parser.add_argument("--config", metavar="FILE",
                        help="model config (reference or Hugging Face field names), or a model directory "
                             "holding config.json; default: built-in 671B V3.2-Exp")
    parser.add_argument("--markdown", action="store_true", help="print Markdown instead of plain text (every column)")
    parser.add_argument("--wide", action="store_true",
                        help="every column (both namings, shapes, dense / MoE counts), wider than 120 characters")
    parser.add_argument("--json", metavar="FILE", help="also write the full catalogue as JSON ('-': stdout only)")
    parser.add_argument("--site", metavar="NAME", help="print one site's page (e.g. q_norm, kv_a_layernorm, norm)")


def run(args: argparse.Namespace) -> int:
    """Run ``dsnorm sites``; returns the exit status (2 on a bad config or site name)."""
    inputs = [("--config", config_file(args.config)), ("built-in config", default_config_path())]
    if json_path_refused("sites", args.json, inputs):
        return 2
    try:
        cfg = load_config(args.config)
        text = render_page(cfg, args.site, args.markdown) if args.site else render_table(cfg, args.markdown, args.wide)
    except (ValueError, TypeError) as e:
        print(f"dsnorm sites: error: {e}", file=sys.stderr)
        return 2
    if args.json == "-":
        json.dump(catalog(cfg), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    sys.stdout.write(text)
    if args.json:
        if not write_output("sites", args.json, args.json, json.dumps(catalog(cfg), indent=1) + "\n"):
            return 2
    return 0

"""Count and load the norm tensors of a safetensors checkpoint, reading only what is needed.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data
section that follows the header; an optional ``"__metadata__"`` maps strings to strings), then the
data. :func:`read_header` parses that header with the standard library, capped and validated, and
never reads tensor data.

* :func:`count_norms` / ``dsnorm count PATH``: every norm tensor of a checkpoint (a ``.safetensors``
  file, a directory of shards, or a ``model.safetensors.index.json``), in the Hugging Face or the
  reference naming, compared with the sites a model config expects (:mod:`dsnorm.sites`).
* :func:`load_norms`: copies the norm gains of a checkpoint into the ``dsnorm.RMSNorm`` modules of a
  model (bf16/fp16 stored values become exact fp32 parameters), all or nothing.

Untrusted input: header lengths, JSON, dtypes, shapes and offsets are checked against the file
before anything is believed; every problem is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import struct
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

from torch import nn  # loaded already (dsnorm/__init__ imports torch); load_norms' annotation names it

from dsnorm.output_files import json_path_refused, write_output
from dsnorm.sites import (
    HF_SUFFIX,
    REF_SUFFIX,
    ModelConfig,
    config_file,
    default_config_path,
    enumerate_sites,
    load_config,
    read_json_file,
)
from dsnorm.terminal import table, wrap

# Real shards of the 671B checkpoint have headers well under 1 MB; this cap (as in the safetensors
# library) bounds the memory a hostile length can claim.
MAX_HEADER_BYTES = 100 * 1000 * 1000
MAX_INDEX_BYTES = 100 * 1000 * 1000
# Size in bits of one element of each safetensors dtype.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
}
# Norm gains are stored as floats, and load_norms reads each of them: 16-bit and F32 values widen
# exactly to a float32 parameter, F64 ones load when every value is exactly a float32.
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
LOADABLE_DTYPES = FLOAT_DTYPES
# Missing model-parallel ranks listed one by one; more are counted in one line.
MAX_LISTED_SHARDS = 64
MP_SHARD = re.compile(r"^model(\d+)-mp(\d+)\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted or read; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor entry of a safetensors header; ``begin``/``end`` are absolute byte offsets in ``file``."""

    name: str
    dtype: str
    shape: tuple
    begin: int
    end: int
    file: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # below 2**64 at every step: read_header checked it


@dataclass
class SafetensorsHeader:
    """The parsed, validated header of one safetensors file."""

    path: str
    file_size: int
    header_len: int
    tensors: dict
    metadata: dict

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def _no_duplicates(pairs: list) -> dict:
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _u64_numel(shape: list) -> Optional[int]:
    """``prod(shape)`` as the safetensors library computes it: dims and the running product in
    order, each below 2**64, else ``None`` (overflow). So a product stays small: a hostile shape of
    a million dims costs no million-digit number (nor a message that cannot print one)."""
    numel = 1
    for d in shape:
        numel *= d
        if d >= 2**64 or numel >= 2**64:
            return None
    return numel


def _shape_text(shape: list) -> str:
    return str(shape) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:4]))}, ...] ({len(shape):,} dims)"


def read_header(path: Union[str, os.PathLike[str]], max_header_bytes: int = MAX_HEADER_BYTES) -> SafetensorsHeader:
    """Parse and validate the header of a safetensors file without reading any tensor data.

    Args:
        path: the ``.safetensors`` file.
        max_header_bytes: refuse a header longer than this (memory bound against hostile files).

    Returns:
        :class:`SafetensorsHeader` whose ``tensors`` map each name to a :class:`TensorInfo`.

    Raises:
        CheckpointError: unreadable file, header length over the cap or past the end of the file,
            invalid UTF-8/JSON, malformed entries, an unknown dtype, a size that does not match the
            shape, or offsets that do not tile the data section exactly (out of range, overlapping,
            a gap, trailing bytes, a truncated file), as the safetensors library refuses them.
    """
    path = os.fspath(path)

    def fail(msg: str) -> CheckpointError:
        return CheckpointError(f"{path}: {msg}")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise fail(f"file is {size} bytes, too short for a safetensors header length")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > max_header_bytes:
                raise fail(f"header length {n:,} bytes exceeds the {max_header_bytes:,}-byte cap (not a safetensors file?)")
            if 8 + n > size:
                raise fail(f"header length {n:,} bytes runs past the end of the {size:,}-byte file (truncated or not safetensors)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(raw) != n:
        raise fail(f"header ended after {len(raw):,} of {n:,} bytes (file changed while reading?)")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise fail(f"header is not valid UTF-8: {e}") from None
    except RecursionError:
        raise fail("header JSON is nested too deeply") from None
    except ValueError as e:
        raise fail(f"header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise fail(f"header JSON is a {type(obj).__name__}, not an object")
    # The rules below are the safetensors library's own (0.8), so that a file it refuses, and with
    # it transformers and the reference's loader, is not reported as a good checkpoint here.
    metadata = obj.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise fail("__metadata__ is not an object of strings")
    data_size = size - 8 - n
    tensors = {}
    spans = []
    for name, entry in obj.items():
        if not isinstance(entry, dict):
            raise fail(f"tensor {name!r}: entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str):
            raise fail(f"tensor {name!r}: dtype missing or not a string")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise fail(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise fail(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
        begin, end = offsets
        if end > data_size:
            raise fail(
                f"tensor {name!r}: data_offsets [{begin}, {end}] run past the {data_size:,}-byte data section "
                "(file truncated?)"
            )
        bits = DTYPE_BITS.get(dtype)
        if bits is None:
            raise fail(f"tensor {name!r}: unknown dtype {dtype!r} (safetensors knows {', '.join(DTYPE_BITS)})")
        numel = _u64_numel(shape)
        if numel is None:
            raise fail(f"tensor {name!r}: {dtype} {_shape_text(shape)}: its element count overflows 64 bits "
                       f"(not a valid safetensors file)")
        if numel * bits % 8:
            raise fail(f"tensor {name!r}: {dtype} {_shape_text(shape)} does not end on a byte boundary "
                       f"({numel:,} x {bits} bits; not a valid safetensors file)")
        need = numel * bits // 8
        if end - begin != need:
            raise fail(f"tensor {name!r}: {dtype} {_shape_text(shape)} needs {need:,} bytes, "
                       f"data_offsets give {end - begin:,}")
        tensors[name] = TensorInfo(name, dtype, tuple(shape), 8 + n + begin, 8 + n + end, path)
        spans.append((begin, end, name))
    # The tensors tile the data section: each begins where the one before ends (an empty one
    # anywhere on that boundary), with no gap, overlap or trailing bytes.
    spans.sort()
    covered, last = 0, None
    for begin, end, name in spans:
        if begin != covered:
            what = f"overlaps {last!r}" if begin < covered else f"leaves a gap of {begin - covered:,} bytes before it"
            raise fail(f"tensor {name!r}: data_offsets [{begin}, {end}] {what} (not a valid safetensors file)")
        covered, last = end, name
    if covered != data_size:
        raise fail(f"the tensors cover {covered:,} of the {data_size:,}-byte data section; the rest belongs to "
                   f"no tensor (not a valid safetensors file)")
    return SafetensorsHeader(path, size, n, tensors, metadata)


# ---------------------------------------------------------------------------------------------------
# Which files make up a checkpoint


@dataclass
class CheckpointFiles:
    """The shard files of a checkpoint and how they relate.

    Attributes:
        path: what the user named.
        root: the directory of the checkpoint (where ``config.json`` is looked for).
        files: shard paths, model-parallel shards ordered by rank.
        layout: ``"file"``, ``"directory"``, ``"index"`` or ``"model-parallel"``.
        weight_map: tensor name -> shard path, from the index file (``None`` without one).
        mp_size: ``N`` of ``model{i}-mp{N}.safetensors`` shards (``None`` otherwise).
        problems: layout problems found (a model-parallel rank missing), as mismatch dicts.
    """

    path: str
    root: str
    files: list
    layout: str
    weight_map: Optional[dict] = None
    mp_size: Optional[int] = None
    problems: list = field(default_factory=list)


def _read_index(index_path: str) -> dict:
    obj = read_json_file(index_path, "safetensors index", MAX_INDEX_BYTES)
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict):
        raise CheckpointError(f"{index_path}: index has no 'weight_map' object")
    root = os.path.dirname(os.path.abspath(index_path))
    out = {}
    for name, fname in wm.items():
        if not isinstance(fname, str) or not fname:
            raise CheckpointError(f"{index_path}: weight_map[{name!r}] is not a file name")
        # The index is untrusted: it may only name files inside its own directory.
        if os.path.isabs(fname) or ".." in fname.replace("\\", "/").split("/"):
            raise CheckpointError(f"{index_path}: weight_map[{name!r}] = {fname!r} points outside the checkpoint directory")
        out[name] = os.path.normpath(os.path.join(root, fname))  # "x" and "./x" are one shard
    missing = sorted({f for f in out.values() if not os.path.isfile(f)})
    if missing:
        raise CheckpointError(f"{index_path}: index names shard file(s) that do not exist: {', '.join(missing)}")
    return out


def resolve_checkpoint(path: Union[str, os.PathLike[str]]) -> CheckpointFiles:
    """Find the shard files of ``path``: a ``.safetensors`` file, a shard directory or an index JSON.

    A directory with one ``*.safetensors.index.json`` is read through that index; otherwise all of its
    ``*.safetensors`` files are shards. Files named ``model{i}-mp{N}.safetensors`` (the reference
    conversion) are model-parallel replicas of the norms, ordered by rank.

    Raises:
        CheckpointError: the path does not exist, holds no shards, or its index is invalid.
    """
    path = os.fspath(path)
    weight_map = None
    if os.path.isdir(path):
        root = os.path.abspath(path)
        names = sorted(os.listdir(path))
        indexes = [n for n in names if n.endswith(".safetensors.index.json")]
        if len(indexes) > 1 and "model.safetensors.index.json" in indexes:
            indexes = ["model.safetensors.index.json"]
        if len(indexes) > 1:
            raise CheckpointError(f"{path}: several index files ({', '.join(indexes)}); name one of them")
        if indexes:
            weight_map = _read_index(os.path.join(path, indexes[0]))
            files, layout = sorted(set(weight_map.values())), "index"
        else:
            files = [os.path.join(path, n) for n in names if n.endswith(".safetensors") and os.path.isfile(os.path.join(path, n))]
            layout = "directory"
            if not files:
                raise CheckpointError(f"{path}: directory holds no .safetensors files")
    elif os.path.isfile(path):
        root = os.path.dirname(os.path.abspath(path))
        if path.endswith(".json"):
            weight_map = _read_index(path)
            files, layout = sorted(set(weight_map.values())), "index"
        else:
            files, layout = [path], "file"
    else:
        raise CheckpointError(f"{path}: no such file or directory")
    result = CheckpointFiles(path, root, files, layout, weight_map)
    mp = [MP_SHARD.match(os.path.basename(f)) for f in files]
    if files and all(mp):
        sizes = {int(m.group(2)) for m in mp}
        ranks = sorted(int(m.group(1)) for m in mp)
        if len(sizes) != 1:
            raise CheckpointError(f"{path}: model-parallel shards disagree on the world size: mp{sorted(sizes)}")
        (n,) = sizes
        result.layout, result.mp_size = "model-parallel", n
        result.files = [f for _, f in sorted(zip((int(m.group(1)) for m in mp), files))]
        # n comes from a file name: never build range(n) (model0-mp1000000000000.safetensors).
        present = {r for r in ranks if r < n}
        missing = (r for r in range(n) if r not in present)
        for r in itertools.islice(missing, MAX_LISTED_SHARDS):
            result.problems.append({"kind": "missing_shard", "tensor": None, "site": None,
                                    "detail": f"model-parallel shard model{r}-mp{n}.safetensors is missing"})
        more = n - len(present) - MAX_LISTED_SHARDS
        if more > 0:
            result.problems.append({"kind": "missing_shard", "tensor": None, "site": None,
                                    "detail": f"and {more:,} more of the {n:,} model-parallel shards are missing "
                                              f"({len(present):,} present)"})
        for r in sorted(set(ranks) - present):
            result.problems.append({"kind": "extra_shard", "tensor": None, "site": None,
                                    "detail": f"shard model{r}-mp{n}.safetensors has a rank outside 0..{n - 1}"})
    return result


# ---------------------------------------------------------------------------------------------------
# Norm tensor names in either naming

_HF_LAYER = re.compile(
    r"^model\.layers\.(\d+)\.(" + "|".join(re.escape(s) for s in (*HF_SUFFIX.values(), "enorm", "hnorm", "shared_head.norm"))
    + r")\.(weight|bias)$"
)
_REF_LAYER = re.compile(r"^layers\.(\d+)\.(" + "|".join(re.escape(s) for s in REF_SUFFIX.values()) + r")\.(weight|bias)$")
_HF_BASE = {v: k for k, v in HF_SUFFIX.items()} | {"enorm": "enorm", "hnorm": "hnorm", "shared_head.norm": "shared_head.norm"}
_REF_BASE = {v: k for k, v in REF_SUFFIX.items()}


def classify(name: str) -> Optional[tuple]:
    """``(naming, base_key, layer, param)`` for a known norm tensor name, else ``None``.

    ``naming`` is ``"huggingface"`` or ``"reference"``; ``base_key`` is ``attn_norm``, ``ffn_norm``,
    ``q_norm``, ``kv_norm``, ``k_norm``, ``enorm``, ``hnorm``, ``shared_head.norm`` or ``norm``;
    ``layer`` is ``None`` for the final norm.
    """
    if name in ("model.norm.weight", "model.norm.bias"):
        return ("huggingface", "norm", None, name.rsplit(".", 1)[1])
    if name in ("norm.weight", "norm.bias"):
        return ("reference", "norm", None, name.rsplit(".", 1)[1])
    m = _HF_LAYER.match(name)
    if m:
        return ("huggingface", _HF_BASE[m.group(2)], int(m.group(1)), m.group(3))
    m = _REF_LAYER.match(name)
    if m:
        return ("reference", _REF_BASE[m.group(2)], int(m.group(1)), m.group(3))
    return None


def is_norm_like(name: str) -> bool:
    """Whether a tensor name looks like a normalisation parameter (a module name containing ``norm``)."""
    return any("norm" in part.lower() for part in name.split(".")[:-1])


def site_key(base_key: str, layer: Optional[int], cfg: ModelConfig) -> str:
    """The catalogue key (:mod:`dsnorm.sites`) of a norm at ``layer``: MTP layers get ``mtp.``."""
    if layer is not None and (layer >= cfg.n_layers or base_key in ("enorm", "hnorm", "shared_head.norm")):
        return "mtp." + base_key
    return base_key


def _expected(cfg: ModelConfig, naming: str) -> dict:
    """Expected norm tensor name -> (site, param, shape) for a checkpoint in ``naming``."""
    out = {}
    for s in enumerate_sites(cfg, mtp=naming == "huggingface"):
        path = s.hf_path if naming == "huggingface" else s.ref_path
        for t in s.tensors:
            out[f"{path}.{t}"] = (s, t, (s.width,))
    return out


# ---------------------------------------------------------------------------------------------------
# Counting


@dataclass
class CountReport:
    """What :func:`count_norms` found: per-site rows, mismatches, and whether the checkpoint matches."""

    path: str
    layout: str
    files: list
    mp_size: Optional[int]
    naming: str
    config: ModelConfig
    config_source: str
    sites: list
    mismatches: list
    totals: dict
    notes: list

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict:
        return {
            "path": self.path, "ok": self.ok, "layout": self.layout, "files": self.files,
            "model_parallel": self.mp_size, "naming": self.naming, "config_source": self.config_source,
            "config": self.config.to_dict(), "sites": self.sites, "totals": self.totals,
            "mismatches": self.mismatches, "notes": self.notes,
        }


def _config_for(files: CheckpointFiles, config: Union[None, str, os.PathLike[str], ModelConfig]) -> tuple:
    # A config the caller names wins (it may correct the one saved beside the checkpoint, e.g. a
    # save_pretrained directory whose config states MTP layers its weights do not hold); a path
    # that does not load is an error, never skipped.
    beside = os.path.join(files.root, "config.json")
    notes = []
    if config is not None:
        cfg = config if isinstance(config, ModelConfig) else load_config(config)
        if os.path.isfile(beside):
            notes.append(f"expectation from {cfg.source}, not the config.json beside the checkpoint")
        return cfg, cfg.source, notes
    if os.path.isfile(beside):
        return load_config(beside), beside, notes
    cfg = load_config(None)
    return cfg, cfg.source, notes


def _realpath_cache():
    """``os.path.realpath`` remembered per path string (~10 µs a call; an index lists ~100k tensors
    in a few dozen files)."""
    real: dict = {}

    def realpath(path: str) -> str:
        if path not in real:
            real[path] = os.path.realpath(path)
        return real[path]

    return realpath


def _chosen_copy(infos: list, files: CheckpointFiles, realpath) -> TensorInfo:
    """The copy of a tensor stored in several files that counts (``count_norms`` checks it,
    ``load_norms`` loads it): the one in the shard the index names, the checkpoint's own statement of
    where it lives; else the first in file order (rank 0's for model-parallel replicas, whose
    files are ordered by rank; also a tensor missing from its listed shard)."""
    listed = files.weight_map.get(infos[0].name) if files.weight_map and len(infos) > 1 else None
    if listed is not None:
        want = realpath(listed)
        for info in infos:
            if realpath(info.file) == want:
                return info
    return infos[0]


def count_norms(path: Union[str, os.PathLike[str]], config: Union[None, str, os.PathLike[str], ModelConfig] = None) -> CountReport:
    """Count every norm tensor of a checkpoint from its headers and compare with a config's expectation.

    Args:
        path: a ``.safetensors`` file, a directory of shards, or a ``*.safetensors.index.json``.
        config: the expectation: a config file path or :class:`~dsnorm.sites.ModelConfig`; ``None``
            uses the ``config.json`` beside the checkpoint, else the built-in 671B config.

    Returns:
        :class:`CountReport`; ``report.ok`` is True only when every expected norm tensor is present
        once, with shape ``[width]`` and a float dtype, and no other norm tensor is present. A
        model-parallel checkpoint (``model{i}-mp{N}.safetensors``, reference naming) must hold each
        norm in every shard and counts it once; only the Hugging Face naming expects MTP layers.

    Raises:
        CheckpointError: an unreadable or malformed file (see :func:`read_header`).
        ValueError: an invalid config.
    """
    files = resolve_checkpoint(path)
    cfg, cfg_source, notes = _config_for(files, config)
    headers = [read_header(f) for f in files.files]
    mismatches = list(files.problems)

    # Every norm-like tensor, with each file that holds it.
    occurrences: dict = {}
    for h in headers:
        for name, info in h.tensors.items():
            if classify(name) is not None or is_norm_like(name):
                occurrences.setdefault(name, []).append(info)

    votes = {"huggingface": 0, "reference": 0}
    for name in occurrences:
        c = classify(name)
        if c is not None:
            votes[c[0]] += 1
    if votes["reference"] > votes["huggingface"] or (files.layout == "model-parallel" and not votes["huggingface"]):
        naming = "reference"
    else:
        naming = "huggingface"
    if votes["reference"] and votes["huggingface"]:
        mismatches.append({"kind": "mixed_naming", "tensor": None, "site": None,
                           "detail": f"{votes['huggingface']} norm tensors use Hugging Face names and "
                                     f"{votes['reference']} reference names; counted as {naming}"})

    if naming == "huggingface" and not cfg.mtp_stated:
        # A reference-format config does not say how many MTP layers the HF checkpoint has: take the
        # layers present after the main model (each then checked complete), none required.
        mtp_layers = {c[2] for c in map(classify, occurrences) if c and c[0] == naming and c[2] is not None
                      and c[2] >= cfg.n_layers}
        n_mtp = 0
        while cfg.n_layers + n_mtp in mtp_layers:
            n_mtp += 1
        cfg = replace(cfg, n_mtp_layers=n_mtp)
        notes.append(f"the config does not state the MTP layer count; {n_mtp} MTP layer(s) found and checked")
    expected = _expected(cfg, naming)

    # One instance per name: replicas (model-parallel) must agree and be in every shard.
    found: dict = {}
    realpath = _realpath_cache()
    for name, infos in occurrences.items():
        info = _chosen_copy(infos, files, realpath)  # the copy load_norms loads
        if files.layout == "model-parallel":
            holders = {i.file for i in infos}
            lacking = [f for f in files.files if f not in holders]
            if lacking and name in expected:
                mismatches.append({"kind": "missing_replica", "tensor": name, "site": expected[name][0].key,
                                   "detail": "absent from model-parallel shard(s) " + ", ".join(os.path.basename(f) for f in lacking)})
            if len({(i.dtype, i.shape) for i in infos}) > 1:
                mismatches.append({"kind": "replica_mismatch", "tensor": name, "site": expected[name][0].key if name in expected else None,
                                   "detail": "replicas differ: " + "; ".join(f"{os.path.basename(i.file)}: {i.dtype} {list(i.shape)}" for i in infos)})
        elif len(infos) > 1:
            mismatches.append({"kind": "duplicate", "tensor": name, "site": expected[name][0].key if name in expected else None,
                               "detail": "stored in several shards: " + ", ".join(os.path.basename(i.file) for i in infos)})
        found[name] = info

    if files.weight_map is not None:
        for name, info in found.items():
            listed = files.weight_map.get(name)
            if listed is None:
                mismatches.append({"kind": "index_mismatch", "tensor": name, "site": None,
                                   "detail": f"in {os.path.basename(info.file)} but not in the index"})
            elif realpath(info.file) != realpath(listed):  # the chosen copy is the listed one when any is
                mismatches.append({"kind": "index_mismatch", "tensor": name, "site": None,
                                   "detail": f"index says {os.path.basename(listed)}, found in {os.path.basename(info.file)}"})
        for name, listed in files.weight_map.items():
            if (classify(name) is not None or is_norm_like(name)) and name not in found:
                mismatches.append({"kind": "index_mismatch", "tensor": name, "site": None,
                                   "detail": f"listed in the index under {os.path.basename(listed)} but not in that shard"})

    rows: dict = {}
    for s in enumerate_sites(cfg, mtp=naming == "huggingface"):
        r = rows.setdefault(s.key, {"site": s.key, "group": s.group, "norm_type": s.norm_type,
                                    "expected_instances": 0, "found_instances": 0, "expected_shape": [s.width],
                                    "shapes": set(), "dtypes": set(), "params": 0, "expected_params": 0,
                                    "mismatches": 0})
        r["expected_instances"] += 1
        r["expected_params"] += s.params
        present = True
        for t in s.tensors:
            name = f"{s.hf_path if naming == 'huggingface' else s.ref_path}.{t}"
            info = found.get(name)
            if info is None:
                present = False
                mismatches.append({"kind": "missing", "tensor": name, "site": s.key,
                                   "detail": f"expected {s.norm_type} {t} of shape [{s.width}]"})
                continue
            r["shapes"].add(str(list(info.shape)))
            r["dtypes"].add(info.dtype)
            r["params"] += info.numel
            if info.shape != (s.width,):
                present = False
                mismatches.append({"kind": "shape", "tensor": name, "site": s.key,
                                   "detail": f"shape {list(info.shape)}, expected [{s.width}] ({os.path.basename(info.file)})"})
            elif info.dtype not in FLOAT_DTYPES:
                present = False
                mismatches.append({"kind": "dtype", "tensor": name, "site": s.key,
                                   "detail": f"dtype {info.dtype} is not a float type ({os.path.basename(info.file)})"})
        r["found_instances"] += present

    for name in sorted(set(found) - set(expected)):
        info = found[name]
        c = classify(name)
        key = site_key(c[1], c[2], cfg) if c else "unrecognised"
        why = "not expected by the config" if c else "norm-like tensor of no known site"
        if c and c[0] != naming:
            why = f"{c[0]} name in a {naming}-named checkpoint"
        elif c and naming == "reference" and c[2] is not None and c[2] >= cfg.n_layers:
            why = "layer beyond the config's n_layers (a reference checkpoint has no MTP layer)"
        elif c and c[2] is not None and c[2] >= cfg.n_layers + cfg.n_mtp_layers:
            why = f"layer {c[2]} beyond the config's {cfg.n_layers} layers + {cfg.n_mtp_layers} MTP"
        elif c and c[1] == "k_norm" and cfg.format == "reference" and not cfg.index_head_dim:
            why = ("not expected by the config: a reference config with no index_* field is read as one from "
                   "before V3.2, without an indexer (add index_head_dim)")
        mismatches.append({"kind": "extra", "tensor": name, "site": key,
                           "detail": f"{why}: {info.dtype} {list(info.shape)} ({os.path.basename(info.file)})"})
        row = rows.get(key)
        if row is not None:
            row["params"] += info.numel

    for m in mismatches:
        if m.get("site") in rows:
            rows[m["site"]]["mismatches"] += 1
    site_rows = []
    for r in rows.values():
        r["shapes"], r["dtypes"] = sorted(r["shapes"]), sorted(r["dtypes"])
        site_rows.append(r)
    main_rms = [r for r in site_rows if r["group"] == "main" and r["norm_type"] == "rmsnorm"]
    mtp = [r for r in site_rows if r["group"] == "mtp"]
    totals = {
        "rmsnorm_instances_found": sum(r["found_instances"] for r in main_rms),
        "rmsnorm_instances_expected": sum(r["expected_instances"] for r in main_rms),
        "rmsnorm_params_found": sum(r["params"] for r in main_rms),
        "rmsnorm_params_expected": sum(r["expected_params"] for r in main_rms),
        "mtp_instances_found": sum(r["found_instances"] for r in mtp),
        "mtp_instances_expected": sum(r["expected_instances"] for r in mtp),
        "norm_tensors_read": sum(len(v) for v in occurrences.values()),
        "norm_tensors_distinct": len(occurrences),
    }
    return CountReport(
        path=files.path, layout=files.layout, files=list(files.files), mp_size=files.mp_size, naming=naming,
        config=cfg, config_source=cfg_source, sites=site_rows, mismatches=mismatches, totals=totals, notes=notes,
    )


def printable(line: str) -> str:
    """``line`` with its control characters escaped (``\\n``, ``\\x1b``...): tensor and file names
    come from untrusted files, and a name holding a newline or a terminal escape could otherwise
    print a forged verdict line or hide the real one."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)


def render_report(rep: CountReport, max_lines: int = 60) -> str:
    """A plain-text rendering of a :class:`CountReport`, listing at most ``max_lines`` mismatches."""
    layout = rep.layout + (f" (mp{rep.mp_size}: each norm replicated in every shard, counted once)" if rep.mp_size else "")
    # Two namings meet here, the checkpoint's tensors' and the config's fields'; each is said once,
    # named for what it names ("naming: huggingface" beside "(reference names)" read as a contradiction).
    out = [
        f"checkpoint: {rep.path}",
        f"layout: {layout}; {len(rep.files)} file(s); tensor names: {rep.naming}",
    ]
    out += wrap(f"compared with: the norm sites of {rep.config_source} (a config with {rep.config.format} field "
                f"names), as {rep.naming} tensor names", "  ")
    # Names are escaped before wrapping (wrapping would turn a newline in a name into a space).
    for n in rep.notes:
        out += wrap(printable(f"note: {n}"), "      ")
    out.append("")
    headers = ["site", "found/expected", "shape", "dtype", "params", "mismatches"]
    rows = [[r["site"] + (" (LayerNorm)" if r["norm_type"] == "layernorm" else ""),
             f"{r['found_instances']}/{r['expected_instances']}", ", ".join(r["shapes"]) or "-",
             ", ".join(r["dtypes"]) or "-", f"{r['params']:,}", r["mismatches"] or ""] for r in rep.sites]
    out += table(headers, rows)
    t = rep.totals
    out += ["", f"main-model RMSNorm: {t['rmsnorm_instances_found']}/{t['rmsnorm_instances_expected']} instances, "
                f"{t['rmsnorm_params_found']:,} parameters found (expected {t['rmsnorm_params_expected']:,})"]
    if t["mtp_instances_expected"]:
        out.append(f"MTP norms: {t['mtp_instances_found']}/{t['mtp_instances_expected']} instances")
    if rep.mismatches:
        by_kind: dict = {}
        for m in rep.mismatches:
            by_kind[m["kind"]] = by_kind.get(m["kind"], 0) + 1
        out += ["", f"{len(rep.mismatches)} mismatch(es) (" + ", ".join(f"{n} {k}" for k, n in by_kind.items()) + "):"]
        for m in rep.mismatches[:max_lines]:
            out += wrap(printable(f"{m['kind']}: {m['tensor'] or ''}{' - ' if m['tensor'] else ''}{m['detail']}"),
                        "      ", indent="  ")
        if len(rep.mismatches) > max_lines:
            out.append(f"  ... and {len(rep.mismatches) - max_lines} more (all of them with --json)")
        out.append("")
        out.append("MISMATCH: the checkpoint does not match the config")
    else:
        out += ["", "OK: the checkpoint's norm tensors match the config"]
    return "\n".join(printable(line) for line in out) + "\n"


# ---------------------------------------------------------------------------------------------------
# Loading into a model


@dataclass
class LoadReport:
    """What :func:`load_norms` copied: ``loaded`` rows (module, tensor, file, dtype, shape) and the
    checkpoint's norm tensors no module took (``unused``)."""

    path: str
    naming: str
    loaded: list[dict[str, Any]]
    unused: list[str]

    def __str__(self) -> str:
        lines = [f"loaded {len(self.loaded)} norm gain(s) from {self.path} ({self.naming} names)"]
        lines += [f"  {r['module']} <- {r['tensor']} ({r['dtype']} {r['shape']}, {os.path.basename(r['file'])})" for r in self.loaded]
        if self.unused:
            lines.append(f"{len(self.unused)} norm tensor(s) of the checkpoint not used: " + ", ".join(self.unused))
        return "\n".join(printable(line) for line in lines)


_MODULE_LAYER = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(" + "|".join(re.escape(s) for s in sorted(
        {*HF_SUFFIX.values(), *REF_SUFFIX.values(), "enorm", "hnorm", "shared_head.norm"}, key=len, reverse=True)) + r")$"
)


def module_site(name: str) -> Optional[tuple]:
    """``(base_key, layer)`` of a module path in either naming (any prefix), else ``None``."""
    m = _MODULE_LAYER.search(name)
    if m:
        suffix = m.group(2)
        return (_HF_BASE.get(suffix) or _REF_BASE[suffix], int(m.group(1)))
    if name == "norm" or name.endswith(".norm") and "layers." not in name:
        return ("norm", None)
    return None


def tensor_name(base_key: str, layer: Optional[int], naming: str, param: str = "weight") -> Optional[str]:
    """The checkpoint name of a norm parameter in ``naming``; ``None`` where that naming has none."""
    if base_key == "norm" and layer is None:
        return ("model.norm." if naming == "huggingface" else "norm.") + param
    if naming == "huggingface":
        suffix = HF_SUFFIX.get(base_key, base_key if base_key in ("enorm", "hnorm", "shared_head.norm") else None)
        return None if suffix is None else f"model.layers.{layer}.{suffix}.{param}"
    suffix = REF_SUFFIX.get(base_key)
    return None if suffix is None else f"layers.{layer}.{suffix}.{param}"


def _read_bytes(info: TensorInfo) -> bytes:
    try:
        with open(info.file, "rb") as f:
            f.seek(info.begin)
            raw = f.read(info.end - info.begin)
    except OSError as e:
        raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r}: {e.strerror or e}") from None
    if len(raw) != info.end - info.begin:
        raise CheckpointError(f"{info.file}: tensor {info.name!r} is truncated ({len(raw)} of {info.end - info.begin} bytes)")
    return raw


def _as_tensor(info: TensorInfo, raw: bytes):
    """The tensor ``raw`` (its bytes, :func:`_read_bytes`) holds, in its stored dtype and shape."""
    import torch

    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
    t = torch.frombuffer(bytearray(raw), dtype=dtypes[info.dtype]) if raw else torch.empty(0, dtype=dtypes[info.dtype])
    if sys.byteorder != "little":
        t = t.view(torch.uint8).view(-1, t.element_size()).flip(-1).reshape(-1).view(dtypes[info.dtype])
    return t.reshape(info.shape)  # the stored dtype: the caller checks that its cast is exact


def _same_values(back, v) -> bool:
    """Whether ``back`` (``v`` cast to another dtype and back) still holds every value of ``v``, NaN as NaN."""
    return bool(((back == v) | (back.isnan() & v.isnan())).all())


def _copies_disagree(chosen: TensorInfo, raw: bytes, infos: list, files: CheckpointFiles, realpath) -> Optional[str]:
    """Why the copies of a tensor stored in several files leave its value in doubt, else ``None``.
    The shard an index names settles it; otherwise (model-parallel replicas, a stale shard left in
    a directory) every copy must hold the chosen one's dtype, shape and bytes, as each rank of the
    reference loads its own copy."""
    listed = files.weight_map.get(chosen.name) if files.weight_map else None
    if len(infos) == 1 or (listed is not None and realpath(listed) == realpath(chosen.file)):
        return None
    def same_kind(i):
        return (i.dtype, i.shape) == (chosen.dtype, chosen.shape)

    differ = [i for i in infos if i is not chosen and not (same_kind(i) and _read_bytes(i) == raw)]
    if not differ:
        return None
    return (f"{chosen.name} is stored in {len(infos)} files that disagree: "
            + "; ".join(f"{os.path.basename(i.file)}: {i.dtype} {list(i.shape)}" for i in [chosen, *differ])
            + (" (same dtype and shape, different values)" if all(map(same_kind, differ)) else "")
            + "; remove the stale copy or fix the shards")


def _tied_conflicts(plan: list, values: list) -> list:
    """Modules whose weights share memory (a gain tied by patch, overlapping views): one copy would
    overwrite the other's, so their checkpoint values must agree, and the weights must be the same
    elements (not partly overlapping views)."""
    from dsnorm.ops import address_range

    problems = []
    seen: list = []  # (device, start, end, shape, strides, module name, tensor name, value)
    for (mname, mod, info), v in zip(plan, values):
        # A DTensor (FSDP2's sharded or TP's replicated parameter) has no memory of its own: its
        # data_ptr is 0 for every one; the memory is its local shard's.
        w = _local_tensor(mod.weight)
        if w.numel() == 0:
            continue
        start, end = address_range(w)
        for device, s0, e0, shape, strides, other, other_tensor, v0 in seen:
            if device != w.device or not (start < e0 and s0 < end):
                continue
            if (s0, shape, strides) != (start, tuple(w.shape), w.stride()):
                problems.append(f"{mname}: weight overlaps {other}'s in memory without being the same elements; "
                                f"give each norm its own parameter")
            elif not _same_values(v.cpu(), v0.cpu()):
                problems.append(f"{mname}: weight is tied to {other}'s (one parameter), but {info.name} and "
                                f"{other_tensor} hold different values; untie them or fix the checkpoint")
        seen.append((w.device, start, end, tuple(w.shape), w.stride(), mname, info.name, v))
    return problems


def _local_tensor(w):
    """``w``'s own memory: the local shard of a DTensor, else ``w``."""
    from dsnorm.dispatch import is_dtensor

    return w.to_local() if is_dtensor(w) else w


def _reshard_fsdp(targets: list) -> None:
    """The norms' FSDP2 parameter groups back to their sharded parameters, as torch's
    load_state_dict does first: after a forward that did not reshard (the root's, or
    ``reshard_after_forward=False``) a group's parameters are plain gathered tensors that the
    next reshard drops, so a value written into them would be lost. FSDP2 hangs that reshard on
    each module holding one of the group's parameters as a state_dict pre-hook, so it runs here
    whether the group's FSDP module is inside the model given or above it (a submodule passed).
    Local: frees the gathered copies, moves no data."""
    if "torch.distributed.fsdp" not in sys.modules:  # no FSDP2 module exists before its import
        return
    for _, mod in targets:
        mod.state_dict()


def _unwritable_placements(w):
    """``w``'s placements if it is a DTensor with a ``Partial`` among them, else None."""
    from dsnorm.dispatch import is_dtensor

    if not is_dtensor(w):
        return None
    # is_shard() is False for _StridedShard (FSDP2 over TP): every placement but a Partial holds values.
    if not any(p.is_partial() for p in w.placements):
        return None
    return tuple(w.placements)


def _placed_like(v, w):
    """The full value ``v`` placed as the parameter ``w`` is: ``w``'s share of it on each rank when
    ``w`` is a DTensor (every rank read the whole gain; nothing is sent), else ``v``."""
    from dsnorm.dispatch import is_dtensor

    if not is_dtensor(w):
        return v
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(v, w.device_mesh, w.placements, src_data_rank=None)


def _copy_all(plan: list, values: list) -> None:
    """Write every value, or (if a write fails) put back the ones written and say which module failed."""
    import torch

    written = []
    with torch.no_grad():
        for (mname, mod, _), v in zip(plan, values):
            # The failing write itself is put back too: torch checks some rules (an inference
            # tensor outside inference mode) only after it has written.
            written.append((mod.weight, mod.weight.detach().clone()))
            try:
                mod.weight.copy_(_placed_like(v, mod.weight))
            except Exception as e:
                with torch.inference_mode():  # where every tensor, inference or not, can be written
                    for w, old in reversed(written):
                        w.copy_(old)
                raise ValueError(f"load_norms: nothing loaded; writing {mname}.weight failed: "
                                 f"{type(e).__name__}: {e}") from e


def load_norms(model: nn.Module, path: Union[str, os.PathLike[str]]) -> LoadReport:
    """Copy every norm gain of a safetensors checkpoint into the ``dsnorm.RMSNorm`` modules of ``model``.

    Each ``dsnorm.RMSNorm`` module is matched to its checkpoint tensor by its path, in the reference
    naming (``layers.{i}.attn.q_norm``) or the Hugging Face naming
    (``model.layers.{i}.self_attn.q_a_layernorm``), whichever the checkpoint uses; the stored BF16/F16/F32
    values become exact float32 parameters (``weight[d]``, float32 in dsnorm), F64 ones too when each
    is exactly a float32. Only the norm tensors' bytes are read. All modules are checked and all
    values read before any parameter changes: on error nothing is modified (a write that still fails
    puts back those before it). Parameters on the meta device are refused (a copy into them keeps
    nothing): materialise the model first. A gain tied between modules (one parameter, as
    :func:`dsnorm.patch` keeps it) loads when the checkpoint holds the same values for each of them.
    A tensor stored in several files loads from the shard the index names; without an index saying
    so (model-parallel replicas, a stale shard in a directory), only when every copy holds the same
    dtype, shape and bytes. A bare ``RMSNorm`` takes the tensor ``weight``, its state_dict key.
    DTensor parameters (after FSDP2's ``fully_shard`` or a tensor-parallel plan) load too: every
    rank reads the gains and writes its own share of each, with no communication; call it on
    every rank (FSDP2's gathered parameters are resharded first, which the next forward's
    all-gather then expects of every rank).

    Args:
        model: an ``nn.Module`` holding ``dsnorm.RMSNorm`` modules (e.g. after :func:`dsnorm.patch`).
        path: a ``.safetensors`` file, a shard directory or an index JSON.

    Returns:
        :class:`LoadReport` of what was loaded and which checkpoint norm tensors were not used.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: the model has no dsnorm norms, or tensors are missing, mis-shaped, of an
            unsupported dtype or not representable in the parameter's dtype (all listed).
        CheckpointError: a malformed checkpoint file.
    """
    import torch
    from torch import nn

    from dsnorm import RMSNorm

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    targets = [(n, m) for n, m in model.named_modules(remove_duplicate=True) if isinstance(m, RMSNorm)]
    if not targets:
        meta = any(p.is_meta for p in model.parameters())
        raise ValueError("model has no dsnorm.RMSNorm modules to load into (patch it first with dsnorm.patch"
                         + ("; its parameters are on the meta device, whose norms patch leaves: materialise it "
                            "with model.to_empty(device=...), then patch, then load_norms)" if meta else ")"))
    _reshard_fsdp(targets)
    files = resolve_checkpoint(path)
    headers = [read_header(f) for f in files.files]
    copies: dict = {}
    for h in headers:
        for name, info in h.tensors.items():
            copies.setdefault(name, []).append(info)
    realpath = _realpath_cache()
    tensors = {name: _chosen_copy(infos, files, realpath) for name, infos in copies.items()}
    votes = {"huggingface": 0, "reference": 0}
    for name in tensors:
        c = classify(name)
        if c is not None:
            votes[c[0]] += 1
    naming = "reference" if votes["reference"] > votes["huggingface"] else "huggingface"

    problems, plan = [], []
    for mname, mod in targets:
        cands = [f"{mname}.weight" if mname else "weight"]  # as in model.state_dict()
        site = module_site(mname)
        if site is not None:
            t = tensor_name(site[0], site[1], naming)
            if t is not None:
                cands.append(t)
        mname = mname or "<model itself>"
        info = next((tensors[c] for c in cands if c in tensors), None)
        if info is None:
            problems.append(f"{mname}: missing (looked for {' or '.join(dict.fromkeys(cands))})")
            continue
        if mod.weight.is_meta:
            problems.append(f"{mname}: weight is on the meta device, where a copy keeps no values; "
                            f"materialise the model first (e.g. model.to_empty(device='cpu'))")
            continue
        # What torch's copy_ would refuse, found here so that it refuses before anything is written.
        if mod.weight.is_inference() and not torch.is_inference_mode_enabled():
            problems.append(f"{mname}: weight is an inference tensor (made under torch.inference_mode), "
                            f"which torch writes only in inference mode: call load_norms under "
                            f"torch.inference_mode(), or build the model outside it")
            continue
        if mod.weight.dim() == 1 and mod.weight.numel() > 1 and mod.weight.stride(0) == 0:
            problems.append(f"{mname}: weight's elements share one memory location (an expanded tensor), "
                            f"so it cannot hold a gain; give it its own parameter")
            continue
        placed = _unwritable_placements(mod.weight)
        if placed:
            problems.append(f"{mname}: weight is a DTensor placed {placed}; load_norms writes Shard and "
                            f"Replicate placements (a Partial holds a pending sum, not a gain)")
            continue
        want = tuple(mod.weight.shape)
        if info.shape != want:
            problems.append(f"{mname}: {info.name} has shape {list(info.shape)}, the module needs {list(want)}")
            continue
        if info.dtype not in LOADABLE_DTYPES:
            problems.append(f"{mname}: {info.name} is {info.dtype}; only {', '.join(LOADABLE_DTYPES)} gains load")
            continue
        plan.append((mname, mod, info))
    if problems:
        raise ValueError(f"load_norms({files.path}): nothing loaded; {len(problems)} problem(s):\n  " + "\n  ".join(problems))

    values = []
    for mname, mod, info in plan:
        raw = _read_bytes(info)
        problem = _copies_disagree(info, raw, copies[info.name], files, realpath)
        if problem:
            problems.append(f"{mname}: {problem}")
        v = _as_tensor(info, raw)
        p = mod.weight
        cast = v.to(dtype=p.dtype, device=p.device)
        # The parameter must hold the stored value exactly: an F64 gain, or a parameter cast down
        # (model.to(bfloat16)), may not.
        if not _same_values(cast.to(device="cpu", dtype=v.dtype), v):
            problems.append(f"{mname}: {info.name} ({info.dtype}) is not exactly representable in the "
                            f"parameter's {p.dtype}")
        # A patched HF norm (patching.PromotingHFRMSNorm) holds a gain of a narrower dtype in its
        # fp32 weight, as the HF parameter it replaced did: the values must fit that dtype too.
        gain = getattr(mod, "gain_dtype", None)
        if p.dtype == torch.float32 and gain in (torch.bfloat16, torch.float16):
            if not _same_values(v.to(gain).to(v.dtype), v):
                problems.append(f"{mname}: {info.name} ({info.dtype}) is not exactly representable in the "
                                f"patched norm's {gain} gain (the dtype HF's parameter would have)")
        values.append(cast)
    problems += _tied_conflicts(plan, values)
    if problems:
        raise ValueError(f"load_norms({files.path}): nothing loaded; {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    _copy_all(plan, values)
    used = {info.name for _, _, info in plan}
    unused = sorted(n for n in tensors if n not in used and (classify(n) is not None or is_norm_like(n)))
    loaded = [{"module": m, "tensor": i.name, "file": i.file, "dtype": i.dtype, "shape": list(i.shape)} for m, _, i in plan]
    return LoadReport(files.path, naming, loaded, unused)


# ---------------------------------------------------------------------------------------------------
# CLI: dsnorm count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``dsnorm count``."""
    parser.add_argument("path", metavar="PATH",
                        help="a .safetensors file, a directory of shards, or a model.safetensors.index.json")
    parser.add_argument("--config", metavar="FILE",
                        help="expected model config, or a model directory holding config.json (default: "
                             "the config.json beside the checkpoint, else the built-in 671B V3.2-Exp)")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON ('-': stdout instead of the text)")


def _inputs(args: argparse.Namespace) -> list:
    """``(option, path)`` of every file ``dsnorm count`` reads: the path named, its shards, the
    index, and the config (given, or the one beside the checkpoint)."""
    inputs = [("checkpoint", args.path), ("--config", config_file(args.config)),
              ("built-in config", default_config_path())]
    try:
        files = resolve_checkpoint(args.path)
    except (ValueError, OSError):
        return inputs  # count_norms names the problem
    inputs += [("checkpoint", f) for f in files.files]
    if os.path.isdir(args.path):
        inputs += [("index", os.path.join(args.path, n)) for n in os.listdir(args.path)
                   if n.endswith(".safetensors.index.json")]
    if args.config is None:
        inputs.append(("config", os.path.join(files.root, "config.json")))
    return inputs


def run(args: argparse.Namespace) -> int:
    """Run ``dsnorm count``: 0 when the checkpoint matches, 1 on mismatches, 2 on unreadable input
    or an unwritable ``--json`` path (refused before the checkpoint is read)."""
    if json_path_refused("count", args.json, _inputs(args)):
        return 2
    try:
        rep = count_norms(args.path, args.config)
    except (ValueError, TypeError) as e:
        print(f"dsnorm count: error: {printable(str(e))}", file=sys.stderr)  # one line, names escaped
        return 2
    if args.json == "-":
        json.dump(rep.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_report(rep))
        if args.json:
            if not write_output("count", args.json, args.json, json.dumps(rep.to_dict(), indent=1) + "\n"):
                return 2
    return 0 if rep.ok else 1

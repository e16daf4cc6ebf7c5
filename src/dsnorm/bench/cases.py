"""The bench's cases: DeepSeek-V3.2-Exp's norm sites at their inference (and training) shapes
(:func:`default_cases`), the byte model behind every GB/s (:func:`case_bytes`, :func:`floor_bytes`),
each case's inputs (:func:`make_inputs`), and the fusion cases (:func:`fusion_cases`, from
:func:`dsnorm.fusions.bench_cases`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

# DeepSeek-V3.2-Exp widths: hidden size, query latent (q_lora_rank), key-value latent
# (kv_lora_rank) and the row it is sliced from (kv_lora_rank + qk_rope_head_dim).
HIDDEN = 7168
Q_LORA = 1536
KV_LORA = 512
KV_ROW = 576
PREFILL_TOKENS = 4096
# --quick keeps every site and form but prefills 256 tokens: the smoke test takes seconds.
QUICK_TOKENS = 256
DECODE_BATCHES = (1, 8, 64)
DTYPE = torch.bfloat16

FORMS = ("plain", "fused", "in-place")


@dataclass(frozen=True)
class Case:
    """One benchmark case: a norm site at a shape, in one form (plain / fused / in-place).

    ``shape`` is the shape of ``x`` as the norm sees it; ``row_stride`` is set when ``x`` is a
    slice of wider rows (``kv_norm`` reads 512 of each 576-wide row in place).
    """

    name: str
    site: str
    shape: tuple
    form: str
    decode: bool = False
    row_stride: Optional[int] = None
    backward: bool = False

    @property
    def width(self) -> int:
        return self.shape[-1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def default_cases(backward: bool = False, tokens: int = PREFILL_TOKENS) -> list:
    """The default run's cases: every DeepSeek-V3.2-Exp norm site at its inference shapes.

    Final norm at prefill (``tokens`` tokens) fused with the residual; attn/ffn norm, query-latent
    norm and the kv-latent norm (on its strided 512-of-576 slice) at decode for each batch in
    :data:`DECODE_BATCHES`; the in-place fused form at the core issue's three shapes
    (``[tokens, 7168]``, ``[64, 7168]``, ``[1, 1536]``); with ``backward``, two training shapes
    (``[1, tokens, 7168]`` fused, ``[tokens, 1536]`` plain) timed forward + backward.
    """
    cases = [Case(f"norm+res prefill T={tokens}", "norm", (1, tokens, HIDDEN), "fused")]
    for b in DECODE_BATCHES:
        cases.append(Case(f"attn/ffn_norm+res decode B={b}", "attn_norm/ffn_norm", (b, 1, HIDDEN), "fused", True))
    for b in DECODE_BATCHES:
        cases.append(Case(f"q_norm decode B={b}", "q_norm", (b, 1, Q_LORA), "plain", True))
    for b in DECODE_BATCHES:
        cases.append(Case(f"kv_norm decode B={b}", "kv_norm", (b, 1, KV_LORA), "plain", True, row_stride=KV_ROW))
    for shape in ((tokens, HIDDEN), (64, HIDDEN), (1, Q_LORA)):
        cases.append(Case(f"in-place {list(shape)}", "fused_add_rms_norm_", shape, "in-place", shape[0] <= 64))
    if backward:
        cases.append(Case(f"train norm+res T={tokens}", "norm", (1, tokens, HIDDEN), "fused", backward=True))
        cases.append(Case(f"train q_norm T={tokens}", "q_norm", (tokens, Q_LORA), "plain", backward=True))
    return cases


def case_bytes(case: Case, dtype: torch.dtype = DTYPE) -> int:
    """Bytes one call of the case must move at least (the byte model behind every GB/s).

    With ``T`` = ``numel * itemsize`` of ``x`` (only the 512 elements of each kv_norm row that are
    read, not the 576-wide parent rows) and ``W`` = ``width * 4`` (the fp32 gains, read once):

    * plain: read ``x``, write ``y``: ``2T + W``;
    * fused: read ``x`` and ``residual``, write ``y`` and ``residual_out``: ``4T + W``;
    * in-place: the same four streams (``y`` and the new residual overwrite the inputs): ``4T + W``;
    * forward + backward (``--backward``), plain: forward ``2T``, backward reads ``dy`` and ``x``
      and writes ``dx``: ``5T + 2W`` (gains read, dweight written); fused: forward ``4T``, backward
      reads ``dy``, ``dresidual_out``, ``x``, ``residual`` and writes ``dx`` and ``dresidual``:
      ``10T + 2W``.

    It counts what a one-pass kernel cannot avoid, not what a provider actually moves (the eager
    reference makes several fp32 passes), so GB/s compares providers by useful work done.
    """
    t = case.numel * dtype.itemsize
    w = case.width * 4
    if case.backward:
        return (5 * t + 2 * w) if case.form == "plain" else (10 * t + 2 * w)
    return (2 * t + w) if case.form == "plain" else (4 * t + w)


def floor_bytes(case: Case, dtype: torch.dtype = DTYPE) -> int:
    """Bytes of the ``torch.add`` floor: plain ``x + x`` reads ``x`` once and writes the sum (2T);
    fused ``x + residual`` reads two tensors and writes one (3T)."""
    t = case.numel * dtype.itemsize
    return 2 * t if case.form == "plain" else 3 * t


@dataclass
class Inputs:
    """Inputs of a case: ``x`` (a strided view for kv_norm), ``residual``, fp32 ``gains``;
    ``dy`` / ``dres`` upstream gradients for backward cases."""

    x: torch.Tensor
    residual: Optional[torch.Tensor]
    gains: torch.Tensor
    dy: Optional[torch.Tensor] = None
    dres: Optional[torch.Tensor] = None


# The norm cases' inputs are drawn from this seed (kept in the JSON as ``input_seed``); the fusion
# cases draw theirs in dsnorm.fusions.bench_cases from seed 0 too.
INPUT_SEED = 0


def make_inputs(case: Case, device: torch.device, seed: int = INPUT_SEED) -> Inputs:
    """Random bf16 activations, a larger-magnitude bf16 residual stream and full-mantissa fp32
    gains around 1 (so the final ``weight * x̂`` rounding is exercised), drawn on the CPU from a
    fixed seed so that every device gets the same numbers."""
    g = torch.Generator().manual_seed(seed)
    lead, n = case.shape[:-1], case.width
    if case.row_stride:
        x = torch.randn(*lead, case.row_stride, generator=g).to(DTYPE).to(device)[..., :n]
    else:
        x = torch.randn(*case.shape, generator=g).to(DTYPE).to(device)
    residual = None
    if case.form != "plain":
        residual = (4 * torch.randn(*case.shape, generator=g)).to(DTYPE).to(device)
    gains = (1 + 0.5 * torch.randn(n, generator=g)).to(device)
    dy = dres = None
    if case.backward:
        dy = torch.randn(*case.shape, generator=g).to(DTYPE).to(device)
        if residual is not None:
            dres = torch.randn(*case.shape, generator=g).to(DTYPE).to(device)
    return Inputs(x, residual, gains, dy, dres)


def fusion_cases(quick: bool, device: torch.device) -> list:
    from dsnorm.fusions import bench_cases

    return bench_cases(quick=quick, device=device.type)

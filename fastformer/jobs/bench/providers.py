"""The provider registry: provider name -> factory of the forward function it times.

A :class:`Provider` turns an op (:class:`~fastformer.jobs.bench.ops.OpSpec`) into a forward callable
``f(inputs, shape) -> output``, and says whether it can run an op on a device (and why not).
``fastformer bench`` and the pytest-benchmark suite in ``benchmarks/`` both draw from
:func:`providers_for` and :func:`build_case`, so they time the very same code. New providers
(another GPU library, a different SDPA kernel) slot in with :func:`register`.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import fastformer
from fastformer import backends

from .ops import (MODES, OPS, SMOOTHING, Inputs, OpSpec, attention_causal, attention_dropout,
                  varlen_padded_fastformer)
from .timing import synchronized

Forward = Callable[[Inputs, Dict], torch.Tensor]


@dataclass
class Provider:
    """A way of running an op: ``factory(spec)`` returns the forward callable to time.

    ``why_not(spec, device, dtype)`` returns None when the provider can run the op there, else
    the reason it cannot; ``supports(spec, shape)`` filters shapes it does not apply to.
    """
    name: str
    factory: Callable[[OpSpec], Forward]
    why_not: Callable[[OpSpec, torch.device, torch.dtype], Optional[str]] = lambda spec, device, dtype: None
    supports: Callable[[OpSpec, Dict], bool] = lambda spec, shape: True
    baseline: bool = False  # the provider speed-ups are measured against
    tags: List[str] = field(default_factory=list)
    devices: Tuple[str, ...] = ("cpu", "cuda")  # device types it is a timing provider for
    ops: Optional[Tuple[str, ...]] = None  # the ops it runs (None: every op)


REGISTRY: Dict[str, Provider] = {}


def register(provider: Provider) -> Provider:
    REGISTRY[provider.name] = provider
    return provider


# -- eager PyTorch and torch.compile --------------------------------------------------------------
register(Provider("torch-eager", factory=lambda spec: spec.eager, baseline=True, tags=["torch"]))

_COMPILED: Dict[str, Forward] = {}


def _compiled(spec: OpSpec) -> Forward:
    if spec.name not in _COMPILED:
        import torch._dynamo

        # every shape of a sweep (and its no-grad variant) is its own graph: keep them all cached
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _COMPILED[spec.name] = torch.compile(spec.eager, dynamic=False)
    return _COMPILED[spec.name]


def _compile_why_not(spec, device, dtype) -> Optional[str]:
    try:
        import torch._inductor  # noqa: F401
    except ImportError as e:  # pragma: no cover - a torch without inductor
        return f"torch.compile unavailable: {e}"
    return None


register(Provider("torch-compile", factory=_compiled, why_not=_compile_why_not, tags=["torch", "compile"]))


# -- fastformer backends --------------------------------------------------------------------------
def _fastformer_factory(backend: str) -> Callable[[OpSpec], Forward]:
    def factory(spec: OpSpec) -> Forward:
        def forward(x: Inputs, shape: Dict) -> torch.Tensor:
            with fastformer.use_backend(backend):
                return spec.fastformer(x, shape)
        return forward
    return factory


def backend_why_not(backend: str, ops: Sequence[str], device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None when the fastformer ``backend`` can time every one of ``ops`` on ``device`` in
    ``dtype``, else why not (the op benchmarks ask for one op, the training step for all it runs)."""
    if backend == "triton" and device.type != "cuda":
        return "triton runs CPU tensors only in its interpreter, which is not a timing provider"
    if backend == "cuda" and device.type != "cuda":
        return "cuda runs CPU tensors only on the SIMT test harness, which is not a timing provider"
    avail = backends.availability(backend, device.type)
    if not avail:
        return avail.reason
    for op in ops:
        try:
            with fastformer.use_backend(backend):
                backends.select(op, device, dtype)
        except RuntimeError as e:
            return str(e)
    return None


def _fastformer_why_not(backend: str):
    return lambda spec, device, dtype: backend_why_not(backend, (spec.name,), device, dtype)


for _name in backends.NAMES:
    register(Provider(f"fastformer-{_name}", factory=_fastformer_factory(_name), why_not=_fastformer_why_not(_name),
                      tags=["fastformer"] + (["slow"] if _name == "reference" else []),
                      devices={"cpu": ("cpu",), "reference": ("cpu", "cuda")}.get(_name, ("cuda",))))


# -- fastformer's padded attention on packed rows (attention_varlen's comparison) --------------------
register(Provider("fastformer-padded", factory=lambda spec: varlen_padded_fastformer, tags=["fastformer"],
                  ops=("attention_varlen",)))


# -- CUDA-only SDPA kernels (attention) -----------------------------------------------------------
def _sdpa_why_not(kernel: Optional[str]):
    def why_not(spec, device, dtype) -> Optional[str]:
        if device.type != "cuda":
            return "a CUDA kernel (no GPU here)" if kernel else "a CUDA provider (on CPU it is torch-eager)"
        if kernel == "flash" and dtype == torch.float32:
            return "FlashAttention kernels take fp16/bf16 only"
        return None
    return why_not


def _sdpa_factory(kernel: Optional[str]) -> Callable[[OpSpec], Forward]:
    def factory(spec: OpSpec) -> Forward:
        import torch.nn.functional as F

        def forward(x: Inputs, shape: Dict) -> torch.Tensor:
            q, k, v, kpm = x["q"], x["k"], x["v"], x["key_padding_mask"]
            causal, p = attention_causal(shape), attention_dropout(shape)
            if kernel == "flash":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)
            if not shape.get("pad", True):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)
            S = q.shape[2]
            hidden = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1 if causal else S)[None, None] \
                | kpm[:, None, None, :]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden, dropout_p=p)
        return forward
    return factory


register(Provider("sdpa", factory=_sdpa_factory(None), why_not=_sdpa_why_not(None), tags=["torch", "cuda"],
                  devices=("cuda",), ops=("attention",)))
register(Provider("sdpa-flash", factory=_sdpa_factory("flash"), why_not=_sdpa_why_not("flash"),
                  supports=lambda spec, shape: not shape.get("pad", True), tags=["torch", "cuda"],
                  devices=("cuda",), ops=("attention",)))


# -- torch's own fused linear + cross-entropy (torch >= 2.13) ---------------------------------------
def _torch_lce_why_not(spec, device, dtype) -> Optional[str]:
    if not hasattr(F, "linear_cross_entropy"):
        return f"torch {torch.__version__} has no F.linear_cross_entropy (new in 2.13)"
    return None


def _torch_lce_factory(chunked: bool) -> Callable[[OpSpec], Forward]:
    """``F.linear_cross_entropy`` on the op's inputs: its default reference path, or (``chunked``)
    its chunked path, which never holds the full logits (retain_graph allowed: the ``bwd`` mode
    runs backward through one graph again and again)."""
    def factory(spec: OpSpec) -> Forward:
        options = torch.nn.LinearCrossEntropyOptions(allow_retain_graph=True) if chunked else None

        def forward(x: Inputs, shape: Dict) -> torch.Tensor:
            return F.linear_cross_entropy(x["hidden"], x["weight"], x["target"], linear_bias=x["bias"],
                                          label_smoothing=SMOOTHING, ignore_index=-100, options=options)
        return forward
    return factory


register(Provider("torch-linear-cross-entropy", factory=_torch_lce_factory(False), why_not=_torch_lce_why_not,
                  tags=["torch"], ops=("linear_cross_entropy",)))
register(Provider("torch-linear-cross-entropy-chunked", factory=_torch_lce_factory(True),
                  why_not=_torch_lce_why_not, tags=["torch"], ops=("linear_cross_entropy",)))


# -- the machine's own yardstick for memory-bound ops: a plain copy of the same bytes ---------------
COPY = "torch-copy-alone"


def _copy_why_not(spec, device, dtype) -> Optional[str]:
    return None if spec.bytes is not None else "a yardstick for memory-bound ops (GB/s)"


register(Provider(COPY, factory=lambda spec: None, why_not=_copy_why_not, tags=["torch", "yardstick"]))


def _copy_case(op: str, shape: Dict, device: torch.device, dtype: torch.dtype, modes) -> "Case":
    """``dst.copy_(src)`` moving, read plus write, the bytes the op's traffic model counts for each
    mode (so its GB/s is the machine's copy bandwidth at that volume, and copy time / op time is the
    fraction of it the op reaches); both buffers are allocated once, outside the timed call."""
    spec = OPS[op]
    elem = torch.finfo(dtype).bits // 8
    calls: Dict[str, Callable[[], object]] = {}
    buffers = {}
    for mode in modes:
        n = max(1, int(spec.bytes(shape, mode, elem)) // (2 * elem))
        src = torch.randn(n, device=device).to(dtype)
        dst = torch.empty_like(src)
        buffers[mode] = (src, dst)
        calls[mode] = synchronized(lambda d=dst, s=src: d.copy_(s), device)
    return Case(op, COPY, shape, dtype, device, calls, lambda: None, buffers)


# -- selection and cases --------------------------------------------------------------------------
def default_dtypes(device: torch.device) -> List[torch.dtype]:
    return [torch.bfloat16] if device.type == "cuda" else [torch.float32]


def providers_for(op: str, device: torch.device, dtype: torch.dtype,
                  names: Optional[List[str]] = None) -> List[Tuple[Provider, Optional[str]]]:
    """``(provider, reason_it_cannot_run_or_None)`` for ``names`` (default: every registered one),
    leaving out providers that are not timing providers on this device type (triton and cuda
    on CPU) or not for this op (the SDPA kernels outside attention, torch's
    ``F.linear_cross_entropy`` outside linear_cross_entropy)."""
    spec = OPS[op]
    out = []
    for name in names or list(REGISTRY):
        if name not in REGISTRY:
            raise ValueError(f"unknown provider {name!r}; registered: {sorted(REGISTRY)}")
        provider = REGISTRY[name]
        if device.type not in provider.devices or (provider.ops is not None and op not in provider.ops):
            continue
        out.append((provider, provider.why_not(spec, device, dtype)))
    return out


@dataclass
class Case:
    """One (op, provider, shape, dtype) workload, with a synchronising callable per mode."""
    op: str
    provider: str
    shape: Dict
    dtype: torch.dtype
    device: torch.device
    calls: Dict[str, Callable[[], object]]
    reset: Callable[[], None]  # drops the gradients the previous call left (before memory measurement)
    buffers: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # COPY: mode -> (src, dst)

    @property
    def label(self) -> str:
        return OPS[self.op].label(self.shape)


def build_case(op: str, provider: str, shape: Dict, device: torch.device, dtype: torch.dtype,
               modes=MODES) -> Case:
    """Inputs on ``device`` and the callables for each mode (``fwd``, ``bwd``: backward only,
    through a graph kept with ``retain_graph``, and ``fwd_bwd``)."""
    if provider == COPY:
        return _copy_case(op, shape, device, dtype, modes)
    spec = OPS[op]
    forward = REGISTRY[provider].factory(spec)
    x = spec.make_inputs(shape, device, dtype)
    leaves = [x[name] for name in spec.leaves]

    def clear():
        for t in leaves:
            t.grad = None

    calls: Dict[str, Callable[[], object]] = {}
    if "fwd" in modes:
        calls["fwd"] = synchronized(lambda: forward(x, shape), device)
    if "bwd" in modes or "fwd_bwd" in modes:
        out = forward(x, shape)
        grad = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)
        if "bwd" in modes:
            def bwd():
                clear()
                out.backward(grad, retain_graph=True)
            calls["bwd"] = synchronized(bwd, device)
        if "fwd_bwd" in modes:
            def fwd_bwd():
                clear()
                forward(x, shape).backward(grad)
            calls["fwd_bwd"] = synchronized(fwd_bwd, device)
    return Case(op, provider, shape, dtype, device, calls, clear)

"""No tensor of Sq x Sk elements per head in a converted T5 training step: the relative bias reaches the
kernels as the (num_buckets, H) table, the masks as key padding and is_causal, and the kernels keep no
score matrix. Two witnesses: every allocation the profiler records (kernels' own buffers included) and
every tensor an op returns (a TorchDispatchMode hook).

The kernels take the bias once their backend does (until then forcing it refuses T5's attention and the
test skips with the backend's reason); the reference builds the dense bias by definition, which the
second test uses to show that the check sees one."""
import pytest

pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fastformer  # noqa: E402
import hf_models as H  # noqa: E402
from utils import kernel_backends  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")

# d_model 16 (4 heads of 4), d_ff 16, 512 positions, B = 2. The bound: HEADS * L * L, in elements for a
# returned tensor (the dense bias (1, H, Sq, Sk), the scores (B, H, Sq, Sk)), in bytes for an allocation (one
# head's fp32 scores, a per-head bool mask). Below it: every activation (B * L * 16 floats), a kernel's
# tiles, and transformers' own (B, 1, Sq, Sk) bool masks, built once per stack for every head (the mask
# builder materialises them for the other families too; fastformer_mask passes the kernel their parts)
L, HEADS = 512, 4
SMALL = dict(d_model=16, num_heads=HEADS, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1,
             relative_attention_num_buckets=32, relative_attention_max_distance=128)
BOUND = HEADS * L * L


class _Outputs(TorchDispatchMode):
    """The shapes of the tensors every op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def _step(model, backend):
    """One training step of ``model`` (B = 2, source and target L long, padded) under ``backend``:
    ``(largest allocation in bytes, the op outputs with at least BOUND elements)``."""
    batch = H.batch("t5", B=2, S=L, T=L)
    batch["attention_mask"][1, 400:] = 0
    batch["labels"][0, 300:] = -100
    seen = _Outputs()
    with fastformer.use_backend(backend), torch.profiler.profile(profile_memory=True) as prof:
        with seen:
            model(**batch).loss.backward()
    largest = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    return largest, [(op, s) for op, s in seen.shapes if torch.Size(s).numel() >= BOUND]


@pytest.mark.parametrize("backend", kernel_backends("cpu"))
def test_no_score_sized_tensor_in_a_converted_t5_step(backend):
    why = H.declines_relative_bias(backend)
    if why is not None:
        pytest.skip(f"until the kernels take T5's bias: {why}")
    model = H.convert(H.build("t5", **SMALL).train(), backend)
    largest, big = _step(model, backend)
    assert big == [], big[:5]
    assert largest < BOUND, f"an allocation of {largest} bytes: {HEADS} heads' {L} x {L} at one byte each"


def test_the_check_sees_the_reference_dense_bias():
    """The reference (the definition) builds the (H, Sq, Sk) bias and the scores: both witnesses see them."""
    model = H.convert(H.build("t5", **SMALL).train(), "reference")
    largest, big = _step(model, "reference")
    assert largest >= BOUND
    assert any(s[-3:] == (HEADS, L, L) for _, s in big)

"""DFlash 2's training step without what is not arithmetic: the convolution's written-out gradient (one function of
x, the base kernel and the deltas, compiled on CUDA) and the selector's codebook gathers compute the same loss and
gradients as the tap loop and the indexing they replace (fp32, 1e-5), with fewer operators, and the step reads
nothing back to the host."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from common.drafter.blocks import build_blocks
from common.drafter.dflash2.model import CandidateSelector, GroupedDynamicCausalConv, causal_conv
from common.drafter.masks import build_masks
from common.drafter.model import build_drafter
from tests.drafter_fixtures import random_batch, random_head
from tests.test_dflash2 import dflash2_config, trained_like

HOST_READS = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "masked_select")
"""Operators that copy a device value to the host (each one a synchronisation on CUDA)."""


class OpCounter(TorchDispatchMode):
    """Counts the aten operators run (forward and backward), and those that read a device value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    @property
    def host_reads(self) -> list[str]:
        return [op for op in self.ops if op in HOST_READS]


def tap_loop_convolve(conv: GroupedDynamicCausalConv, x: torch.Tensor, deltas: torch.Tensor, side: int):
    """The convolution as it was written before (one product per tap over zero-padded blocks, autograd's gradient)."""
    blocks, length, width = x.shape
    taps = conv.kernel_size
    padded = F.pad(x, (0, 0, taps - 1, 0)).view(blocks, length + taps - 1, conv.groups, conv.group_size)
    base = conv.base_kernel[side].to(x.dtype).view(taps, conv.groups, conv.group_size)
    out = None
    for offset in range(taps):
        start = taps - 1 - offset
        term = (base[offset] + deltas[:, :, side, offset, :, None].to(x.dtype)) * padded[:, start : start + length]
        out = term if out is None else out + term
    return out.reshape(blocks, length, width)


def indexed_pairwise(selector: CandidateSelector, hidden, previous, candidates):
    """The selector's bilinear term as it was written before (codebook rows by indexing: index_put_ backward)."""
    gate = selector.predecessor_codebook[previous] * selector.hidden_projection(
        hidden.to(selector.hidden_projection.weight.dtype)
    )
    return torch.einsum("mr,mkr->mk", gate, selector.successor_codebook[candidates]).float()


def conv_pair_step(conv: GroupedDynamicCausalConv, x: torch.Tensor, grad: torch.Tensor, convolve) -> tuple:
    """Both sides of one sublayer's convolution pair, forward and backward: output and every gradient."""
    conv.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    deltas = conv.deltas(x)
    inner = torch.tanh(convolve(conv, x, deltas, 0))
    out = convolve(conv, inner, deltas, 1)
    (out * grad).sum().backward()
    return out.detach(), x.grad, conv.base_kernel.grad, conv.kernel_projection.weight.grad


def new_convolve(conv, x, deltas, side):
    return conv.convolve(x, deltas, side)


@pytest.mark.parametrize(
    "taps,group_size,blocks,length,width", [(2, 16, 7, 16, 64), (3, 4, 5, 6, 16), (4, 8, 3, 4, 32)]
)
def test_the_written_out_convolution_equals_the_tap_loop_with_its_gradients(taps, group_size, blocks, length, width):
    torch.manual_seed(taps)
    conv = GroupedDynamicCausalConv(width, taps, group_size)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.3)
    x = torch.randn(blocks, length, width)
    grad = torch.randn(blocks, length, width)
    ours = conv_pair_step(conv, x, grad, new_convolve)
    reference = conv_pair_step(conv, x, grad, tap_loop_convolve)
    for name, a, b in zip(("out", "x", "base_kernel", "kernel_projection"), ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_the_convolution_without_a_deltas_gradient_and_without_autograd():
    torch.manual_seed(0)
    x, base = torch.randn(4, 8, 3, 4, requires_grad=True), torch.randn(2, 3, 4, requires_grad=True)
    deltas = torch.randn(4, 8, 2, 3)  # no gradient asked for
    kernel = torch.stack([torch.randn(2, 12), base.detach().view(2, 12)]).requires_grad_()  # side 1 is base
    full_deltas = torch.stack([torch.randn(4, 8, 2, 3), deltas], dim=2)
    out = causal_conv(x, kernel, full_deltas, 1)
    gx, gk = torch.autograd.grad(out.square().sum(), (x, kernel))
    gb = gk[1].view(2, 3, 4)
    assert gk[0].abs().sum() == 0
    x2, base2 = x.detach().clone().requires_grad_(), base.detach().clone().requires_grad_()
    padded = F.pad(x2, (0, 0, 0, 0, 1, 0))
    ref = (base2[0] + deltas[:, :, 0, :, None]) * x2 + (base2[1] + deltas[:, :, 1, :, None]) * padded[:, :-1]
    rx, rb = torch.autograd.grad(ref.square().sum(), (x2, base2))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, rb, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(causal_conv(x, kernel, full_deltas, 1), ref, rtol=1e-5, atol=1e-5)


def test_the_convolution_runs_fewer_operators_than_the_tap_loop():
    """The per-tap work of forward and backward, in operators that launch kernels: the tap loop's autograd pads,
    and scatters each tap's kernel gradient into a zeroed full-size tensor (select_backward, slice_backward)."""
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(64, 2, 16)
    x, grad = torch.randn(6, 16, 64), torch.randn(6, 16, 64)
    counts = {}
    for name, convolve in (("ours", new_convolve), ("tap loop", tap_loop_convolve)):
        with OpCounter() as counter:
            conv_pair_step(conv, x, grad, convolve)
        counts[name] = len([op for op in counter.ops if op not in VIEWS])
    assert counts["ours"] < counts["tap loop"], counts


VIEWS = ("view", "_unsafe_view", "t", "detach", "select", "slice", "unsqueeze", "squeeze", "alias", "expand")
"""Operators that launch no kernel (views of a tensor's storage)."""


def drafter_step(drafter, batch, blocks, masks):
    drafter.zero_grad(set_to_none=True)
    hidden = drafter(batch.aux_hidden, blocks, masks)
    loss, metrics = drafter.objective(hidden, blocks)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("missing_gold", ["inject", "exclude"])
def test_the_dflash2_step_equals_the_tap_loop_and_indexed_codebooks(monkeypatch, missing_gold):
    """The whole step (layers, selector loss, metrics, every gradient), fp32: today's path against the convolution
    and the selector term as written before."""
    config = dflash2_config(block_size=8, head_dim=16, conv_kernel_size=3, selector_missing_gold=missing_gold)
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config)))
    batch = random_batch([300, 90, 200], config, seed=2, supervised_fraction=0.9)
    blocks = build_blocks(batch, 48, 8, config.mask_token_id, torch.Generator().manual_seed(0))
    masks = build_masks(blocks, config, form="dense")
    with OpCounter() as counter:
        loss, metrics, grads = drafter_step(drafter, batch, blocks, masks)
    assert counter.host_reads == []  # no synchronisation in the step's forward or backward
    monkeypatch.setattr(GroupedDynamicCausalConv, "convolve", tap_loop_convolve)
    monkeypatch.setattr(CandidateSelector, "pairwise", indexed_pairwise)
    ref_loss, ref_metrics, ref_grads = drafter_step(drafter, batch, blocks, masks)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for key in ("tau", "unary_tau", "selector/recall", "selector/accuracy", "selector/loss"):
        torch.testing.assert_close(metrics[key], ref_metrics[key], rtol=1e-5, atol=1e-5, msg=key)
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_the_traced_convolution_is_the_functions():
    """What a compiler traces (the convolution out of place, differentiated by autograd) equals CausalConvFunction,
    its output and the three gradients, in float64."""
    from common.drafter.dflash2.model import CausalConvFunction, _conv_traced

    gen = torch.Generator().manual_seed(0)
    x, base, deltas, grad = (
        torch.randn(shape, generator=gen, dtype=torch.float64)
        for shape in ((4, 9, 3, 5), (3, 3, 5), (4, 9, 3, 3), (4, 9, 3, 5))
    )
    results = []
    for fn in (_conv_traced, CausalConvFunction.apply):
        inputs = [t.clone().requires_grad_() for t in (x, base, deltas)]
        out = fn(*inputs)
        results.append((out, *torch.autograd.grad(out, inputs, grad)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_compiled_convolution_equals_the_eager_one(dtype):
    """On CUDA a training step runs the convolution compiled: its output and gradients are as close to the exact ones
    (float64) as the eager function's. Compiled and eager differ by rounding alone (the compiled kernels keep fused
    sums in fp32 where the eager ones round after each op), so each is held to the exact values, not to the other:
    where terms cancel, two correct roundings of a sum differ by more than a tolerance relative to the sum."""
    from common.drafter.dflash2.model import _apply_conv

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 16, 36, 16, device="cuda", generator=gen).to(dtype)
    kernel = torch.randn(2, 2, 576, device="cuda", generator=gen)  # fp32, as master weights are
    deltas = torch.randn(64, 16, 2, 2, 36, device="cuda", generator=gen).to(dtype)
    grad = torch.randn(64, 16, 36, 16, device="cuda", generator=gen).to(dtype)
    names = ("out", "x", "base", "deltas")

    def run(fn, *inputs):
        inputs = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*inputs, side)
        return (out, *torch.autograd.grad(out, inputs, grad.to(out.dtype)))

    floor = 1e-6 if dtype == torch.float32 else 1e-2  # relative to each result's largest value
    for side in (0, 1):
        exact = run(_apply_conv, x.double(), kernel.double(), deltas.double())
        eager, compiled = run(_apply_conv, x, kernel, deltas), run(causal_conv, x, kernel, deltas)
        for name, want, a, b in zip(names, exact, eager, compiled):
            scale = want.detach().abs().max()
            eager_error = float((a.detach().double() - want).abs().max() / scale)
            compiled_error = float((b.detach().double() - want).abs().max() / scale)
            assert b.dtype == a.dtype, name
            assert compiled_error <= max(2 * eager_error, floor), (side, name, compiled_error, eager_error)


def test_the_step_benchmark_writes_a_profile(tmp_path, monkeypatch, capsys):
    """``launch.bench.step --profile DIR``: torch.profiler tables per row (by time, then by calls), after a summary of
    kernels, host reads (synchronisations on CUDA) and busy time per step."""
    import json
    import sys

    from launch.bench import step

    argv = ["step", "--tiny", "--kinds", "dflash2", "--variants", "eager", "--steps", "1", "--warmup", "1"]
    # A small reference matmul: the default 1024^3 in bf16 runs at about 1 GFLOP/s on a CPU without bf16 units,
    # 23 of them were 55 s of this test; the rate is only the MFU's denominator, which nothing here reads.
    profile = ["--profile", str(tmp_path), "--profile-steps", "1", "--seq-len", "64", "--num-anchors", "8"]
    monkeypatch.setattr(sys, "argv", [*argv, *profile, "--matmul-size", "64"])
    step.main()
    text = (tmp_path / "profile_tiny_dflash2_eager.txt").read_text()
    summary = json.loads(text[: text.index("\n\n")])
    assert summary["steps"] == 1 and summary["aten_ops_per_step"] > 0
    assert "Self CPU" in text  # the operator table
    by_calls = text[text.index("By calls:") :]  # and the same operators by calls: the long tail of small kernels
    assert "Self CPU" in by_calls and "aten::" in by_calls
    assert '"name": "tiny_dflash2_eager"' in capsys.readouterr().out

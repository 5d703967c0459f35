"""trainer/optim.py: AdamW, or Muon for the drafter's matrices with AdamW for the rest, as one optimizer."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from common.drafter.model import DFlashDrafter
from tests.drafter_fixtures import random_head, tiny_config
from trainer.optim import RULE_KEY, MuonAdamW, build_optimizer, muon_param_groups, newton_schulz

PRODUCTS = ("aten::mm", "aten::bmm", "aten::matmul", "aten::addmm", "aten::baddbmm")
"""The operators a matrix product issues directly."""
MATRICES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def drafter(**overrides) -> DFlashDrafter:
    torch.manual_seed(0)
    config = tiny_config(**overrides)
    return DFlashDrafter(config, random_head(config))


def set_grads(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) if p.requires_grad else None


def names_of(model: nn.Module, optimizer: torch.optim.Optimizer, rule: str) -> set[str]:
    ids = {id(p) for group in optimizer.param_groups if group[RULE_KEY] == rule for p in group["params"]}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def test_which_parameters_follow_muon_and_which_adamw():
    model = drafter(attention_bias=True)
    frozen = {"layers.0.mlp.up_proj.weight", "layers.1.input_layernorm.weight"}
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    optimizer = build_optimizer(model, "muon", lr=1e-3, weight_decay=0.1, fused=False)
    assert isinstance(optimizer, MuonAdamW)
    matrices = {"fc.weight"} | {f"layers.{i}.{m}.weight" for i in range(2) for m in MATRICES}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert names_of(model, optimizer, "muon") == matrices - frozen
    adamw = names_of(model, optimizer, "adamw")
    assert adamw == trainable - matrices
    assert "hidden_norm.weight" in adamw and "norm.weight" in adamw and "layers.0.self_attn.q_proj.bias" in adamw
    assert "layers.1.self_attn.q_norm.weight" in adamw
    assert not frozen & (names_of(model, optimizer, "muon") | adamw), "frozen parameters are in no group"
    # The target's frozen embedding / lm_head are buffers: in no group either.
    everything = [p for group in optimizer.param_groups for p in group["params"]]
    assert not {id(model.target_head.embed_weight), id(model.target_head.lm_head_weight)} & {id(p) for p in everything}
    # Numbered in the drafter's parameter order (the checkpoint format of trainer/sharding.py); runs alternate.
    assert [id(p) for p in everything] == [id(p) for p in model.parameters() if p.requires_grad]
    rules = [group[RULE_KEY] for group in optimizer.param_groups]
    assert all(a != b for a, b in zip(rules, rules[1:]))
    assert all(p.ndim == 2 for group in optimizer.param_groups if group[RULE_KEY] == "muon" for p in group["params"])


def test_embeddings_and_output_heads_stay_on_adamw():
    model = nn.ModuleDict({"embed": nn.Embedding(10, 8), "body": nn.Linear(8, 8), "lm_head": nn.Linear(8, 10)})
    groups = muon_param_groups(model)
    muon = {id(p) for g in groups if g[RULE_KEY] == "muon" for p in g["params"]}
    assert muon == {id(model["body"].weight)}


def reference_muon(weight: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float) -> torch.Tensor:
    """Muon written out: momentum as a sum (B = mu B + g, Nesterov g + mu B: a multiple of the trainer's
    average, which the normalisation removes), five quintic Newton-Schulz steps on the wide orientation,
    the Moonlight scale 0.2 sqrt(max(rows, cols)), decoupled weight decay."""
    mu, (a, b, c) = 0.95, (3.4445, -4.7750, 2.0315)
    w, buf = weight.clone().double(), torch.zeros_like(weight, dtype=torch.float64)
    for g in grads:
        g = g.double()
        buf = mu * buf + g
        x = (g + mu * buf).T  # [24, 40]: rows <= cols
        x = x / x.norm()
        for _ in range(5):
            gram = x @ x.T
            x = a * x + b * gram @ x + c * gram @ gram @ x
        w = w * (1 - lr * wd) - lr * 0.2 * math.sqrt(40) * x.T
    return w.float()


def test_muon_update_equals_the_reference_and_is_orthogonal():
    layer = nn.Linear(24, 40, bias=False)  # a tall matrix: the transposed orientation
    start = layer.weight.detach().clone()
    lr, wd = 0.02, 0.1
    optimizer = build_optimizer(layer, "muon", lr=lr, weight_decay=wd, fused=False)
    assert [g[RULE_KEY] for g in optimizer.param_groups] == ["muon"]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(40, 24, generator=gen) * torch.linspace(0.1, 3, 24) for _ in range(3)]
    for grad in grads:
        layer.weight.grad = grad.clone()
        before = layer.weight.detach().clone()
        optimizer.step()
    torch.testing.assert_close(layer.weight.detach(), reference_muon(start, grads, lr, wd), rtol=0, atol=2e-6)
    # The last update (weight decay taken out) is nearly orthogonal, though the gradient's spectrum is spread.
    update = (before * (1 - lr * wd) - layer.weight.detach()) / lr
    singular = torch.linalg.svdvals(update / (0.2 * math.sqrt(40)))
    spread = torch.linalg.svdvals(grads[-1])
    assert spread.max() / spread.min() > 20
    assert singular.min() > 0.6 and singular.max() < 1.25, singular
    # RMS like AdamW's update: about 0.2 per unit lr.
    assert 0.14 < update.pow(2).mean().sqrt() < 0.25


def test_newton_schulz_runs_in_fp32_on_the_cpu():
    x = torch.randn(8, 16, dtype=torch.float64)
    assert newton_schulz(x).dtype == torch.float32
    assert newton_schulz(x, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        newton_schulz(torch.randn(4))


def test_matrices_stacked_by_shape_orthogonalise_as_each_alone(monkeypatch):
    """Wide, tall and square matrices, a wide and a tall one of the same shape sharing a stack, and stacks split at
    the element limit: each comes out as its own iteration gives it, in its own orientation."""
    import trainer.optim as optim

    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 16), (16, 8), (8, 16), (12, 12), (4, 16), (16, 4), (12, 12), (8, 16)]
    matrices = [torch.randn(*shape, generator=gen) for shape in shapes]
    for limit in (optim.NS_STACK_ELEMENTS, 2 * 8 * 16):  # all of a shape at once; at most two at a time
        monkeypatch.setattr(optim, "NS_STACK_ELEMENTS", limit)
        stacked = optim.newton_schulz_many(matrices)
        for matrix, out in zip(matrices, stacked):
            assert out.shape == matrix.shape and out.dtype == torch.float32
            torch.testing.assert_close(out, newton_schulz(matrix), rtol=0, atol=1e-6)


def test_a_muon_step_launches_per_shape_not_per_matrix():
    """The drafter's matrices sit in one param group per run of a rule (the checkpoint's numbering), a dozen groups
    for two layers; they step together: the Newton-Schulz products of a step are five iterations' three for each
    shape, however many layers hold matrices of that shape."""
    from torch.profiler import profile

    counts = []
    for layers in (2, 8):
        model = drafter(num_hidden_layers=layers)
        optimizer = build_optimizer(model, "muon", lr=1e-2, weight_decay=0.01, fused=False)
        set_grads(model, 0)
        shapes = {tuple(sorted(p.shape)) for g in optimizer.param_groups if g[RULE_KEY] == "muon" for p in g["params"]}
        with profile() as prof:
            optimizer.step()
        step = next(e for e in prof.events() if e.name.startswith("Optimizer.step"))
        products = sum(1 for e in prof.events() if e.cpu_parent is step and e.name in PRODUCTS)
        counts.append((products, 15 * len(shapes)))
    assert counts[0] == counts[1] and counts[0][0] == counts[0][1], counts


def test_groups_with_their_own_settings_step_with_them():
    """Groups that step together share every setting: one with its own lr keeps it."""
    first, second = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)
    models = [copy.deepcopy(first), copy.deepcopy(second)]
    together = MuonAdamW(
        [{"params": [first.weight], RULE_KEY: "muon"}, {"params": [second.weight], RULE_KEY: "muon", "lr": 0.1}],
        lr=0.01,
    )
    alone = [
        MuonAdamW([{"params": [models[0].weight], RULE_KEY: "muon"}], lr=0.01),
        MuonAdamW([{"params": [models[1].weight], RULE_KEY: "muon"}], lr=0.1),
    ]
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        grads = [torch.randn(16, 8, generator=gen) for _ in range(2)]
        for weight, grad in zip((first.weight, second.weight, models[0].weight, models[1].weight), grads * 2):
            weight.grad = grad.clone()
        together.step()
        for optimizer in alone:
            optimizer.step()
    torch.testing.assert_close(first.weight, models[0].weight, rtol=0, atol=0)
    torch.testing.assert_close(second.weight, models[1].weight, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_is_torchs_adamw(fused):
    model = drafter()
    twin = copy.deepcopy(model)
    optimizer = build_optimizer(model, "adamw", lr=1e-2, weight_decay=0.1, fused=fused)
    assert type(optimizer) is torch.optim.AdamW and optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    reference = torch.optim.AdamW(
        [p for p in twin.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), fused=fused
    )
    # The AdamW groups of "muon" follow the same step, bit for bit, on the parameters they hold.
    mixed_model = copy.deepcopy(model)
    mixed = build_optimizer(mixed_model, "muon", lr=1e-2, weight_decay=0.1, fused=fused)
    for step in range(3):
        for m in (model, twin, mixed_model):
            set_grads(m, step)
        optimizer.step()
        reference.step()
        mixed.step()
    adamw_names = names_of(mixed_model, mixed, "adamw")
    for (name, p), q, r in zip(model.named_parameters(), twin.parameters(), mixed_model.parameters()):
        assert torch.equal(p, q), name
        if name in adamw_names:
            assert torch.equal(p, r), name
        else:
            assert not torch.equal(p, r), name


def round_trip(state: dict) -> dict:
    """Through torch.save / torch.load, as a checkpoint's train state goes."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_round_trip_resumes_exactly():
    model = drafter()
    optimizer = build_optimizer(model, "muon", lr=1e-2, weight_decay=0.1, fused=False)
    for step in range(2):
        set_grads(model, step)
        optimizer.step()
    state = round_trip(optimizer.state_dict())
    assert [g[RULE_KEY] for g in state["param_groups"]] == [g[RULE_KEY] for g in optimizer.param_groups]
    resumed_model = copy.deepcopy(model)
    resumed = build_optimizer(resumed_model, "muon", lr=1e-3, weight_decay=0.0, fused=False)
    resumed.load_state_dict(state)
    assert [{k: v for k, v in g.items() if k != "params"} for g in resumed.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
    ]
    fresh_model = copy.deepcopy(model)
    fresh = build_optimizer(fresh_model, "muon", lr=1e-2, weight_decay=0.1, fused=False)  # no state: differs
    for m, opt in ((model, optimizer), (resumed_model, resumed), (fresh_model, fresh)):
        set_grads(m, 2)
        opt.step()
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(model.fc.weight, fresh_model.fc.weight)
    assert not torch.equal(model.norm.weight, fresh_model.norm.weight)


def test_state_of_another_optimizer_is_refused():
    model = drafter()
    adamw = build_optimizer(model, "adamw", lr=1e-2, weight_decay=0.0, fused=False)
    set_grads(model, 0)
    adamw.step()
    muon = build_optimizer(model, "muon", lr=1e-2, weight_decay=0.0, fused=False)
    with pytest.raises(ValueError, match="not of this optimizer"):
        muon.load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="optimizer must be one of"):
        build_optimizer(model, "sgd", lr=1e-2, weight_decay=0.0, fused=False)


def test_lambda_lr_scales_both_kinds_of_group():
    model = drafter()
    scaled_model = copy.deepcopy(model)
    plain = build_optimizer(model, "muon", lr=1e-2, weight_decay=0.0, fused=False)
    scaled = build_optimizer(scaled_model, "muon", lr=1e-2, weight_decay=0.0, fused=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(scaled, lambda step: 0.5 if step == 0 else 0.25)
    assert {g[RULE_KEY] for g in scaled.param_groups} == {"muon", "adamw"}
    assert all(g["lr"] == 5e-3 and g["initial_lr"] == 1e-2 for g in scaled.param_groups)
    start = copy.deepcopy(model)
    for m, opt in ((model, plain), (scaled_model, scaled)):
        set_grads(m, 0)
        opt.step()
    scheduler.step()
    assert {g["lr"] for g in scaled.param_groups} == {2.5e-3}
    # Half the lr, half the step (AdamW's first step and Muon's are both linear in lr).
    for (name, p0), p, q in zip(start.named_parameters(), model.parameters(), scaled_model.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q - p0, 0.5 * (p - p0), rtol=1e-4, atol=1e-7, msg=name)
            assert (p - p0).abs().max() > 1e-4, name


def test_muon_lowers_a_regression_loss():
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = torch.tanh(x @ torch.randn(16, 24)) @ torch.randn(24, 4)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = build_optimizer(model, "muon", lr=0.1, weight_decay=0.0, fused=False)
    assert [g[RULE_KEY] for g in optimizer.param_groups] == ["muon", "adamw", "muon", "adamw"]
    losses = []
    for _ in range(40):
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.25 * losses[0], losses


def test_muon_refuses_fsdp_shards(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        layer = nn.Linear(8, 8, bias=False)
        mesh = init_device_mesh("cpu", (1,))
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
        with pytest.raises(ValueError, match="FSDP"):
            build_optimizer(layer, "muon", lr=1e-2, weight_decay=0.0, fused=False)
    finally:
        dist.destroy_process_group()


def test_a_trainer_resumes_muon_exactly_and_starts_a_new_optimizer_state_when_the_choice_changes(short_tmp):
    """A real Trainer on the tiny config: a Muon checkpoint resumes with the same optimizer state; a restart that
    switches to AdamW keeps the weights and the schedule's step, starts the optimizer state anew, and sets every
    parameter group's learning rate (Muon has more groups than AdamW)."""
    from tests.test_checkpoint import make_trainer, optimizer_step
    from trainer.checkpoint import read_train_state
    from trainer.train import Trainer

    trainer = make_trainer(
        short_tmp / "run", 'training.optimizer="muon"', "training.async_checkpoint=false", "training.max_steps=100"
    )
    try:
        optimizer_step(trainer, seed=1)
        trainer.scheduler.step()
        trainer.step = 1
        weights = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
        trainer.save_checkpoint()
        assert read_train_state(trainer.run_dir.latest_checkpoint())["optimizer_name"] == "muon"
    finally:
        trainer.close()
    cfg, run = trainer.cfg, trainer.run_dir

    again = Trainer(cfg, run)
    try:
        assert again.step == 1 and isinstance(again.optimizer, MuonAdamW)
        momenta = [again.optimizer.state[p] for group in again.optimizer.param_groups for p in group["params"]]
        assert momenta and all(state for state in momenta), "the optimizer state came back"
    finally:
        again.close()

    switched_cfg = copy.deepcopy(cfg)
    switched_cfg.training.optimizer = "adamw"
    switched = Trainer(switched_cfg, run)
    try:
        assert switched.step == 1 and isinstance(switched.optimizer, torch.optim.AdamW)
        assert not switched.optimizer.state, "a new optimizer state"
        for name, value in switched.drafter.state_dict().items():
            assert torch.equal(value, weights[name]), name
        expected = cfg.training.lr * switched.scheduler.lr_lambdas[0](1)
        assert [g["lr"] for g in switched.optimizer.param_groups] == [expected] * len(switched.optimizer.param_groups)
        switched.scheduler.step()  # one lambda per group: the schedule steps on
    finally:
        switched.close()


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_a_restart_that_changes_the_weight_decay_steps_with_the_new_one(short_tmp, optimizer):
    """training.weight_decay may change at restart-trainer: the optimizer's state comes from the checkpoint, its
    groups' weight decay from the new config (loading a state dict alone would bring back the old one)."""
    from tests.test_checkpoint import make_trainer, optimizer_step
    from trainer.train import Trainer

    trainer = make_trainer(
        short_tmp / "run",
        f'training.optimizer="{optimizer}"',
        "training.weight_decay=0.1",
        "training.async_checkpoint=false",
        "training.max_steps=100",
    )
    try:
        optimizer_step(trainer, seed=1)
        trainer.scheduler.step()
        trainer.step = 1
        trainer.save_checkpoint()
    finally:
        trainer.close()
    changed = copy.deepcopy(trainer.cfg)
    changed.training.weight_decay = 0.0
    again = Trainer(changed, trainer.run_dir)
    try:
        assert again.step == 1 and again.optimizer.state, "the optimizer state came back"
        assert {group["weight_decay"] for group in again.optimizer.param_groups} == {0.0}
    finally:
        again.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_muon_on_cuda_follows_the_cpu_steps():
    """On CUDA the Newton-Schulz iteration runs in bf16 and the AdamW groups use the fused kernel: a few steps of the
    drafter stay within bf16 rounding of the same steps on the CPU (fp32)."""
    cpu_model = drafter()
    cuda_model = copy.deepcopy(cpu_model).cuda()
    cpu_opt = build_optimizer(cpu_model, "muon", lr=1e-2, weight_decay=0.01, fused=False)
    cuda_opt = build_optimizer(cuda_model, "muon", lr=1e-2, weight_decay=0.01, fused=True)
    for seed in range(3):
        set_grads(cpu_model, seed)
        for (_, p), (_, q) in zip(cpu_model.named_parameters(), cuda_model.named_parameters()):
            q.grad = None if p.grad is None else p.grad.cuda()
        cpu_opt.step()
        cuda_opt.step()
    for (name, p), (_, q) in zip(cpu_model.named_parameters(), cuda_model.named_parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=2e-3, rtol=2e-2, msg=name)


def test_the_adamw_groups_of_muon_step_as_torchs_adamw_with_weight_decay():
    """The AdamW half of MuonAdamW is torch's AdamW step (decoupled weight decay), through the functional form
    every torch this project allows has."""
    torch.manual_seed(0)
    ours, theirs = nn.Parameter(torch.randn(7)), nn.Parameter(torch.zeros(7))
    theirs.data.copy_(ours.data)
    mixed = MuonAdamW([{"params": [ours], RULE_KEY: "adamw"}], lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(
        [theirs], lr=1e-2, weight_decay=0.1, betas=mixed.param_groups[0]["betas"], eps=mixed.param_groups[0]["eps"]
    )
    for _ in range(5):
        grad = torch.randn(7)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mixed.step()
        plain.step()
    assert torch.equal(ours, theirs)

"""The trainer's optimizer (``training.optimizer``): AdamW, or Muon for the drafter's weight matrices; its
learning-rate schedule (``lr_lambda``); and ``Optimization``, the trainer's component that holds both with the RNGs
and saves and restores their state.

``build_optimizer(model, "adamw", ...)`` is torch's AdamW over every trainable parameter, betas (0.9, 0.95).

``build_optimizer(model, "muon", ...)`` is one :class:`MuonAdamW`: one ``torch.optim.Optimizer``, so the
LR scheduler, ``state_dict`` / ``load_state_dict`` and a reset of every group's ``"lr"`` work as with AdamW.
Its param groups say which rule they follow in the group key ``"rule"`` (saved and restored with the state):

- ``"muon"``: the weight of every trainable ``nn.Linear`` (2-D) except an output head named ``lm_head``; in
  the DFlash drafter that is ``fc`` and each layer's q/k/v/o and gate/up/down projections. Update (``g`` the
  gradient, ``B`` the momentum buffer, ``mu`` 0.95)::

      B <- mu B + (1 - mu) g                       (an average; its scale drops out in the normalisation)
      U <- (1 - mu) g + mu B                       (Nesterov; U <- B without it)
      O <- NewtonSchulz5(U)                        (~ U V^T of U's SVD: singular values in about [0.7, 1.2])
      W <- W (1 - lr wd) - lr * 0.2 sqrt(max(rows, cols)) * O

  An orthogonal [rows, cols] matrix has RMS 1 / sqrt(max(rows, cols)), so the scaled update has RMS about 0.2,
  AdamW's typical update RMS (the Moonlight rule, "Muon is Scalable for LLM Training"): the same peak lr,
  warmup and decay serve both rules, and ``training.lr`` keeps its meaning. The Newton-Schulz iteration runs
  in bf16 on CUDA and in fp32 elsewhere, the matrices of one shape stacked into one batched iteration
  (``newton_schulz_many``), and every group of one rule and the same settings steps together: a small drafter's
  step is a few dozen kernels a shape, not a few dozen a matrix.
- ``"adamw"``: everything else that trains (norm weights, biases, any other non-matrix), exactly torch's
  AdamW step (its functional, fused on CUDA when asked), betas (0.9, 0.95), eps 1e-8.

Groups are consecutive runs of parameters of one rule in ``model.named_parameters()`` order, so the
optimizer numbers its parameters in the drafter's parameter order, as AdamW over ``parameters()`` does: the
checkpoint format trainer/sharding.py documents (``Optimizer.state_dict()`` numbering = parameter order).
Frozen parameters (``requires_grad`` False) are in no group.

Muon needs each matrix whole: a shard of an FSDP DTensor cannot be orthogonalised on its own, so building
Muon over sharded parameters raises (use DDP, whose ranks hold whole replicated weights and all-reduced
gradients and so compute the same update).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw as adamw_functional  # in every torch this project allows (>= 2.6)

from common.config import RunConfig
from trainer.budget import TimeBudget
from trainer.ranks import Ranks
from trainer.sharding import full_tensor, is_sharded, load_full_optimizer_state

OPTIMIZERS = ("adamw", "muon")
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8
MUON_MOMENTUM = 0.95
MUON_RMS = 0.2
"""RMS of a Muon update at lr 1 (before weight decay): AdamW's typical update RMS (the Moonlight rule)."""
# Keller Jordan's quintic Newton-Schulz coefficients: the steepest slope at zero that still lands the
# singular values in about [0.7, 1.2] after five steps (https://kellerjordan.github.io/posts/muon/).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
NS_STACK_ELEMENTS = 2**27
"""The most elements Newton-Schulz stacks into one iteration (256 MiB in bf16; its temporaries are a few times
that): a small drafter's matrices of one shape all at once, a Qwen3-8B draft's MLP matrices two at a time."""
RULE_KEY = "rule"
"""The param-group key naming the update rule of the group: "muon" or "adamw"."""

log = logging.getLogger(__name__)


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float, fused: bool) -> torch.optim.Optimizer:
    """The optimizer of ``model``'s trainable parameters: ``name`` "adamw" or "muon" (see the module's doc).

    ``fused``: torch's fused AdamW kernel (CUDA); for "muon" it applies to the AdamW groups.
    """
    if name == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        _say(f"optimizer adamw: AdamW for every trained tensor ({len(params)})")
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=ADAMW_BETAS, fused=fused)
    if name == "muon":
        groups = muon_param_groups(model)
        matrices = sum(len(g["params"]) for g in groups if g[RULE_KEY] == "muon")
        others = sum(len(g["params"]) for g in groups if g[RULE_KEY] == "adamw")
        _say(f"optimizer muon: Muon for {matrices} weight matrices, AdamW for {others} other trained tensors")
        return MuonAdamW(groups, lr=lr, weight_decay=weight_decay, fused=fused)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def _say(line: str) -> None:
    """Log which optimizer was built, once per trainer (rank 0 of a group); why is training.optimizer's (check says
    it, and the trainer warns where auto falls back to AdamW under FSDP)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        log.info(line)


def is_muon_parameter(module_name: str, module: nn.Module, param: torch.Tensor) -> bool:
    """Whether ``param`` (owned by ``module``, named ``module_name`` in the model) follows Muon: a trainable
    2-D ``nn.Linear`` weight that is no output head. Embeddings are ``nn.Embedding`` and so never are."""
    return (
        param.requires_grad
        and param.ndim == 2
        and isinstance(module, nn.Linear)
        and param is module.weight
        and module_name.rsplit(".", 1)[-1] != "lm_head"
    )


def muon_param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """``model``'s trainable parameters as param groups ``{"params": [...], "rule": "muon" | "adamw"}``: one
    group per consecutive run of one rule in ``named_parameters()`` order (so the groups' concatenation is
    that order). Frozen parameters are left out."""
    owner: dict[int, tuple[str, nn.Module]] = {}
    for module_name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owner.setdefault(id(param), (module_name, module))
    groups: list[dict[str, Any]] = []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        rule = "muon" if is_muon_parameter(*owner[id(param)], param) else "adamw"
        if groups and groups[-1][RULE_KEY] == rule:
            groups[-1]["params"].append(param)
        else:
            groups.append({"params": [param], RULE_KEY: rule})
    return groups


def newton_schulz(
    matrix: torch.Tensor, steps: int = NS_STEPS, eps: float = NS_EPS, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """An approximate orthogonalisation of 2-D ``matrix`` (its U V^T, singular values pushed to about 1) by
    ``steps`` quintic Newton-Schulz iterations, computed in ``dtype`` (bf16 on CUDA, fp32 elsewhere by
    default); returned in that dtype."""
    return newton_schulz_many([matrix], steps, eps, dtype)[0]


def newton_schulz_many(
    matrices: Sequence[torch.Tensor], steps: int = NS_STEPS, eps: float = NS_EPS, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """``newton_schulz`` of each of ``matrices``: those of one shape (in the wide orientation) iterate together as
    one stack, up to ``NS_STACK_ELEMENTS`` at a time, so that a step costs a few dozen kernels per shape rather than
    per matrix (a small drafter's 57 matrices, one by one, launched some 3,000 kernels a step)."""
    shapes: dict[tuple[int, int], list[int]] = {}
    for index, matrix in enumerate(matrices):
        if matrix.ndim != 2:
            raise ValueError(f"Newton-Schulz needs a matrix, got shape {tuple(matrix.shape)}")
        shapes.setdefault((min(matrix.shape), max(matrix.shape)), []).append(index)
    done: list[torch.Tensor | None] = [None] * len(matrices)
    for (short, long), indices in shapes.items():
        at_once = max(1, NS_STACK_ELEMENTS // (short * long))
        for first in range(0, len(indices), at_once):
            members = indices[first : first + at_once]
            # iterate on the wide orientation: the Gram matrix is the smaller one
            tall = [matrices[i].shape[0] > matrices[i].shape[1] for i in members]
            x = torch.stack([matrices[i].T if t else matrices[i] for i, t in zip(members, tall)])
            x = _newton_schulz_stack(x, steps, eps, dtype or _ns_dtype(x.device))
            for row, (i, t) in enumerate(zip(members, tall)):
                done[i] = x[row].T if t else x[row]
    return done  # type: ignore[return-value]


def _ns_dtype(device: torch.device) -> torch.dtype:
    """The Newton-Schulz iteration's dtype: bf16 on CUDA, fp32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _newton_schulz_stack(x: torch.Tensor, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The quintic iteration on a stack ``[n, rows, cols]`` of wide matrices (rows <= cols), each on its own."""
    a, b, c = NS_COEFFICIENTS
    x = x.to(dtype)
    # Frobenius norm >= spectral norm: every singular value starts in [0, 1], where the iteration converges.
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):  # x <- a x + (b G + c G^2) x, G = x x^T: three products, their sums in their epilogues
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


def muon_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """The factor on lr of a Muon update of a ``shape`` matrix: its RMS then matches AdamW's (about 0.2)."""
    return MUON_RMS * math.sqrt(max(shape[0], shape[1]))


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the param groups whose ``"rule"`` is "muon", AdamW for those whose rule is "adamw"; one
    optimizer with one state (see the module's doc). Every group shares ``lr`` and ``weight_decay`` unless a
    group sets its own."""

    def __init__(
        self,
        param_groups: Iterable[dict[str, Any]],
        lr: float,
        weight_decay: float = 0.0,
        fused: bool = False,
        momentum: float = MUON_MOMENTUM,
        nesterov: bool = True,
        ns_steps: int = NS_STEPS,
        betas: tuple[float, float] = ADAMW_BETAS,
        eps: float = ADAMW_EPS,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self._rule_defaults = {
            "muon": {"momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps},
            "adamw": {"betas": tuple(betas), "eps": eps, "fused": fused},
        }
        super().__init__(list(param_groups), {"lr": lr, "weight_decay": weight_decay})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        rule = param_group.get(RULE_KEY)
        if rule not in self._rule_defaults:
            raise ValueError(f"each param group needs {RULE_KEY!r} 'muon' or 'adamw', got {rule!r}")
        param_group = {**self._rule_defaults[rule], **param_group}
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if rule == "muon" and p.ndim != 2:
                raise ValueError(f"Muon takes matrices only, got a parameter of shape {tuple(p.shape)}")
            if rule == "muon" and is_sharded(p):
                raise ValueError(
                    "Muon cannot orthogonalise an FSDP-sharded (DTensor) matrix shard by shard; "
                    "train with optimizer adamw under FSDP, or with parallelism ddp"
                )
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, after checking that the saved groups follow the same rules (a checkpoint of another
        optimizer, or of another split of the parameters, is refused with a clear error)."""
        saved = [group.get(RULE_KEY) for group in state_dict["param_groups"]]
        ours = [group[RULE_KEY] for group in self.param_groups]
        if saved != ours:
            raise ValueError(
                f"the optimizer state to load is not of this optimizer: its param groups follow "
                f"rules {saved}, this one's {ours} (was the optimizer, or the model, changed?)"
            )
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # The groups are runs of one rule in parameter order (the checkpoint's numbering), so a drafter's matrices
        # are in a dozen groups: those of one rule and the same settings step together, in a few kernels.
        runs: dict[tuple, list[dict[str, Any]]] = {}
        for group in self.param_groups:
            settings = tuple(sorted((k, v) for k, v in group.items() if k != "params"))
            runs.setdefault(settings, []).append(group)
        for groups in runs.values():
            settings = {k: v for k, v in groups[0].items() if k != "params"}
            params = [p for group in groups for p in group["params"] if p.grad is not None]
            if params and settings[RULE_KEY] == "muon":
                self._muon_step(params, settings)
            elif params:
                self._adamw_step(params, settings)
        return loss

    def _muon_step(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """The Muon update (the module's doc) of ``params``, matrices of groups with the same ``group`` settings, all
        at once: the momenta in two foreach kernels, the orthogonalisations stacked by shape
        (``newton_schulz_many``), the updates added by shape."""
        lr, weight_decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
        buffers = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buffers.append(state["momentum_buffer"])
        grads = [p.grad.to(buf.dtype) for p, buf in zip(params, buffers)]
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
        orthos = newton_schulz_many(updates, group["ns_steps"])
        if weight_decay:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        shapes: dict[tuple[int, ...], list[int]] = {}
        for index, p in enumerate(params):
            shapes.setdefault(tuple(p.shape), []).append(index)
        for shape, indices in shapes.items():  # one scale a shape; each add casts its bf16 step on the way
            torch._foreach_add_(
                [params[i] for i in indices], [orthos[i] for i in indices], alpha=-lr * muon_scale(shape)
            )

    def _adamw_step(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """torch's AdamW step (its functional: one fused kernel on CUDA when asked) of ``params``, tensors of groups
        with the same ``group`` settings."""
        grads, exp_avgs, exp_avg_sqs, steps = [], [], [], []
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state = self.state[p]
            if not state:
                # As torch's Adam: the step count on the device for the fused kernel, on the host otherwise.
                state["step"] = (
                    torch.zeros((), dtype=torch.float32, device=p.device)
                    if group["fused"]
                    else torch.tensor(0.0, dtype=torch.float32)
                )
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw_functional(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=None,
            fused=group["fused"],
            has_complex=any(torch.is_complex(p) for p in params),
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def lr_lambda(cfg: RunConfig, max_steps: int, budget: TimeBudget | None = None) -> Callable[[int], float]:
    """Linear warmup, then a cosine decay to ``min_lr_ratio`` of the peak, or with ``schedule = "wsd"`` the peak held
    until the last ``decay_ratio`` of the steps and a linear decay to the floor over them. Under a time budget the
    schedule is as far along as the larger of the steps and the clock, so a run the clock ends still decays."""
    warmup = max(1, int(cfg.training.warmup_ratio * max_steps))
    floor = cfg.training.min_lr_ratio
    decay_start = max(warmup, max_steps - int(round(cfg.training.decay_ratio * max_steps)))

    def cosine(step: int) -> float:
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def warmup_stable_decay(step: int) -> float:
        progress = min(1.0, max(0.0, (step - decay_start) / max(1, max_steps - decay_start)))
        return floor + (1 - floor) * (1 - progress)

    after_warmup = warmup_stable_decay if cfg.training.schedule == "wsd" else cosine

    def factor(step: int) -> float:
        if budget is not None:
            step = max(step, int(budget.fraction * max_steps))
        return (step + 1) / warmup if step < warmup else after_warmup(step)

    return factor


class Optimization:
    """The trainer's optimizer component: the optimizer, its learning-rate schedule and the RNGs a step draws from;
    their state is a checkpoint's ``train_state/``."""

    def __init__(self, cfg: RunConfig, drafter: nn.Module, ranks: Ranks, max_steps: int, budget: TimeBudget) -> None:
        self.cfg, self.drafter, self.ranks, self.max_steps, self.budget = cfg, drafter, ranks, max_steps, budget
        self.device = ranks.device
        self.optimizer = build_optimizer(
            drafter,
            cfg.training.resolved_optimizer,
            cfg.training.lr,
            cfg.training.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, max_steps, budget))
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.training.seed * 1000 + ranks.rank)
        if cfg.training.optimizer_fallback and ranks.rank == 0:
            log.warning(cfg.training.optimizer_fallback)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def step(self, clip: float) -> torch.Tensor:
        """Clip the gradients to ``clip``, step the optimizer and the schedule; the gradient norm before clipping
        (under FSDP reduced over every rank's shards and replicated)."""
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def state_dict(self, optimizer_state: dict | None) -> dict:
        """A checkpoint's train state: ``optimizer_state`` (of the whole drafter), the schedule and the RNGs."""
        return {
            "optimizer": optimizer_state,
            "optimizer_name": self.cfg.training.resolved_optimizer,
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),  # its lists are the scheduler's own
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.empty(0),
        }

    def load_state_dict(self, state: dict, step: int) -> None:
        """The optimizer's moments, the schedule's position and the RNGs of a checkpoint (or a state handed over) at
        ``step``. The settings of the optimizer's groups, the peak and the shape of the schedule stay this config's
        (a restart may change training.lr, weight_decay or the schedule; the device decides fused AdamW)."""
        trained_with, configured_optimizer = state["optimizer_name"], self.cfg.training.resolved_optimizer
        configured = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        if trained_with != configured_optimizer:
            log.warning(
                "training.optimizer is %s, the checkpoint's was %s: the weights and the schedule carry on, "
                "the optimizer state starts anew",
                configured_optimizer,
                trained_with,
            )
        elif self.ranks.sharded:
            load_full_optimizer_state(self.drafter, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        for group, settings in zip(self.optimizer.param_groups, configured):
            group.update(settings)
        self.scheduler.load_state_dict(state["scheduler"])
        # The optimizer may have another number of parameter groups: the schedule keeps its step, its peak and
        # shape are the new ones.
        groups, lr = self.optimizer.param_groups, self.cfg.training.lr
        self.scheduler.base_lrs = [lr] * len(groups)
        self.scheduler.lr_lambdas = [lr_lambda(self.cfg, self.max_steps, self.budget)] * len(groups)
        for group in groups:
            group["initial_lr"] = lr
            group["lr"] = lr * self.scheduler.lr_lambdas[0](step)
        # Copies: a state handed over is views into shared pages, which the RNG setters do not take.
        self.generator.set_state(state["generator"].clone())
        torch.set_rng_state(state["torch_rng"].clone())
        if self.device.type == "cuda" and state["cuda_rng"].numel():
            torch.cuda.set_rng_state(state["cuda_rng"].clone(), self.device)

"""The CPU's block-by-block AdamW is torch's AdamW bitwise: parameters, moments and step counts,
over parameter sizes that do and do not divide into blocks, two weight-decay groups, a
parameter without a gradient, a changing learning rate, and a resume from torch's state."""

from __future__ import annotations

import copy

import torch

from nanotron_train.blocked_adamw import blocked_adamw_step, supports_blocked
from nanotron_train.optim import AdamWOnPieces, Piece

SIZES = [(37, 29), (1000,), (3, 1000), (7,), (64, 64)]  # block 1000: edges on, off, inside


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SIZES]


def _adamw(params, **kw) -> torch.optim.AdamW:
    groups = [
        {"params": params[:3], "weight_decay": 0.1},
        {"params": params[3:], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **kw)


def _set_grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = None if i == 4 and step == 1 else torch.randn(p.shape, generator=g)


def _run(steps: int, blocked: bool, foreach: bool, start=None) -> torch.optim.AdamW:
    params = _params(0)
    opt = _adamw(params, foreach=foreach)
    if start is not None:
        with torch.no_grad():
            for p, q in zip(params, [q for g in start.param_groups for q in g["params"]]):
                p.copy_(q)
        opt.load_state_dict(copy.deepcopy(start.state_dict()))  # torch would alias the moments
    for step in range(1, steps + 1):
        _set_grads(params, step if start is None else step + 10)
        for group in opt.param_groups:
            group["lr"] = 1e-2 / step
        if blocked:
            blocked_adamw_step(opt, block=1000)
        else:
            opt.step()
    return opt


def _same(a: torch.optim.AdamW, b: torch.optim.AdamW) -> None:
    pa = [p for g in a.param_groups for p in g["params"]]
    pb = [p for g in b.param_groups for p in g["params"]]
    for p, q in zip(pa, pb, strict=True):
        assert torch.equal(p, q)
        sa, sb = a.state[p], b.state[q]
        assert sa.keys() == sb.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


def test_blocked_adamw_is_torch_adamw_bitwise():
    blocked = _run(3, blocked=True, foreach=False)
    _same(blocked, _run(3, blocked=False, foreach=False))
    _same(blocked, _run(3, blocked=False, foreach=True))
    # a parameter without a gradient on step 1 was stepped twice, not three times
    assert blocked.state[blocked.param_groups[1]["params"][1]]["step"].item() == 2.0
    # resumed from torch's state, two more steps: still bitwise
    _same(_run(2, True, False, start=blocked), _run(2, False, False, start=blocked))


def test_pieces_use_blocks_on_the_cpu_only_for_plain_adamw():
    p = torch.nn.Parameter(torch.randn(4, 8))
    piece = Piece("w", p, 0, 32, p.detach().view(-1), False, True, p.detach().view(-1),
                  torch.zeros(32))  # fmt: skip
    kw = {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
    assert AdamWOnPieces([piece], **kw).blocked
    assert not AdamWOnPieces([piece], **kw, fused=True).blocked
    assert not supports_blocked(torch.optim.AdamW([p], amsgrad=True))
    assert not supports_blocked(torch.optim.SGD([p], lr=0.1))


def test_blocks_are_made_once_and_no_scalar_is_copied():
    """As the trainer steps it (the same gradient tensors, rewritten in place each step): the
    blocks' views are made on the first step and reused, still bitwise torch's AdamW, and a
    step runs no scalar copy (an op given a Python float copies it into a 0-d tensor first)
    and no per-parameter Python call (a few foreach calls per block: the small ones share)."""
    ref, ours = _params(0), _params(0)
    for p in ref + ours:
        p.grad = torch.zeros(p.shape)
    opt_ref, opt = _adamw(ref, foreach=False), _adamw(ours, foreach=False)
    made = []
    for step in range(1, 4):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ref, ours):
            q.grad.copy_(p.grad.copy_(torch.randn(p.shape, generator=g)))
        opt_ref.step()
        with torch.profiler.profile() as prof:
            blocked_adamw_step(opt, block=1000)
        made.append([blocks for _, _, blocks in opt._nanotron_blocks.values()])
    _same(opt, opt_ref)
    assert all(a is b for a, b in zip(made[1], made[2]))  # the same blocks' views
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::_to_copy", 0) == 0 and counts.get("aten::copy_", 0) == 0
    # group 1: 1073 + 1000 + 3000 elements in 6 blocks; group 2: 7 + 4096 in 5 (the 7 shares)
    assert [len(b) for b in made[2]] == [6, 5]
    assert counts["aten::_foreach_addcdiv_"] == 11
    # the step counters are not read back (kept on the host), the constants made once: per
    # step only each group's bias correction and group 1's decay factor are new 0-d tensors
    assert counts.get("aten::item", 0) == 0
    assert counts["aten::scalar_tensor"] == 3


def test_step_counters_written_elsewhere_are_read_again():
    """A counter changed in place (as a loader copying into the state would) or replaced is
    read again, so the bias corrections follow torch's AdamW bitwise."""
    ref, ours = _params(0), _params(0)
    opt_ref, opt = _adamw(ref, foreach=False), _adamw(ours, foreach=False)
    for step in range(1, 5):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ref, ours):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        if step == 3:  # torch's state and ours: counters moved on by 5, one replaced
            for o, ps in ((opt_ref, ref), (opt, ours)):
                o.state[ps[0]]["step"].add_(5.0)
                o.state[ps[3]]["step"] = torch.tensor(7.0)
        opt_ref.step()
        blocked_adamw_step(opt, block=1000)
    _same(opt, opt_ref)
    assert opt.state[ours[0]]["step"].item() == 9.0 and opt.state[ours[3]]["step"].item() == 9.0

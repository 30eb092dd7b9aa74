"""The real-loss pieces without kernels: loss weights, sampled gradients, the capture's sampling, optimizer rules.

Tolerances: weights and index maps are exact (float64, ``1e-12``); the Monte-Carlo statistics are checked at
``0.02`` absolute on matrices with entries of order ``0.25`` from 40000 samples (standard error ~ 0.003).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

from curvwatch import Sharpness
from curvwatch.adapters import find_blocks
from curvwatch.capture import Capture
from curvwatch.closed_form.settings import Lanczos
from curvwatch.engine import Engine
from curvwatch.models.gpt import GPT, GPTConfig
from curvwatch.realloss import sample_outputs
from curvwatch.realloss.logits import find_logits_module
from curvwatch.realloss.plugin import RealLoss
from curvwatch.realloss.samplers import LogitSampler
from curvwatch.realloss.stability import StabilityRule, param_index_map, stability_keys, stability_rule
from curvwatch.realloss.weights import LossKind, loss_weights
from tests import zoo
from tests.utils import assert_close_report, live_memory


def _grad(loss_fn, z):
    z = z.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss_fn(z), z)
    return g


Z = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
Y = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "loss_fn, expected",
    [
        (lambda z: F.cross_entropy(z.reshape(-1, 7), Y.reshape(-1)), torch.full((15,), 1 / 15)),
        (lambda z: F.cross_entropy(z.reshape(-1, 7), Y.reshape(-1), reduction="sum"), torch.ones(15)),
        (lambda z: F.cross_entropy(z.reshape(-1, 7), Y.reshape(-1)) / 4 * 1024, torch.full((15,), 256 / 15)),
    ],
    ids=["mean", "sum", "accumulation-and-amp-factors"],
)
def test_loss_weights_hard_labels(loss_fn, expected):
    w, kind, note = loss_weights(Z, _grad(loss_fn, Z))
    assert kind is LossKind.CROSS_ENTROPY and note is None
    torch.testing.assert_close(w.double(), expected.double(), rtol=1e-5, atol=0)


def test_loss_weights_ignored_and_weighted_rows():
    labels = Y.reshape(-1).clone()
    labels[:4] = -100
    per_row = torch.linspace(0.5, 2.0, 15, dtype=torch.float64)
    w, _, note = loss_weights(Z, _grad(lambda z: F.cross_entropy(z.reshape(-1, 7), labels), Z))
    assert note is None and (w[:4] == 0).all()
    torch.testing.assert_close(w[4:].double(), torch.full((11,), 1 / 11).double(), rtol=1e-5, atol=0)
    w, _, _ = loss_weights(
        Z, _grad(lambda z: (F.cross_entropy(z.reshape(-1, 7), Y.reshape(-1), reduction="none") * per_row).sum(), Z)
    )
    torch.testing.assert_close(w.double(), per_row, rtol=1e-5, atol=0)


def test_total_weight_is_the_sum_of_the_loss_weights():
    """The whole batch's weight (kept tokens scaled up to it) by the cheap log-domain formula: ignored rows, per-row
    weights and a confident row (p_y = 1 - 1e-6 in float32) as loss_weights, whose sum it replaces."""
    from curvwatch.realloss.weights import total_weight

    z = Z.float().reshape(-1, 7).clone()
    z[5] = torch.tensor([20.0, 0, 0, 0, 0, 0, 0]) - 1.0  # confident in class 0
    labels = Y.reshape(-1).clone()
    labels[5], labels[:3] = 0, -100
    per_row = torch.linspace(0.5, 2.0, 15)
    g = _grad(lambda t: (F.cross_entropy(t, labels, reduction="none") * per_row).sum(), z)
    expected = float(loss_weights(z, g)[0].double().sum())
    assert abs(total_weight(z, g) - expected) <= 1e-5 * expected
    assert abs(expected - float(per_row[3:].sum())) <= 1e-4 * expected


def test_total_weight_of_a_linear_logits_module_reads_two_logits_per_row():
    """Through a linear logits module (rows recomputed from its input): the same sum to float32 round-off, with the
    bias, confident and ignored rows, and the O(rows d) dot products only: no (rows, V) product (torch's profiler: no
    ``linear``/``mm``/``addmm`` call, which recomputing the logits is)."""
    from curvwatch.realloss.weights import LinearLogits, total_weight

    g0 = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(16, 1000)
    h = torch.randn(40, 16, generator=g0)
    h[7] = lin.weight[3].detach() * 40  # a confident row (p_3 ~ 1)
    labels = torch.randint(0, 1000, (40,), generator=g0)
    labels[7], labels[:2] = 3, -100
    per_row = torch.linspace(0.5, 2.0, 40)
    z = lin(h).detach()
    g = _grad(lambda t: (F.cross_entropy(t, labels, reduction="none") * per_row).sum(), z)
    expected = float(per_row[2:].double().sum())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        got = total_weight(LinearLogits(h, lin.weight, lin.bias), g)
    assert abs(got - expected) <= 1e-5 * expected
    assert abs(total_weight(z, g) - expected) <= 1e-5 * expected
    assert not {e.name for e in prof.events()} & {"aten::linear", "aten::mm", "aten::addmm", "aten::matmul"}


def test_total_weight_takes_every_row_at_once_in_any_dtype():
    """The whole batch's weight of many rows at a 50K vocabulary from four entries per row: float32 and bfloat16 rows
    (bf16-mixed logits) in one pass each (a fixed number of dispatched operators whatever the rows: at B 8, L 1024 the
    other rows were 717 chunks of ~20 operators, and until session 23 bfloat16 rows still took float32 chunks, ~5,000
    operators for 7,680 rows); the weights' sum to 1e-6 (float32; the sum of the entries off the label, before, was
    ~3e-5 off at 7,680 rows) and 1e-2 (bfloat16: the gradient's own rounding), with ignored rows, rows of confident
    predictions, and a linear logits module."""
    from benchmarks.bench_dispatch import OpCounter
    from curvwatch.realloss.weights import LinearLogits, total_weight

    g0 = torch.Generator().manual_seed(0)
    V, N, d = 50_257, 60, 8
    lin = torch.nn.Linear(d, V)
    h = torch.randn(N, d, generator=g0)
    labels = torch.randint(0, V, (N,), generator=g0)
    labels[:5] = -100
    per_row = torch.linspace(0.5, 2.0, N)
    z0 = lin(h).detach()
    g0 = _grad(lambda t: (F.cross_entropy(t, labels, reduction="none") * per_row).sum(), z0)
    expected = float(per_row[5:].double().sum())
    assert abs(total_weight(LinearLogits(h, lin.weight, lin.bias), g0) - expected) <= 1e-6 * expected
    z = z0.clone()
    z[5:10, 0] += torch.tensor([5.0, 10.0, 15.0, 20.0, 30.0])  # ever more confident rows (p_y up to 1 - 1e-13)
    labels[5:10] = 0
    g = _grad(lambda t: (F.cross_entropy(t, labels, reduction="none") * per_row).sum(), z)
    for dtype in (torch.float32, torch.bfloat16):
        counts = []
        for rows in (20, N):
            counter = OpCounter()
            with counter:
                got = total_weight(z[:rows].to(dtype), g[:rows].to(dtype))
            counts.append(counter.total)
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            assert abs(got - float(per_row[5:rows].double().sum())) <= tol * expected, (dtype, rows, got)
        assert counts[0] == counts[1] <= 30, (dtype, counts)  # (6 chunks of 10 rows took ~120)


def test_linear_logits_entries_are_the_logits_in_chunks_of_rows(monkeypatch):
    """``LinearLogits.entries`` (two logits per row for ``total_weight``) a chunk of rows at a time: equal to the
    gathered logits whatever the chunks (``_CHUNK`` shrunk to 2 rows per chunk here; an offset start, an odd count)."""
    from curvwatch.realloss import weights as sharpness
    from curvwatch.realloss.weights import LinearLogits

    g0 = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(16, 50)
    h = torch.randn(11, 16, generator=g0)
    cols = torch.randint(0, 50, (8, 2), generator=g0)
    want = lin(h).detach()[3:11].gather(-1, cols)
    for chunk in (sharpness._CHUNK, 64):  # one chunk; 2 rows per chunk (64 // (2 x 16))
        monkeypatch.setattr(sharpness, "_CHUNK", chunk)
        torch.testing.assert_close(LinearLogits(h, lin.weight, lin.bias).entries(3, 11, cols), want)


def test_loss_weights_read_the_host_once_whatever_the_chunks():
    """Hard labels at a 50K vocabulary (6 chunks of 10 rows): one host read for the whole fit (it was one per chunk,
    and a boolean index per chunk, which reads its count: a sync each on a GPU), the same weights; a z-loss still
    gets its per-chunk reading (and its note)."""
    from benchmarks.bench_dispatch import OpCounter, count_host_reads
    from curvwatch.realloss.weights import LSE_TERM_NOTE

    g0 = torch.Generator().manual_seed(0)
    V, N = 50_257, 60
    z = torch.randn(N, V, generator=g0)
    labels = torch.randint(0, V, (N,), generator=g0)
    per_row = torch.linspace(0.5, 2.0, N)
    g = _grad(lambda t: (F.cross_entropy(t, labels, reduction="none") * per_row).sum(), z)
    counter = OpCounter()
    with counter, count_host_reads(counter):
        w, kind, note = loss_weights(z, g)
    assert (note is None or "label smoothing up to" in note) and counter.syncs == 1, counter.syncs
    assert not any("nonzero" in op or "index.Tensor" in op for op in counter.ops), counter.ops
    torch.testing.assert_close(w, per_row, rtol=1e-5, atol=0)
    zl = _grad(lambda t: F.cross_entropy(t, labels, reduction="sum") + 1e-2 * (torch.logsumexp(t, -1) ** 2).sum(), z)
    w, _, note = loss_weights(z, zl)
    assert note == LSE_TERM_NOTE and bool((w > 0).all())


def test_hard_label_fit_from_row_statistics_equals_the_fit_on_the_whole_rows():
    """``_fit_rows`` computes the hard-label weights and the fit's squared residual from seven reductions per row
    (``_row_stats``) instead of a ``(rows, V)`` residual table: equal, in float64, to the residual of the whole rows
    ``||g - w (p - e_y)||^2`` (a z-loss row: its label's entry replaced by ``min(w p_y - g_y, 0)``) on rows that are
    cross-entropy (exact fit: residual at round-off of ``||g||^2``), perturbed ones (no fit), z-loss ones, rows without
    a gradient and confident ones; to 1e-10 of ``||g||^2`` on every row that decides the fit."""
    from curvwatch.realloss.weights import _fit_rows, _lse_term_labels, _row_stats

    gen = torch.Generator().manual_seed(0)
    N, V = 12, 40
    z = torch.randn(N, V, generator=gen, dtype=torch.float64) * 2
    z[5, 3] += 40.0  # a confident row
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[5] = 3
    weights = torch.linspace(0.5, 2.0, N, dtype=torch.float64)
    p = torch.softmax(z, -1)
    g = weights[:, None] * (p - F.one_hot(labels, V).double())
    g[2] += 1e-3 * torch.randn(V, generator=gen, dtype=torch.float64)  # not a cross-entropy row
    g[7] = 0.0  # no gradient
    lse = torch.zeros(N, dtype=torch.bool)
    lse[9:] = True  # z-loss rows: g = s p - w e_y with s = w + f'
    g[9:] = 1.3 * weights[9:, None] * p[9:] - weights[9:, None] * F.one_hot(labels[9:], V).double()
    for zloss in (False, True):
        y = g.argmin(-1, keepdim=True)
        act = g.abs().sum(-1) > 0
        if zloss:
            y = torch.where(lse[:, None], _lse_term_labels(p, g, act)[0][:, None], y)
        fit = _fit_rows(_row_stats(p, g.float() if not zloss else g, y), lse if zloss else None)
        w, active, resid2, decisive = fit.w, fit.active, fit.resid2, fit.decisive
        gd = g.float().double() if not zloss else g  # the statistics read float32 rows as they are
        p_y, g_y = p.gather(1, y)[:, 0], gd.gather(1, y)[:, 0]
        rest = (1 - p_y).clamp_min(0)
        w_ref = torch.where(act & (rest > 0), (gd.sum(-1) - g_y) / rest.clamp_min(1e-300), 0.0)
        r = gd - w_ref[:, None] * p
        r.scatter_add_(1, y, w_ref[:, None])
        if zloss:  # the label's entry is free: min(w p_y - g_y, 0) instead of w (1 - p_y) + g_y ...
            short = (w_ref * p_y - g_y).clamp_max(0)
            r_lse = r.clone()
            r_lse.scatter_(1, y, (short + 0 * r.gather(1, y)[:, 0])[:, None])
            r = torch.where(lse[:, None], r_lse, r)
        torch.testing.assert_close(w, w_ref.float(), rtol=0, atol=0)
        assert torch.equal(active, act) and torch.equal(decisive, act & (rest > 1e-3))
        # the rows that decide the fit (1 - p_y > 1e-3: ||p - e_y||^2 >= 1e-6, so the expansion's float64 cancellation
        # is <= ~1e-10 of ||g||^2); the confident row 5 does not count (its residual is multiplied by 0)
        assert not bool(decisive[5]) and int(decisive.sum()) == N - 2
        scale = gd.square().sum(-1)[decisive]
        err = (resid2 - r.square().sum(-1))[decisive].abs()
        assert bool((err <= 1e-10 * scale).all()), (err / scale).max()
        fits = [0, 1, 3]  # cross-entropy rows: round-off of ||g||^2; the perturbed row 2: its perturbation
        assert bool((resid2[fits] <= 1e-12 * gd[fits].square().sum(-1)).all()) and float(resid2[2]) > 1e-8


def test_loss_weights_soft_targets_and_mse_and_errors():
    w, kind, note = loss_weights(
        Z, _grad(lambda z: F.cross_entropy(z.reshape(-1, 7), Y.reshape(-1), label_smoothing=0.1), Z)
    )
    assert kind is LossKind.CROSS_ENTROPY and "soft targets" in note
    torch.testing.assert_close(w.double(), torch.full((15,), 1 / 15).double())
    w, kind, note = loss_weights(Z, _grad(lambda z: (z - 1).square().mean(), Z), "mse")
    assert kind is LossKind.MSE and "mean over every element" in note
    torch.testing.assert_close(w.double(), torch.full((15,), 1 / Z.numel()).double())
    with pytest.raises(ValueError, match="not a softmax cross-entropy"):
        loss_weights(Z, _grad(lambda z: (z - 1).square().mean(), Z))
    with pytest.raises(ValueError, match="differ in shape"):
        loss_weights(Z, Z[:1])
    with pytest.raises(ValueError, match="'hinge' is not a valid LossKind"):
        loss_weights(Z, Z, "hinge")


def test_sampled_gradients_have_the_gauss_newton_covariance():
    """Unbiased, cross-row blocks zero, also for a confident row (where drawing from p fails)."""
    z = torch.tensor([[1.0, -0.5, 0.2, 0.0], [0.3, 0.3, -1.0, 9.0]], dtype=torch.float64)
    w = torch.tensor([0.5, 2.0], dtype=torch.float64)
    n = 40000
    gen = torch.Generator().manual_seed(0)
    for kind in (LossKind.CROSS_ENTROPY, LossKind.MSE):
        acc = torch.zeros(8, 8, dtype=torch.float64)
        sampler = LogitSampler(z, w, kind)
        for _ in range(n // 1000):
            r = torch.stack([sampler.draw(gen).reshape(-1) for _ in range(1000)]).double()
            acc += r.T @ r
        p = torch.softmax(z, -1)
        blocks = [wi * (torch.diag(pi) - torch.outer(pi, pi)) for wi, pi in zip(w, p, strict=True)]
        if kind is LossKind.MSE:
            blocks = [2 * wi * torch.eye(4, dtype=torch.float64) for wi in w]
        exact = torch.block_diag(*blocks)
        assert (acc / n - exact).abs().max() < 0.02 * max(1.0, float(exact.abs().max()))


def _gpt(**kw):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, d_model=8, d_ff=16, dropout=0.0, **kw)
    return GPT(cfg).double()


def _gpt_batch(B: int, L: int) -> torch.Tensor:
    """A fixed ``(B, L)`` batch of :func:`_gpt`'s tokens."""
    return torch.randint(0, 13, (B, L), generator=torch.Generator().manual_seed(0))


def _gpt_loss(loss_of_logits, B: int, L: int):
    """``(model, loss_fn)``: :func:`_gpt` with math attention (torch.func's references need forward-mode AD) and
    ``loss_fn(model) -> (loss_of_logits(logits), logits)`` on :func:`_gpt_batch`."""
    model, idx = _gpt(attention="math"), _gpt_batch(B, L)

    def loss_fn(m):
        logits = m(idx)
        return loss_of_logits(logits), logits

    return model, loss_fn


def _layer1_w2(model, loss_fn, samples: int, key: str, kind: str = "auto") -> float:
    """The monitor's ``key`` (``ggn/W2W2``, ``sharpness/W2W2``) of ``layer1/ffn`` on ``loss_fn``'s batch, every token
    kept, ``samples`` sampled passes, float64 kernels with a tight Lanczos."""
    with Capture(find_blocks(model), max_tokens=100, logits_module=model.head) as cap:
        loss, _ = loss_fn(model)
        sample_outputs(cap, loss, samples, kind=kind, generator=torch.Generator().manual_seed(0))
        loss.backward()
    engine = Engine(lanczos=Lanczos(tol=1e-8, max_iter=100), dtype="float64", pairs=("W2W2",))
    return float(engine.evaluate(cap.blocks()).results["layer1/ffn"][key])


@pytest.mark.parametrize("head", ["linear", "scaled by a forward hook"])
def test_capture_samples_are_the_backpropagated_logit_samples(head, monkeypatch):
    """s_j at a block output is the VJP of the j-th sampled logit gradient, and the real capture is untouched: from a
    linear logits module's input (the draws carried through it on the kept rows), or, when the logits are not its
    linear map (a forward hook scales them), from the logits themselves."""
    model = _gpt()
    if head != "linear":
        model.head.register_forward_hook(lambda m, a, o: o * 0.5)
    idx = torch.randint(0, 13, (3, 6), generator=torch.Generator().manual_seed(2))
    specs = find_blocks(model)
    outputs = {}
    attn = model.blocks[1].attn.out_proj
    handle = attn.register_forward_hook(lambda m, a, o: outputs.__setitem__("y", o))
    through = []  # calls of the linear path
    input_draws = LogitSampler.input_draws
    monkeypatch.setattr(LogitSampler, "input_draws", lambda *a, **kw: through.append(1) or input_draws(*a, **kw))
    with Capture(specs, max_tokens=12, logits_module=model.head) as cap:
        logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, 13), idx.reshape(-1))
        n = len(sample_outputs(cap, loss, 3, generator=torch.Generator().manual_seed(5)).blocks)
        loss.backward()
    assert len(through) == (head == "linear")
    # reproduce the samples on a second forward (outside the capture): same generator, same loss weights,
    # autograd's VJP from the logits to the block output
    logits = model(idx)
    loss = F.cross_entropy(logits.reshape(-1, 13), idx.reshape(-1))
    handle.remove()
    (gz,) = torch.autograd.grad(loss, logits, retain_graph=True)
    w, kind, _ = loss_weights(logits[:2], gz[:2])  # the kept sequences' rows: no other row reaches them
    sampler = LogitSampler(logits[:2], w, kind)
    gen = torch.Generator().manual_seed(5)
    expected = []
    for _ in range(3):
        r = torch.zeros_like(logits)
        r[:2] = sampler.draw(gen).double()
        expected.append(torch.autograd.grad(logits, outputs["y"], r, retain_graph=True)[0][:2])
    blocks = {b.spec.name: b for b in cap.blocks()}
    assert n == 4  # attention and FFN blocks; LayerNorms take no samples
    samples = blocks["layer1/attn"].inputs["output_samples"]
    assert samples.shape == (3, 2, 6, 8)  # (k, sequences kept, L, d)
    assert "output_samples" not in blocks["layer1/ln_1"].inputs
    torch.testing.assert_close(samples, torch.stack(expected).float(), rtol=1e-5, atol=1e-7)
    # the real gradient capture is the plain backward's
    with Capture(specs, max_tokens=12) as plain:
        F.cross_entropy(model(idx).reshape(-1, 13), idx.reshape(-1)).backward()
    for b in plain.blocks():
        torch.testing.assert_close(blocks[b.spec.name].inputs["grad_output"], b.inputs["grad_output"], rtol=0, atol=0)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "sequence-first"])
@pytest.mark.parametrize("amp", [False, True], ids=["float32", "bf16-autocast"])
def test_samples_from_the_logits_module_input_equal_those_from_the_logits(batch_first, amp, monkeypatch):
    """The linear path (draws carried through the logits module on the kept rows, its logits recomputed in their own
    dtype) gives the samples of the logits path (forced by declaring the module non-linear): equal to float32
    round-off (measured 3.6e-7), and under bfloat16 autocast to its precision (measured 0.7%: the logits path draws a
    bfloat16 cotangent), in both layouts of the logits, with no loss-kind note."""
    import curvwatch.capture as capture

    V, d = 301, 16

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(V, d)
            self.layer = torch.nn.TransformerEncoderLayer(
                d, 2, dim_feedforward=32, dropout=0.0, batch_first=batch_first
            )
            self.head = torch.nn.Linear(d, V)

        def forward(self, x):
            z = self.head(self.layer(self.emb(x if batch_first else x.T)))
            return z if batch_first else z.transpose(0, 1)

    torch.manual_seed(0)
    model, x = Model(), torch.randint(0, V, (5, 4), generator=torch.Generator().manual_seed(1))

    def samples(linear: bool):
        if not linear:
            monkeypatch.setattr(capture, "_is_linear_of", lambda *a: False)
        with Capture(find_blocks(model), max_tokens=12, logits_module=model.head) as cap:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, V).float(), x.reshape(-1))
            del logits
            sampled = sample_outputs(cap, loss, 4, generator=torch.Generator().manual_seed(0))
            assert len(sampled.blocks) == 2 and (sampled.note is None or "label smoothing up to" in sampled.note)
            loss.backward()
        return {b.spec.name: b.inputs["output_samples"] for b in cap.blocks() if "output_samples" in b.inputs}

    through, at_logits = samples(True), samples(False)
    for name, s in at_logits.items():
        torch.testing.assert_close(through[name], s, rtol=0, atol=(2e-2 if amp else 2e-6) * float(s.abs().max()))


def test_sampling_errors_are_clear():
    model = _gpt()
    idx = torch.randint(0, 13, (2, 5))
    with Capture(find_blocks(model), max_tokens=12, logits_module=model.head) as cap:
        out = model(idx)
        with pytest.raises(ValueError, match="not a softmax cross-entropy"):
            sample_outputs(cap, (out - 1).square().mean(), 2)
    with Capture(find_blocks(model), max_tokens=12, logits_module=model.blocks[0].ln_1) as cap:
        with torch.no_grad():
            model(idx)
        with pytest.raises(RuntimeError, match="produced no output with gradient tracking"):
            sample_outputs(cap, torch.zeros((), requires_grad=True), 2)


def test_find_logits_module():
    model = _gpt()
    assert find_logits_module(model)[0] == "head"
    assert find_logits_module(model, "blocks.0.mlp.proj")[0] == "blocks.0.mlp.proj"
    with pytest.raises(ValueError, match="no such module"):
        find_logits_module(model, "lm_head")
    with pytest.raises(ValueError, match="logits_module='<dotted name>'"):
        find_logits_module(torch.nn.Sequential(torch.nn.Linear(2, 2)))


_INDEX_MAP_MODELS = {
    "gpt": _gpt,
    "torch-encoder": lambda: torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2
    ).double(),
    "nanogpt": lambda: zoo.nanogpt().model,
    "litgpt-llama-gqa": lambda: zoo.litgpt_gpt("interleave").model,
    "litgpt-falcon-mqa": lambda: zoo.litgpt_gpt("falcon").model,
    "hf-llama": lambda: zoo.hf_decoder("llama").model,
    "hf-gpt2": lambda: _hf_gpt2(),
}


def _hf_gpt2():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return tf.GPT2Model(tf.GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=2, n_head=2)).double()


@pytest.mark.parametrize("name", sorted(_INDEX_MAP_MODELS))
def test_param_index_map_reproduces_the_adapters_weights(name):
    """cat(parameters)[index] is exactly what the adapter reads, for every weight of every sampled block."""
    model = _INDEX_MAP_MODELS[name]()
    checked = 0
    for spec in find_blocks(model):
        if spec.kind not in ("attention", "ffn", "gated_ffn"):
            continue
        read = spec.adapter.read_params(spec)
        for weight, (params, index) in param_index_map(spec).items():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            torch.testing.assert_close(flat[index], read[weight].detach(), rtol=0, atol=0)
            checked += 1
    assert checked >= 4


def _step(opt, model):
    opt.zero_grad()
    model(torch.randint(0, 13, (2, 5))).square().mean().backward()
    opt.step()


def test_stability_rules_of_the_optimizers():
    model = _gpt()
    spec = next(s for s in find_blocks(model) if s.kind == "attention")
    params = param_index_map(spec)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rule, why = stability_rule(sgd, params)
    assert why is None and rule.optimizer == "sgd" and rule.threshold == pytest.approx(3.8 / 0.1)
    rule, why = stability_rule(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True), params)
    assert rule is None and "Nesterov" in why
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    rule, why = stability_rule(adam, params)
    assert rule is None and "before its first step" in why
    _step(adam, model)
    _step(adam, model)
    rule, why = stability_rule(adam, params)
    assert why is None and rule.threshold == pytest.approx(3.8 / (0.1 * 1e-3))
    W_Q = model.blocks[0].attn.q_proj.weight
    v_hat = adam.state[W_Q]["exp_avg_sq"] / (1 - 0.95**2)
    torch.testing.assert_close(rule.precondition["W_Q"], (v_hat.sqrt() + 1e-8).T.float(), rtol=1e-6, atol=0)
    rule, why = stability_rule(torch.optim.RMSprop(model.parameters(), lr=1e-3), params)
    assert rule is None and "RMSprop is not supported" in why
    groups = [{"params": [model.blocks[0].attn.q_proj.weight], "lr": 0.5}]
    groups.append({"params": [p for p in model.parameters() if p is not model.blocks[0].attn.q_proj.weight]})
    rule, why = stability_rule(torch.optim.SGD(groups, lr=0.1), params)
    assert rule is None and "different learning rates" in why


def test_stability_keys_and_real_loss_options():
    adam = StabilityRule("adam", 1e-3, 0.9, 38e3)
    keys = stability_keys({"sharpness/QQ/h0": 5.0, "precond_sharpness/QQ/h0": 19e3}, adam)
    assert keys == {"stability/QQ/h0": 0.5}
    for bad, match in ((dict(enabled="yes"), "sharpness"), (dict(samples=0), "samples"),
                       (dict(loss="hinge"), "loss"), (dict(logits_module=3), "logits_module")):  # fmt: skip
        with pytest.raises(ValueError, match=f"Invalid {match}="):
            RealLoss(**bad)
    real = RealLoss()
    assert real.resolve(_gpt()).startswith("on: logits from 'head'")
    assert real.resolve(torch.nn.Sequential(torch.nn.Linear(2, 2))).startswith("off:")
    assert real.resolve(_gpt(), "FSDPStrategy (FSDP1): why") == "off: FSDPStrategy (FSDP1): why"
    with pytest.raises(ValueError, match="Cannot find the module"):
        RealLoss(enabled=True).resolve(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_loss_weights_of_a_confident_model_in_float32():
    """Converged: p_y rounds to 1 in float32 and autograd's p_y - 1 to 0 (rows no longer sum to zero); the
    weights come from the entries off the label (the demo's run failed on this at step 1050 before)."""
    z = torch.zeros(6, 12)
    z[:, 3] = 25.0  # p_y = 1 - 11 e^-25 ~ 1 - 1.5e-10 (rounds to 1 in float32)
    z[0, 5] = 2.0  # one row still uncertain
    labels = torch.full((6,), 3)
    w, kind, note = loss_weights(z, _grad(lambda x: F.cross_entropy(x, labels), z))
    assert kind is LossKind.CROSS_ENTROPY and note is None
    torch.testing.assert_close(w.double(), torch.full((6,), 1 / 6, dtype=torch.float64), rtol=1e-4, atol=0)


def test_sampler_and_loss_weights_in_chunks_are_the_same(monkeypatch):
    """The tables are built a chunk of rows at a time (memory bounded by _CHUNK elements, whatever the rows): the
    weights and the draws do not depend on the chunking."""
    import curvwatch.realloss.weights as sharpness

    z = torch.randn(7, 5, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 5, (7,), generator=torch.Generator().manual_seed(4))
    (g,) = torch.autograd.grad(F.cross_entropy(z.requires_grad_(True), y, reduction="sum"), z)
    z = z.detach()
    w_whole = loss_weights(z, g)[0]
    one = LogitSampler(z, torch.ones(7), LossKind.CROSS_ENTROPY)
    whole = one.draw(torch.Generator().manual_seed(0))
    # every draw of row n has the norm sqrt(w_n tr H_n), tr H_n = 1 - ||p_n||^2; unit: their largest
    p = torch.softmax(z.double(), -1)
    norms = (1 - p.square().sum(-1)).sqrt().float()
    torch.testing.assert_close(one.norm, norms, rtol=1e-6, atol=0)
    torch.testing.assert_close(whole.norm(dim=-1), norms, rtol=1e-5, atol=0)
    assert one.unit == float(one.norm.max())
    monkeypatch.setattr(sharpness, "_CHUNK", 10)  # two rows per chunk
    assert sharpness._chunk_rows(5) == 2 and sharpness._chunk_rows(50_257) == 1
    torch.testing.assert_close(loss_weights(z, g)[0], w_whole, rtol=0, atol=0)
    torch.testing.assert_close(w_whole, torch.ones(7), rtol=1e-5, atol=0)
    chunked = LogitSampler(z, torch.ones(7), LossKind.CROSS_ENTROPY).draw(torch.Generator().manual_seed(0))
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    # the draws carried through a linear logits module (no (rows, V) draw): r W, the same random numbers
    W = torch.randn(5, 3, generator=torch.Generator().manual_seed(5))
    sampler = LogitSampler(z, torch.ones(7), LossKind.CROSS_ENTROPY)
    torch.testing.assert_close(sampler.norm, norms, rtol=1e-6, atol=0)
    gen = torch.Generator().manual_seed(0)
    through = [d * sampler.unit for d in sampler.input_draws(W, 2, torch.Generator().manual_seed(0))]
    for d in through:
        torch.testing.assert_close(d, sampler.draw(gen) @ W, rtol=1e-5, atol=1e-6)
    late = LogitSampler(z, torch.ones(7), LossKind.CROSS_ENTROPY, norms=False)  # the norms from the draws' one pass
    assert late.unit is None
    list(late.input_draws(W, 2, torch.Generator().manual_seed(0)))
    torch.testing.assert_close(late.norm, norms, rtol=1e-6, atol=0)


def test_real_loss_temporaries_are_bounded_at_a_50k_vocabulary():
    """Vocabulary 50,257, 256 rows: the largest (rows, vocabulary) temporary of the loss weights and of a draw is one
    chunk (2^20 elements: 8 MiB in float64), not the rows' 100 MiB (the previous version's tables: 4,096 rows of the
    whole batch at once, 1.6 GB), by torch's profiler."""
    import curvwatch.realloss.weights as sharpness

    V, N = 50_257, 256
    z = torch.randn(N, V, generator=torch.Generator().manual_seed(0))
    g = (torch.softmax(z, -1) - F.one_hot(torch.arange(N) % V, V)) / N
    assert sharpness._chunk_rows(V) * V * 8 <= 8 * 2**20
    out = torch.empty(128, V)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        w, _, _ = loss_weights(z, g)
        sampler = LogitSampler(z[:128], w[:128], LossKind.CROSS_ENTROPY)
        sampler.draw_into(out, torch.Generator().manual_seed(0))
        list(sampler.input_draws(torch.randn(V, 16), 4, torch.Generator().manual_seed(0)))
    largest = max(e.cpu_memory_usage for e in prof.events())  # the largest allocation of one op call
    assert 2**20 < largest <= 16 * 2**20, largest
    torch.testing.assert_close(w, torch.full((N,), 1 / N), rtol=1e-4, atol=0)


def _sampling_peaks(B: int, max_tokens: int = 64, L: int = 32, V: int = 50_257) -> tuple[float, float]:
    """MiB: the peak of live CPU memory while ``sample_outputs`` runs (4 samples) and while the plain backward of the
    same step runs, from torch's profiler's allocation events (every allocation and free, in time order)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=L, n_layer=1, n_head=2, d_model=16, d_ff=32, dropout=0.0))
    idx = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with Capture(find_blocks(model), max_tokens=max_tokens, logits_module=model.head) as cap:
            loss = F.cross_entropy(model(idx).reshape(-1, V), idx.reshape(-1))  # the logits are not held here
            with torch.profiler.record_function("sampling"):
                assert len(sample_outputs(cap, loss, 4, generator=torch.Generator().manual_seed(0)).blocks) == 2
            with torch.profiler.record_function("backward"):
                loss.backward()
    events = prof.profiler.kineto_results.events()
    timeline = live_memory(events)
    spans = {
        e.name(): (e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() in ("sampling", "backward")
    }
    return tuple(
        max(b for t, b in timeline if spans[n][0] <= t <= spans[n][1]) / 2**20 for n in ("sampling", "backward")
    )


def test_sampling_adds_no_memory_that_grows_with_the_batch_at_a_50k_vocabulary():
    """Vocabulary 50,257, 64 kept tokens: the sampling's peak exceeds the plain backward's peak of the same step (the
    step's peak without sampling) by at most 24 MiB (the goal: 64 MiB; measured 18.4 MiB at batch 2, its chunked
    tables of 2^20 elements; 22.2 MiB with chunks of 2^19 before a chunk was reduced to row statistics and the
    coefficient and normalised-q tables dropped, `sharpness._row_stats`, `_tables_of`, 3.1 MiB with those and 2^19),
    and not more at batch 8 (4x the logits; measured 0: under the backward's own peak). Before the chunks: +84 MiB
    at both (every chunk's sampler tables at once: 24 bytes per kept token and vocabulary entry, 617 MB at the default
    512 tokens), and a logits-sized cotangent through the sampled passes."""
    extra = {}
    for B in (2, 8):
        sampling, backward = _sampling_peaks(B)
        extra[B] = max(0.0, sampling - backward)
        assert backward > B * 32 * 50_257 * 4 / 2**20  # the backward itself holds logits-sized tensors
    assert extra[2] <= 24 and extra[8] <= extra[2] + 4, extra


def test_sampling_dispatch_ceiling():
    """Operators and host syncs of ``sample_outputs`` at vocabulary 50,257 (64 kept tokens: 4 chunks of 20 rows), 2
    layers: 16 samples as one batched pass cost 676 operators and 5 syncs, each sample ~16 operators more than one
    (428: the loss weights, the draws and one pass); one at a time (``batched=False``: under the model's backward
    hooks) 1,463, each sample ~69 more (its backward pass through the body). Ceilings ~15% above."""
    from benchmarks.bench_dispatch import OpCounter

    V, L = 50_257, 32
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=L, n_layer=2, n_head=2, d_model=16, d_ff=32, dropout=0.0))
    idx = torch.randint(0, V, (4, L), generator=torch.Generator().manual_seed(1))
    counts = {}
    for k, batched in ((1, True), (16, True), (16, False)):
        with Capture(find_blocks(model), max_tokens=64, logits_module=model.head) as cap:
            loss = F.cross_entropy(model(idx).reshape(-1, V), idx.reshape(-1))
            with OpCounter() as counter:
                out = sample_outputs(cap, loss, k, generator=torch.Generator().manual_seed(0), batched=batched)
                assert len(out.blocks) == 4 and out.at_once == (k if batched else 1)
            loss.backward()
        counts[k, batched] = (counter.total, counter.syncs)
    assert counts[16, True][0] <= 780 and counts[16, True][1] <= 6, counts
    assert counts[16, True][0] - counts[1, True][0] <= 15 * 20, counts
    assert counts[16, False][0] <= 1_650 and counts[16, False][1] <= 6, counts


def test_sampling_reads_the_kept_rows_logits_once(monkeypatch):
    """A linear logits module at a 50K vocabulary: the kept rows' logits are recomputed from its input once per chunk
    of rows, for the loss weights and the draws together (:class:`~curvwatch.realloss.samplers.InputDraws` handed to
    ``loss_weights``), and the other rows' not at all (``total_weight`` reads two logits per row); before, twice and
    once. The samples are those of the sampler's own pass (``plan`` not handed over), bit for bit."""
    from curvwatch.realloss.weights import LinearLogits, _chunk_rows

    V, L = 50_257, 32
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=L, n_layer=1, n_head=2, d_model=16, d_ff=32, dropout=0.0))
    idx = torch.randint(0, V, (4, L), generator=torch.Generator().manual_seed(1))
    reads = []
    getitem = LinearLogits.__getitem__
    monkeypatch.setattr(LinearLogits, "__getitem__", lambda self, rows: reads.append(rows) or getitem(self, rows))
    samples = {}
    for fused in (True, False):
        if not fused:  # the unfused path: the draws read every chunk themselves
            monkeypatch.setattr("curvwatch.realloss.sampling.InputDraws", lambda *a, **kw: None)
        reads.clear()
        with Capture(find_blocks(model), max_tokens=64, logits_module=model.head) as cap:
            loss = F.cross_entropy(model(idx).reshape(-1, V), idx.reshape(-1))
            assert len(sample_outputs(cap, loss, 4, generator=torch.Generator().manual_seed(0)).blocks) == 2
            loss.backward()
        chunks = -(-64 // _chunk_rows(V))  # the kept rows' chunks
        assert len(reads) == (chunks if fused else 2 * chunks), (fused, len(reads), chunks)
        samples[fused] = [b.inputs["output_samples"] for b in cap.blocks() if "output_samples" in b.inputs]
    for a, b in zip(samples[True], samples[False], strict=True):
        assert torch.equal(a, b)


def test_two_captures_do_not_read_each_others_sampled_passes():
    """Two monitors' captures on one step, each sampling: each keeps the real backward's gradient, bit for bit."""
    model = _gpt()
    idx = torch.randint(0, 13, (3, 6), generator=torch.Generator().manual_seed(2))
    specs = find_blocks(model)
    with Capture(specs, max_tokens=12) as plain:
        F.cross_entropy(model(idx).reshape(-1, 13), idx.reshape(-1)).backward()
    with Capture(specs, max_tokens=12, logits_module=model.head) as first:
        with Capture(specs, max_tokens=12, logits_module=model.head) as second:
            loss = F.cross_entropy(model(idx).reshape(-1, 13), idx.reshape(-1))
            sample_outputs(first, loss, 3, generator=torch.Generator().manual_seed(0))
            sample_outputs(second, loss, 2, generator=torch.Generator().manual_seed(1))
            loss.backward()
    for cap in (first, second):
        blocks = {b.spec.name: b for b in cap.blocks()}
        for b in plain.blocks():
            torch.testing.assert_close(blocks[b.spec.name].inputs["grad_output"], b.inputs["grad_output"], rtol=0,
                                       atol=0)  # fmt: skip
    assert first.blocks()[0].inputs["output_samples"].shape[0] == 3
    assert second.blocks()[0].inputs["output_samples"].shape[0] == 2


def test_user_backward_hooks_are_named_at_set_up_and_sharpness_false_leaves_them_alone():
    """The sampled passes run through the user's hooks (no PyTorch API can skip them): the set-up says so once,
    naming the hooked module and the kwarg; with sharpness=False a full backward hook and a tensor hook on a block
    output fire exactly as often as without the monitor."""
    import lightning as L

    from curvwatch import CurvatureMonitor
    from tests.ddp_script import TinyLM, loader

    def run(monitor):
        L.seed_everything(0)
        model = TinyLM()
        counts = {"module": 0, "tensor": 0}
        block = model.model.blocks[0].mlp
        block.register_full_backward_hook(lambda m, gi, go: counts.__setitem__("module", counts["module"] + 1))

        def on_output(m, a, out):
            if out.requires_grad:
                out.register_hook(lambda g: counts.__setitem__("tensor", counts["tensor"] + 1))

        block.register_forward_hook(on_output)
        callbacks = [] if monitor is None else [monitor]
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=3,
            logger=False,
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*nowhere to write its numbers")  # no logger: not the point here
            trainer.fit(model, loader())
        return counts

    note = RealLoss().resolve(TinyLM())
    assert "backward hooks" not in note
    hooked = TinyLM()
    hooked.model.blocks[0].mlp.register_full_backward_hook(lambda m, gi, go: None)
    note = RealLoss().resolve(hooked)
    assert "backward hooks (on 'model.blocks.0.mlp')" in note and "sharpness=False" in note
    without = run(None)
    assert without["module"] == 3 and without["tensor"] == 3
    assert run(CurvatureMonitor(every_n_train_steps=1, sharpness=False, verbose=False)) == without


@pytest.mark.parametrize("V", [13, 50_257], ids=["one-chunk", "several-chunks"])
def test_kept_tokens_without_loss_weight_give_no_value_and_say_why(V):
    """The kept sequence is an ignored one (every label ignore_index): no samples (a sharpness of 0 would read "far
    from the edge"), and the error says why and what to change; also where the kept rows' tables span several chunks
    (a 50K vocabulary: their norms are known only after the draws' pass over them)."""
    L = 6 if V == 13 else 24
    model = _gpt() if V == 13 else GPT(GPTConfig(vocab_size=V, block_size=L, n_layer=1, n_head=2, d_model=8, d_ff=16,
                                                 dropout=0.0))  # fmt: skip
    idx = torch.randint(0, V, (3, L), generator=torch.Generator().manual_seed(2))
    labels = idx.clone()
    labels[0] = -100  # the first sequence, the only one kept with max_tokens=L, is not scored
    with Capture(find_blocks(model), max_tokens=L, logits_module=model.head) as cap:
        loss = F.cross_entropy(model(idx).reshape(-1, V), labels.reshape(-1), ignore_index=-100)
        with pytest.raises(ValueError, match=r"kept tokens .* carry no loss weight .* raise max_tokens"):
            sample_outputs(cap, loss, 2)
        loss.backward()
    assert all("output_samples" not in b.inputs for b in cap.blocks())


def test_ranks_agree_before_the_sampled_passes():
    """Several ranks (``agree``): asked once on every path, whether this rank can sample; when another rank cannot,
    no pass runs here either (under FSDP2 each pass all-gathers weights) and the error says so."""
    model = _gpt()
    idx = torch.randint(0, 13, (3, 6), generator=torch.Generator().manual_seed(2))
    labels = idx.clone()
    labels[0] = -100  # the only kept sequence at max_tokens=6 is not scored: this rank cannot sample
    cases = [(idx, True, 4, None), (idx, False, 0, "another rank cannot sample"), (labels, True, 0, "no loss weight")]
    for target, others, sampled, error in cases:
        asked = []

        def agree(ready, others=others, asked=asked):
            asked.append(ready)
            return ready and others

        with Capture(find_blocks(model), max_tokens=6, logits_module=model.head) as cap:
            loss = F.cross_entropy(model(idx).reshape(-1, 13), target.reshape(-1), ignore_index=-100)
            if error is None:
                assert len(sample_outputs(cap, loss, 2, agree=agree).blocks) == sampled
            else:
                with pytest.raises((RuntimeError, ValueError), match=error):
                    sample_outputs(cap, loss, 2, agree=agree)
            loss.backward()
        assert asked == [target is idx]  # asked exactly once, with this rank's readiness
        assert sum("output_samples" in b.inputs for b in cap.blocks()) == sampled


def test_logits_scaled_after_the_logits_module_are_refused_by_name():
    """z / 4 after the head, then cross-entropy: the gradient is a hard-label one of softmax(z / 4), not soft targets;
    the error names the scale, logits_module= and loss=. Label smoothing keeps its note."""
    z = torch.randn(6, 13, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = torch.randint(0, 13, (6,), generator=torch.Generator().manual_seed(1))
    (g,) = torch.autograd.grad(F.cross_entropy(z / 4, y), z)
    with pytest.raises(ValueError, match=r"softmax\(0.25 z\).*logits_module=.*loss="):
        loss_weights(z.detach(), g)
    (g,) = torch.autograd.grad(F.cross_entropy(z, y, label_smoothing=0.1), z)
    assert "soft targets" in loss_weights(z.detach(), g)[2]


def test_no_spread_or_heterogeneity_from_no_data():
    """A zero sharpness (no samples' weight, no gradient) logs no sharpness_spread (0/0), and all-zero norms no
    heterogeneity (log10 of 0): a number there would mean something."""
    from curvwatch.closed_form import FFNWeights, OutputLoss, ffn
    from curvwatch.metrics import summarize

    gen = torch.Generator().manual_seed(0)
    Y, W_1, W_2 = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((2, 3, 4), (4, 5), (5, 4)))
    zero = torch.zeros(2, 3, 4, dtype=torch.float64)
    weights, no_samples = FFNWeights(W_1, W_2), torch.zeros(4, 2, 3, 4, dtype=torch.float64)
    out = ffn(Y, weights, loss=OutputLoss(grad_output=zero, output_samples=no_samples), pairs=("W2W2",))
    assert float(out["sharpness/W2W2"]) == 0 and "sharpness_spread/W2W2" not in out
    samples = torch.randn(4, 2, 3, 4, generator=gen, dtype=torch.float64)
    out = ffn(Y, weights, loss=OutputLoss(grad_output=zero, output_samples=samples), pairs=("W2W2",))
    assert float(out["sharpness_spread/W2W2"]) > 0
    # under the monitor's engine (inputs_checked) no host read decides it: NaN marks "no data", and the logbook's one
    # read of every value drops that key (not the block)
    from benchmarks.bench_dispatch import OpCounter, count_host_reads
    from curvwatch.closed_form import inputs_checked
    from curvwatch.logbook import flatten

    counter = OpCounter()
    with inputs_checked(), counter, count_host_reads(counter):  # (warn=False: no read of the residuals, as the monitor)
        out = ffn(Y, weights, loss=OutputLoss(grad_output=zero, output_samples=no_samples), pairs=("W2W2",),
                  lanczos=Lanczos(warn=False))  # fmt: skip
    assert counter.syncs == 0 and torch.isnan(out["sharpness_spread/W2W2"])
    flat = flatten({"layer0/ffn": out})
    assert ("layer0/ffn", "sharpness/W2W2") in flat and ("layer0/ffn", "sharpness_spread/W2W2") not in flat
    summary = summarize({"layer0/attn": {"hessian/QQ": 0.0}, "layer1/attn": {"hessian/QQ": 0.0}})
    assert not [k for k in summary if "heterogeneity" in k]


def test_kl_batchmean_over_tokens_is_refused_unless_named_then_exact():
    """kl_div(log_softmax(z), t, 'batchmean') of (B, L, V) logits divides by B, not by the B L tokens: from the
    gradient alone it read 1/L of the truth (a note only). Now "auto" refuses it naming loss=; loss='soft_batchmean'
    gives weights 1/B, whose Gauss-Newton matrix at the logits is the loss's exact Hessian there (torch.func), and
    the monitor's sharpness of a tiny GPT's W2 matches the exact value (real_loss_top, matrix-free) within 20%
    (measured 1.04x at 256 samples; the 1/L reading was 1/6 of it)."""
    from curvwatch.reference.real_loss import real_loss_top

    B, L, V = 3, 6, 13
    teacher = torch.softmax(2 * torch.randn(B, L, V, generator=torch.Generator().manual_seed(1)), -1).double()

    def kl(z):
        return F.kl_div(F.log_softmax(z, -1), teacher, reduction="batchmean")

    z = torch.randn(B, L, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"soft targets.*batchmean.*loss='soft_batchmean'.*loss='soft_mean'"):
        loss_weights(z, _grad(kl, z))
    w, _, note = loss_weights(z, _grad(kl, z), "soft_batchmean")
    assert note is None
    torch.testing.assert_close(w.double(), torch.full((B * L,), 1 / B, dtype=torch.float64), rtol=1e-6, atol=0)
    p = torch.softmax(z, -1).reshape(-1, V)
    ggn_z = torch.block_diag(*[wi * (torch.diag(q) - torch.outer(q, q)) for wi, q in zip(w.double(), p, strict=True)])
    exact_z = torch.func.hessian(kl)(z).reshape(B * L * V, B * L * V)
    torch.testing.assert_close(ggn_z, exact_z, rtol=1e-6, atol=1e-12)  # w is float32

    model, loss_fn = _gpt_loss(kl, B, L)
    specs = find_blocks(model)
    with Capture(specs, max_tokens=100, logits_module=model.head) as cap:
        loss, _ = loss_fn(model)
        with pytest.raises(ValueError, match="loss='soft_batchmean'"):
            sample_outputs(cap, loss, 2)
        loss.backward()
    got = _layer1_w2(model, loss_fn, 256, "sharpness/W2W2", kind="soft_batchmean")
    spec = {s.name: s for s in specs}["layer1/ffn"]
    exact = real_loss_top(model, loss_fn, spec, "W_2", loss="soft_batchmean")["sharpness"]
    assert got == pytest.approx(exact, rel=0.2), (got, exact)


def test_no_data_and_scaled_logits_reach_the_logger_as_no_value(tmp_path):
    """What reaches the CSV logger: a kept sequence without loss weight, and logits scaled after the head, give no
    sharpness/stability key at all (never a 0), the rest of the evaluation, and one notice naming the fix."""
    import warnings

    from curvwatch import CurvatureMonitor, CurvatureNotice, Evaluation
    from tests.ddp_script import VOCAB, TinyLM, loader
    from tests.test_callback import curv_rows, make_trainer, read_rows

    class Ignored(TinyLM):  # the first sequence (the only one kept at max_tokens=7) is not scored
        def training_step(self, batch, batch_idx):
            (idx,) = batch
            labels = idx[:, 1:].clone()
            labels[0] = -100
            return F.cross_entropy(self(idx[:, :-1]).reshape(-1, VOCAB), labels.reshape(-1))

    class Scaled(TinyLM):  # a temperature after the head
        def training_step(self, batch, batch_idx):
            (idx,) = batch
            return F.cross_entropy((self(idx[:, :-1]) / 4).reshape(-1, VOCAB), idx[:, 1:].reshape(-1))

    for module, why in ((Ignored(), "carry no loss weight"), (Scaled(), "logits_module=")):
        monitor = CurvatureMonitor(
            every_n_train_steps=1, log_level="all", evaluation=Evaluation(max_tokens=7), sharpness=Sharpness(samples=2)
        )
        trainer = make_trainer(tmp_path / why[:5], monitor, max_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CurvatureNotice)
            trainer.fit(module, loader())
        rows = curv_rows(read_rows(trainer))
        assert sorted(rows) == [0] and "curv/layer0/attn/hessian/QQ/h0" in rows[0]
        assert not [k for r in rows.values() for k in r if any(s in k for s in ("sharpness", "stability", "ggn/"))]
        notices = [str(w.message) for w in caught if issubclass(w.category, CurvatureNotice)]
        assert len([n for n in notices if "leaves the real-loss keys" in n and why in n]) == 1, notices


def test_label_smoothing_of_a_confident_model_keeps_its_note():
    """Label smoothing where the model predicts the label with p_y > 1 - eps (its gradient entry is then positive, so
    the label is not the most negative one): still recognised (the most probable class is tried as the label), the
    mean assumed with the note; not refused as other soft targets are."""
    z = 5 * torch.randn(32, 13, generator=torch.Generator().manual_seed(0))
    y = z.argmax(-1)  # confident and right
    assert float(torch.softmax(z, -1).max(-1).values.min()) < 0.9 < float(torch.softmax(z, -1).max(-1).values.max())
    for logits in (z, z.bfloat16()):
        zz = logits.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(F.cross_entropy(zz.float(), y, label_smoothing=0.1), zz)
        w, _, note = loss_weights(zz.detach(), g)
        assert "label-smoothing form" in note
        torch.testing.assert_close(w.double(), torch.full((32,), 1 / 32, dtype=torch.float64))


def test_label_smoothing_on_kept_rows_counts_the_whole_batch():
    """Label smoothing with only the first sequence kept: the assumed mean runs over the whole batch's rows with a
    gradient (counted only there: a hard-label loss skips that pass), so the kept rows weigh 1/(that count) and the
    scale to the whole batch is its count over the kept rows'. (Logits scaled up: near-uniform predictions make label
    smoothing look like a hard label of weight ``1 - eps``.)"""
    model = _gpt()
    with torch.no_grad():
        model.head.weight.mul_(30)
    idx = torch.randint(0, 13, (3, 6), generator=torch.Generator().manual_seed(2))
    labels = idx.clone()
    labels[1, :2] = labels[2, 4:] = -100  # 14 of the 18 rows scored, all 6 kept ones
    with Capture(find_blocks(model), max_tokens=6, logits_module=model.head) as cap:
        loss = F.cross_entropy(model(idx).reshape(-1, 13), labels.reshape(-1), ignore_index=-100, label_smoothing=0.1)
        sampled = sample_outputs(cap, loss, 2, generator=torch.Generator().manual_seed(0))
        assert len(sampled.blocks) == 4
        loss.backward()
    assert "mean over the 14 rows with a gradient" in sampled.note
    scales = {b.sample_scale for b in cap.blocks() if "output_samples" in b.inputs}
    assert len(scales) == 1 and abs(scales.pop() - 14 / 6) < 1e-6  # float32 weights


def test_rules_read_the_step_counts_of_every_block_in_one_host_read():
    """Adam's ``state["step"]`` is a device tensor under fused or capturable Adam: the rules of all blocks read the step
    counts in one host read (one per block, and before that one per weight, were a sync each on a GPU)."""
    from benchmarks.bench_dispatch import OpCounter, count_host_reads

    model = _gpt()  # 2 layers
    idx = torch.randint(0, 13, (3, 6), generator=torch.Generator().manual_seed(0))
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    F.cross_entropy(model(idx).reshape(-1, 13), idx.reshape(-1)).backward()
    adam.step()
    real, specs = RealLoss(), find_blocks(model)
    real.rules(adam, specs)  # the index maps, once per block
    counter = OpCounter()
    with counter, count_host_reads(counter):
        rules, why = real.rules(adam, specs)
    assert len(rules) == 4 and not why  # two attention and two FFN blocks
    assert counter.syncs == 1, counter.syncs
    assert all(rule.optimizer == "adam" and rule.precondition for rule in rules.values())


def test_z_loss_is_read_as_cross_entropy_plus_a_term_in_logsumexp():
    """Cross-entropy plus a z-loss ``c mean(logsumexp(z)^2)``: its gradient rows do not sum to zero (by ``2 c lse``
    of the row's weight), and in a confident row the label's entry is positive, so it is not the most negative one.
    It used to be refused ("not a softmax cross-entropy's") once the logits grew (the instability suite's z-loss run
    had real-loss keys at 2 of 40 evaluations). Now the weights are ``s = w + 2 c lse w_z``, exact, with a note: the
    loss's Hessian at the logits is ``s (diag p - p p^T)`` plus the rank-one ``2 c w_z p p^T`` left out (checked
    against torch.func), and the monitor's ``ggn/W2W2`` of a tiny GPT with large logits is within 15% of the exact
    Gauss-Newton block of that loss (dense torch.func, 1024 samples)."""
    from curvwatch.realloss.weights import LSE_TERM_NOTE
    from curvwatch.reference.real_loss import _perturbed

    B, L, V, c = 3, 6, 13, 1e-3
    y = torch.randint(0, V, (B * L,), generator=torch.Generator().manual_seed(2))

    def loss_of(z):
        z = z.reshape(-1, V)
        return F.cross_entropy(z, y) + c * z.logsumexp(-1).pow(2).mean()

    z = 6 * torch.randn(B, L, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    z.reshape(-1, V)[torch.arange(B * L), y] += 8.0  # confident rows
    g = _grad(loss_of, z)
    assert bool((g.reshape(-1, V)[torch.arange(B * L), y] > 0).any())  # a label entry above zero
    w, _, note = loss_weights(z, g)
    assert note == LSE_TERM_NOTE
    lse = z.reshape(-1, V).logsumexp(-1)
    s = (1 + 2 * c * lse) / (B * L)
    p = torch.softmax(z, -1).reshape(-1, V)
    decided = (1 - p[torch.arange(B * L), y]) > 1e-6  # (rows with p_y = 1 in float64 carry no curvature)
    torch.testing.assert_close(w.double()[decided], s[decided], rtol=1e-6, atol=0)
    ours = torch.block_diag(*[si * (torch.diag(q) - torch.outer(q, q)) for si, q in zip(s, p, strict=True)])
    rank_one = torch.block_diag(*[2 * c / (B * L) * torch.outer(q, q) for q in p])
    exact = torch.func.hessian(loss_of)(z).reshape(B * L * V, B * L * V)
    torch.testing.assert_close(ours + rank_one, exact, rtol=1e-9, atol=1e-12)

    model, loss_fn = _gpt_loss(loss_of, B, L)
    with torch.no_grad():
        model.head.weight.mul_(40)  # large logits: the z-loss's share of the gradient is well above the old tolerance
    specs = find_blocks(model)
    got = _layer1_w2(model, loss_fn, 1024, "ggn/W2W2")
    run, zero = _perturbed(model, loss_fn, {s.name: s for s in specs}["layer1/ffn"], "W_2", None)
    J = torch.func.jacrev(lambda d: run(d)[1].reshape(-1))(zero).reshape(B * L * V, -1)
    logits = run(zero)[1]
    H = torch.func.hessian(loss_of)(logits.detach()).reshape(B * L * V, B * L * V)
    truth = float(torch.linalg.eigvalsh(J.T @ H @ J)[-1])
    assert got == pytest.approx(truth, rel=0.15), (got, truth)
    # one kept sequence of three (a heavier z-loss: its rows are read as such): the kept tokens' keys are scaled by
    # the batch's total weight over theirs, the other rows' weights read from their whole rows (LinearLogits)
    heavy = 0.05
    with Capture(specs, max_tokens=L, logits_module=model.head) as cap:
        logits = model(_gpt_batch(B, L))
        loss = F.cross_entropy(logits.reshape(-1, V), y) + heavy * logits.reshape(-1, V).logsumexp(-1).pow(2).mean()
        sampled = sample_outputs(cap, loss, 4, generator=torch.Generator().manual_seed(0))
        loss.backward()
    assert sampled.note == LSE_TERM_NOTE
    s = (1 + 2 * heavy * logits.detach().reshape(-1, V).logsumexp(-1)) / (B * L)
    scales = {b.sample_scale for b in cap.blocks() if "output_samples" in b.inputs}
    assert len(scales) == 1 and scales.pop() == pytest.approx(float(s.sum() / s[:L].sum()), rel=1e-5)


def test_near_uniform_predictions_cannot_tell_label_smoothing_and_say_so():
    """While the predictions off the label are near uniform (initialisation), a label-smoothed cross-entropy's
    gradient is a hard-label one of weight (1 - eps) w: the weights read 0.9x with eps = 0.1, so the loss weights say
    they cannot tell (loss="auto"), and say nothing once the predictions tell them apart or the loss is stated."""
    from curvwatch.realloss.weights import HIDDEN_SMOOTHING, loss_weights

    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 50, (64,), generator=gen)
    for scale, smoothing in ((1e-3, 0.1), (1e-3, 0.0), (3.0, 0.0)):
        z = (scale * torch.randn(64, 50, generator=gen, dtype=torch.float64)).requires_grad_()
        (g,) = torch.autograd.grad(F.cross_entropy(z, y, label_smoothing=smoothing), z)
        w, kind, note = loss_weights(z.detach(), g, "auto")
        if scale < 1:  # near uniform: read as hard labels, the note names the smoothing it cannot see
            assert kind.value == "cross_entropy" and note is not None and "label smoothing up to eps" in note
            assert float(w.sum()) == pytest.approx(1 - smoothing, rel=1e-3)
            assert loss_weights(z.detach(), g, "cross_entropy")[2] is None  # stated: no note
        else:  # trained-like predictions: hard labels are told apart from smoothing; no note
            assert note is None and float(w.sum()) == pytest.approx(1.0, rel=1e-6)
    # a smoothing the predictions can show is read as such (the mean over the rows), not as hard labels
    z = (3.0 * torch.randn(64, 50, generator=gen, dtype=torch.float64)).requires_grad_()
    (g,) = torch.autograd.grad(F.cross_entropy(z, y, label_smoothing=2 * HIDDEN_SMOOTHING), z)
    w, _, note = loss_weights(z.detach(), g, "auto")
    assert "label-smoothing form" in note and float(w.sum()) == pytest.approx(1.0, rel=1e-6)


def test_kept_tokens_scale_by_their_weight_when_near_uniform_predictions_leave_a_note():
    """The note about hidden label smoothing is about hard labels: the batch's total weight is still read from every
    row (one kept sequence of three: the kept tokens' keys scale by 3, at initialisation too, in float32 and under a
    loss scale)."""
    torch.manual_seed(0)
    model = _gpt()
    idx = _gpt_batch(3, 6)
    for scale in (1.0, 2.0**16):  # a loss scale is undone by the factor
        with Capture(find_blocks(model), max_tokens=6, logits_module=model.head) as cap:
            logits = model(idx)
            loss = scale * F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1))
            sampled = sample_outputs(cap, loss, 4, factor=1 / scale, generator=torch.Generator().manual_seed(0))
            loss.backward()
        assert sampled.note is not None and "label smoothing up to" in sampled.note
        scales = {b.sample_scale for b in cap.blocks() if "output_samples" in b.inputs}
        assert len(scales) == 1 and scales.pop() == pytest.approx(3.0, rel=1e-5), scale


# -- batched sampled passes (curvwatch.realloss.sampling.passes_at_once) ---------------------------------------------

# float64 batched passes vs one at a time: the same products summed in another order (measured <= 4e-16 relative)
_BATCHED_RTOL = 1e-12


def _hf_llama_lm():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=13, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)  # fmt: skip
    config._attn_implementation = "sdpa"

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = tf.LlamaForCausalLM(config).double()
            self.head = self.model.lm_head

        def forward(self, idx):
            return self.model(input_ids=idx).logits

    return LM()


def _sampled(model, idx, samples: int = 16, head_hook: bool = False, call=None, **kwargs):
    """``(Sampled, {block: output_samples})`` of one capture of ``model`` on ``idx`` (12 tokens kept), the passes
    batched on this CPU unless ``batched=False`` is given; ``call``: what runs the forward (default ``model``)."""
    kwargs.setdefault("batched", True)
    handle = model.head.register_forward_hook(lambda m, a, o: o * 0.5) if head_hook else None
    try:
        with Capture(find_blocks(model), max_tokens=12, logits_module=model.head) as cap:
            logits = (model if call is None else call)(idx)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = sample_outputs(cap, loss, samples, generator=torch.Generator().manual_seed(3), **kwargs)
            loss.backward()
    finally:
        if handle is not None:
            handle.remove()
    assert not caught, [str(w.message) for w in caught]  # no vmap fallback warning reaches the user
    return out, {b.spec.name: b.inputs["output_samples"] for b in cap.blocks() if "output_samples" in b.inputs}


@pytest.mark.parametrize(
    "build",
    [lambda: _gpt(), lambda: _gpt(attention="math"), _hf_llama_lm],
    ids=["gpt-sdpa", "gpt-math", "hf-llama-sdpa"],
)
@pytest.mark.parametrize("head_hook", [False, True], ids=["linear-head", "at-the-logits"])
def test_batched_sampled_passes_equal_one_at_a_time(build, head_hook):
    """The 16 sampled passes as one batched backward pass, and in batches of 5 (5, 5, 5, 1: a memory budget), give
    every block the samples of 16 passes one at a time, in float64 to round-off, from a linear logits module's input
    and from the logits; the SDPA backward (no batching rule on CPU: run per sample inside the batch) says nothing."""
    from curvwatch.realloss.sampling import pass_bytes

    model = build()
    idx = torch.randint(0, 13, (3, 6), generator=torch.Generator().manual_seed(2))
    one, expected = _sampled(model, idx, head_hook=head_hook, batched=False)
    assert one.at_once == 1 and len(expected) == 4
    together, batched = _sampled(model, idx, head_hook=head_hook)
    assert together.at_once == 16 and together.unbatched is None
    # the budget of 5 samples (pass_bytes of this capture: read from a capture of the same step)
    handle = model.head.register_forward_hook(lambda m, a, o: o * 0.5) if head_hook else None
    with Capture(find_blocks(model), max_tokens=12, logits_module=model.head) as cap:
        model(idx)
        live = cap.live_outputs()
        start = cap.logits if cap.logits is not None else cap.logits_input
        budget = 5.5 * pass_bytes(live, start) / 2**20
    if handle is not None:
        handle.remove()
    fives, chunked = _sampled(model, idx, head_hook=head_hook, memory_mb=budget)
    assert fives.at_once == 5 and fives.blocks == one.blocks
    for name, s in expected.items():
        for got in (batched[name], chunked[name]):
            assert_close_report(got, s, _BATCHED_RTOL, f"{name} samples")


def test_sampled_passes_run_one_at_a_time_where_a_batch_cannot():
    """One place chooses (passes_at_once): one at a time on a CPU unless asked (``batched=True``), with
    ``batched=False`` (the model's own backward hooks), under
    sharded weights (FSDP2's hooks around each pass), when one sample's pass does not fit the memory budget, for a
    single sample; a batched pass that raises (a tensor hook reading a value: no ``.item()`` under vmap; a hook that
    fails on the second batch, after the first was stored) is run again one sample at a time with the same draws, the
    samples left too, and says why."""
    from curvwatch.realloss.sampling import pass_bytes, passes_at_once

    model = _gpt()
    idx = torch.randint(0, 13, (3, 6), generator=torch.Generator().manual_seed(2))
    with Capture(find_blocks(model), max_tokens=12, logits_module=model.head) as cap:
        model(idx)
        live, start = cap.live_outputs(), cap.logits_input
        assert passes_at_once(live, start, 16, batched=True) == 16
        assert passes_at_once(live, start, 16) == 1  # on a CPU, left to the device
        assert passes_at_once(live, start, 16, batched=False) == 1
        assert passes_at_once(live, start, 16, batched=True, sharded=True) == 1
        assert passes_at_once(live, start, 1, batched=True) == 1
        assert passes_at_once(live, start, 16, batched=True, memory_mb=1e-6) == 1
    _, expected = _sampled(model, idx, batched=False)
    seen = []
    handle = model.blocks[1].mlp.register_forward_hook(
        lambda m, a, o: o.register_hook(lambda g: seen.append(float(g.abs().sum()))) and None
    )
    try:
        out, got = _sampled(model, idx)
    finally:
        handle.remove()
    assert out.at_once == 16 and out.unbatched is not None and "item" in out.unbatched, out.unbatched
    assert len(seen) == 16 + 1  # the 16 passes one at a time, and the real backward
    for name, s in expected.items():
        assert_close_report(got[name], s, _BATCHED_RTOL, f"{name} samples")
    # batches of 5: the first one stored, the second raises, the 11 samples left one at a time
    batches = []

    def second_batch_fails(g):
        if torch._C._functorch.is_batchedtensor(g):
            batches.append(g.shape)
            if len(batches) == 2:
                raise RuntimeError("a hook that cannot take a batch")

    handle = model.blocks[1].mlp.register_forward_hook(lambda m, a, o: o.register_hook(second_batch_fails) and None)
    try:
        out, got = _sampled(model, idx, memory_mb=5.5 * pass_bytes(live, start) / 2**20)
    finally:
        handle.remove()
    assert out.at_once == 5 and len(batches) == 2 and "cannot take a batch" in out.unbatched, (out, batches)
    for name, s in expected.items():
        assert_close_report(got[name], s, _BATCHED_RTOL, f"{name} samples")


def test_a_batched_pass_stays_within_its_memory_budget():
    """The live CPU memory of the sampling (torch's profiler) over that of the passes one at a time is at most the
    budget (4 MiB: 8 of the 16 samples at once here), and the 16 samples at once add at most pass_bytes a sample."""
    from curvwatch.realloss.sampling import pass_bytes

    V, L, B = 301, 32, 8
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=L, n_layer=2, n_head=2, d_model=64, d_ff=256, dropout=0.0))
    idx = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))

    def peak(**kwargs) -> tuple[float, int, int]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            with Capture(find_blocks(model), max_tokens=64, logits_module=model.head) as cap:
                loss = F.cross_entropy(model(idx).reshape(-1, V), idx.reshape(-1))
                per_sample = pass_bytes(cap.live_outputs(), cap.logits_input)
                with torch.profiler.record_function("sampling"):
                    out = sample_outputs(cap, loss, 16, generator=torch.Generator().manual_seed(0), **kwargs)
                loss.backward()
        events = prof.profiler.kineto_results.events()
        timeline = live_memory(events)
        ((t0, t1),) = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == "sampling"]
        return max(b for t, b in timeline if t0 <= t <= t1), out.at_once, per_sample

    loop, _, per_sample = peak(batched=False)
    budget = 8 * per_sample / 2**20
    chunked, at_once, _ = peak(batched=True, memory_mb=budget)
    together, all_, _ = peak(batched=True)
    assert (at_once, all_) == (8, 16)
    assert 0 < chunked - loop <= budget * 2**20, (chunked - loop, budget * 2**20)
    assert together - loop <= 16 * per_sample, (together - loop, 16 * per_sample)


@pytest.mark.parametrize("wrap", ["checkpoint", "compile"])
def test_batched_sampled_passes_through_checkpointed_and_compiled_models(wrap):
    """Non-reentrant activation checkpointing (the checkpointed layers recomputed once for the whole batch of samples)
    and ``torch.compile`` (run eagerly while a capture is open) take the batched pass, with the samples of the passes
    one at a time, float64 to round-off."""
    from torch.utils.checkpoint import checkpoint

    model = _gpt()
    idx = torch.randint(0, 13, (3, 6), generator=torch.Generator().manual_seed(2))
    _, expected = _sampled(model, idx, batched=False)
    run = model
    if wrap == "checkpoint":
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    else:
        run = torch.compile(model)
    out, got = _sampled(model, idx, call=run)
    assert out.at_once == 16 and out.unbatched is None
    for name, s in expected.items():
        assert_close_report(got[name], s, _BATCHED_RTOL, f"{name} samples")


def test_the_models_own_backward_hooks_see_the_sampled_passes_one_at_a_time():
    """A model with a full backward hook of its own: the monitor runs the sampled passes one at a time (the hook sees
    one gradient per call, never a batch of them), ``Sharpness.samples`` calls more per full evaluation."""
    import lightning as L

    from curvwatch import CurvatureMonitor
    from curvwatch.realloss import plugin
    from tests.ddp_script import TinyLM, loader

    chosen, calls = [], []
    sample_outputs_ = plugin.sample_outputs

    def spy(*args, **kwargs):
        out = sample_outputs_(*args, **kwargs)
        chosen.append((kwargs["batched"], out.at_once))
        return out

    L.seed_everything(0)
    model = TinyLM()
    model.model.blocks[0].mlp.register_full_backward_hook(
        lambda m, gi, go: calls.append(torch._C._functorch.is_batchedtensor(go[0]))
    )
    monitor = CurvatureMonitor(every_n_train_steps=2, sharpness=Sharpness(samples=4), verbose=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, callbacks=[monitor], enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nowhere to write its numbers|.*label smoothing")
        original, plugin.sample_outputs = plugin.sample_outputs, spy
        try:
            trainer.fit(model, loader())
        finally:
            plugin.sample_outputs = original
    assert chosen == [(False, 1), (False, 1)]  # steps 0 and 2
    assert len(calls) == 3 + 2 * 4 and not any(calls)

"""Each built-in adapter, end to end: captured tensors -> closed form == curvwatch.reference (torch.func)."""

from __future__ import annotations

import pytest
import torch

from curvwatch import reference
from curvwatch.adapters import find_blocks
from curvwatch.capture import Capture
from curvwatch.closed_form.settings import Lanczos
from curvwatch.engine import evaluate_block, kernel_inputs
from tests.test_adapters import CASES, B, L
from tests.utils import TOL, assert_close_report

# one case per built-in adapter (own GPT, nn encoder/decoder layers, HF GPT-2 and BERT), masks included
ADAPTER_CASES = [
    "gpt-post-relu-math",
    "torch-enc-lf-post-gelu-kpm-causal",
    "torch-dec-lf-pre",
    "gpt2-eager-right",
    "bert-sdpa-decoder-right",
]


def _reference_norms(block) -> dict[str, torch.Tensor]:
    kwargs = kernel_inputs(block, torch.float64)
    if block.spec.kind in ("attention", "cross_attention"):  # cross: keys and values from the memory
        return reference.dense_to_norms(reference.multi_head_attention_blocks(**kwargs))
    if block.spec.kind == "ffn":
        return reference.dense_to_norms(reference.ffn_blocks(**kwargs))
    # LayerNorm: the exact contracted Hessian norm (affine weight included) and, unweighted, J and H norms
    if kwargs.get("row_mask") is not None:
        keep = kwargs["row_mask"]
        X, G = kwargs["X"][keep], kwargs["grad_output"][keep]
    else:
        X, G = kwargs["X"], kwargs["grad_output"]
    contracted = reference.layernorm_contracted_hessian(X, G, eps=kwargs["eps"], weight=kwargs.get("weight"))
    unit = reference.dense_to_norms(reference.layernorm_dense(X, eps=kwargs["eps"]))
    return {
        "contracted_hessian_norm": reference.spectral_norm(contracted),
        "jacobian_norm": unit["jacobian"],
        "hessian_norm": unit["hessian"],
    }


@pytest.mark.parametrize("case", ADAPTER_CASES)
def test_adapter_blocks_match_reference(case):
    model, run, _, _, _, _ = CASES[case]()
    specs = [s for s in find_blocks(model) if s.layer == 0]
    with Capture(specs, max_tokens=B * L) as capture:
        run(model).backward()
    kinds = set()
    for block in capture.blocks():
        assert block.reason is None, f"{block.spec.name}: {block.reason}"
        if block.spec.kind == "ffn" and block.params.get("activation") == "gelu_tanh":
            continue  # the reference module has exact-erf GELU only; gelu_tanh is tested in test_ffn.py
        out = evaluate_block(
            block, lanczos=Lanczos(tol=0.0, max_iter=None, max_basis=None, warn=False), dtype=torch.float64
        )
        expected = _reference_norms(block)
        common = sorted(set(out) & set(expected))
        assert len(common) >= 3, (block.spec.name, sorted(out))
        for key in common:
            assert_close_report(out[key], expected[key], TOL["float64"], f"{case}:{block.spec.name}:{key}", atol=1e-12)
        kinds.add(block.spec.kind)
    assert {"attention", "layernorm"} <= kinds

"""The curvature of the real training loss: sampled output gradients, optimizer thresholds, stability ratios.

The closed forms' ``outer/...`` keys use a stand-in output curvature. This package supplies what the real one needs,
so the kernels can give each attention and FFN block the Gauss-Newton curvature of the loss actually trained
(``ggn/...``, ``sharpness/...``) and the optimizer's threshold can turn it into an edge-of-stability ratio
(``stability/...``):

* :mod:`~curvwatch.realloss.weights`: the loss weights ``w_n`` of ``l = sum_n w_n ell(z_n, y_n)``, read from the real
  loss's gradient at the logits, so the mean over tokens, ignored labels, a sum, per-token weights, gradient
  accumulation and AMP scaling need no configuration;
* :mod:`~curvwatch.realloss.samplers`: logit gradients ``r`` with ``E[r r^T]`` = the Gauss-Newton matrix at the logits;
* :mod:`~curvwatch.realloss.sampling`: the sampled backward passes from the logits to every captured block output;
* :mod:`~curvwatch.realloss.stability`: the stability threshold of the optimizer updating a block: gradient descent
  with heavy-ball momentum ``beta`` is stable on a quadratic while ``lambda_max < (2 + 2 beta) / lr``; Adam/AdamW
  (preconditioned by ``P = diag(sqrt(v_hat) + eps)``) while ``lambda_max(P^-1 H) < (2 + 2 beta_1) / ((1 - beta_1)
  lr)`` (38/lr at ``beta_1 = 0.9``; Cohen et al. 2021, 2022). The ratio sharpness / threshold is ``>= 1`` past the
  edge of stability;
* :mod:`~curvwatch.realloss.verify`: the opt-in check of the sharpness against the true block Hessian;
* :mod:`~curvwatch.realloss.logits`: finding the module whose output is the logits;
* :mod:`~curvwatch.realloss.plugin`: :class:`RealLoss`, what the monitor plugs in.

Example:
    >>> import torch
    >>> z = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]], requires_grad=True)
    >>> loss = torch.nn.functional.cross_entropy(z, torch.tensor([0, 2]))
    >>> g, = torch.autograd.grad(loss, z)
    >>> w, kind, note = loss_weights(z.detach(), g, "auto")
    >>> kind.value, [round(float(v), 6) for v in w], note
    ('cross_entropy', [0.5, 0.5], None)
"""

from curvwatch.realloss.logits import LOGITS_NAMES, find_logits_module
from curvwatch.realloss.plugin import RealLoss, unresolved_keys
from curvwatch.realloss.sampling import Sampled, sample_outputs
from curvwatch.realloss.stability import StabilityRule, param_index_map, stability_keys, stability_rule
from curvwatch.realloss.weights import LossKind, loss_weights

__all__ = [
    "LOGITS_NAMES",
    "LossKind",
    "RealLoss",
    "Sampled",
    "StabilityRule",
    "find_logits_module",
    "loss_weights",
    "param_index_map",
    "sample_outputs",
    "stability_keys",
    "stability_rule",
    "unresolved_keys",
]

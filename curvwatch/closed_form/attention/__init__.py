"""Closed-form Hessian blocks of multi-head softmax attention, by responsibility.

* :mod:`~.kernels`: the entry points :func:`self_attention` and :func:`multi_head_attention`;
* :mod:`~.operator`: the closed-form Hessian operator (:class:`AttentionOperator`) and its exact ``VV`` pieces;
* :mod:`~.views`: grouped-query attention's query-head and kv-group views;
* :mod:`~.terms`: the exact spectral norms, the bound terms and the corrected bounds;
* :mod:`~.layout`: the tensor layouts of the operator's products.
"""

from .._qk_norm_blocks import NORM_PAIRS
from .kernels import multi_head_attention, self_attention
from .operator import ATTENTION_PAIRS, GROUP_PAIRS, QUERY_PAIRS, AttentionOperator, HeadWeights, softmax_jvp
from .views import GroupView, QueryView, group_keys

__all__ = [
    "self_attention",
    "multi_head_attention",
    "AttentionOperator",
    "HeadWeights",
    "QueryView",
    "GroupView",
    "group_keys",
    "softmax_jvp",
    "ATTENTION_PAIRS",
    "QUERY_PAIRS",
    "GROUP_PAIRS",
    "NORM_PAIRS",
]

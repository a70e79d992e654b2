"""The decoder-only Transformer and the shared model functions under their
earlier module name: ``seqcache.training.model`` is
``seqcache.training.models.decoder`` plus ``seqcache.training.models.common``
(``create``, ``init_params``, ``abstract_model``, ``split_params``,
``logical_axes``, ``count_params``). New code imports ``seqcache.training.models``.
"""

from seqcache.training.models.common import (  # noqa: F401
    DTYPES,
    Normal,
    Ones,
    abstract_model,
    batch_logits,
    count_params,
    create,
    init_params,
    logical_axes,
    split_params,
)
from seqcache.training.models.decoder import (  # noqa: F401
    MLP,
    Attention,
    Block,
    RMSNorm,
    Transformer,
    apply,
    attention_mask,
    rotary,
    shift_right_by_segment,
)

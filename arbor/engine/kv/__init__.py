"""Engine state per sequence: the paged KV cache and its attention (``paged``), layer-wise host/device
KV tiers (``tiers``, ``transfer``), and linear-attention recurrent states (``state_cache``)."""

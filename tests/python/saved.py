"""Bytes a computation keeps for backward, measured with saved-tensor hooks."""

import torch


def saved_bytes(fn, params=()):
    """Bytes kept for backward by fn(), counting each storage once, parameters excluded."""
    storages = {}
    skip = {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            storages[st.data_ptr()] = st.nbytes()
        # A detached alias, not t: a saved output returned as it came ties its graph to itself in
        # a cycle through C++ that the collector cannot free (the whole model stayed alive).
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out

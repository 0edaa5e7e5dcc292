"""What the library and its applications (the bench, the frontier) share about a memory-saving
method: the exception naming why one cannot run here, and checkpointing every layer of a
transformers model as all of them apply it."""


class Unavailable(Exception):
    """A policy or method that cannot run here (Liger-Kernel without CUDA, a family Liger has no
    patch for, a model without gradient checkpointing): its row says why."""


def enable_checkpointing(model):
    """Activation checkpointing of every layer (use_reentrant=False); False, changing nothing,
    where the model does not support it."""
    if not model.supports_gradient_checkpointing:
        return False
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return True

"""The in-place patch: a module is re-classed as a subclass of its own class with tempo's
forward (the same object: its parameters, state dict, hooks and every reference a user holds
to it are unchanged), and a patched model pickles, deep-copies and undoes exactly. Also the
tests a fused forward makes before it reads a sub-module's parameters instead of calling it."""

import functools

from torch.nn.modules import module as _nn_module


def subclass(module, prefix, forward):
    """Turns `module` into an instance of a subclass of its class with `forward` (state,
    parameters and isinstance checks unchanged)."""
    module.__class__ = subclass_of(type(module), prefix, forward)
    return module


def subclass_of(cls, prefix, forward):
    key = (cls, prefix, forward)
    if key not in _SUBCLASSES:
        method = forward
        if getattr(forward, "keeps_signature", False):
            # a forward taking (*args, **kwargs) for the model's own: it shows the model's signature, which the
            # HF Trainer reads (the dataset columns it passes, whether the forward takes num_items_in_batch)
            def method(self, *args, **kwargs):
                return forward(self, *args, **kwargs)

            functools.update_wrapper(method, cls.forward)
        # A transformers model (a class with save_pretrained) keeps its name and module: transformers dispatches
        # on them (save_pretrained writes config.json's "architectures" from the class name, which vLLM, TGI
        # and converters read; a class outside transformers.* counts as custom code, whose checkpoint
        # conversions and weight initialisation differ), so a patched model loads and saves as the unpatched
        # one. Layers show the prefix (print(model) shows what was patched).
        model = hasattr(cls, "save_pretrained")
        name = cls.__name__ if model else prefix + cls.__name__
        _SUBCLASSES[key] = type(
            name,
            (cls,),
            {
                "forward": method,
                "__module__": cls.__module__ if model else __name__,
                "__qualname__": name,
                "_tempo_patch": (cls, prefix, forward),
                "__reduce_ex__": _reduce_patched,
            },
        )
    return _SUBCLASSES[key]


_SUBCLASSES = {}


def _reduce_patched(self, protocol):
    # The subclass is made at run time, so pickle cannot find it by name: it is pickled as the
    # recipe that makes it (the original class, which pickle finds, and a module-level forward),
    # so torch.save(model) / torch.load and copy.deepcopy work on a patched model.
    return _new_patched, self._tempo_patch, self.__getstate__()


def _new_patched(cls, prefix, forward):
    return object.__new__(subclass_of(cls, prefix, forward))


def is_patched(module):
    """Whether tempo.optimize re-classed `module`: tempo's own class, or a subclass made by subclass_of
    (a transformers model's keeps its class's name and module)."""
    cls = type(module)
    return cls.__module__.startswith("tempo.") or "_tempo_patch" in vars(cls)


def retype(cls):
    """A rule's replace for a torch module: re-class it in place as tempo's subclass of its class
    (same object, parameters, state dict, hooks, and every reference the user holds to it)."""

    def replace(m):
        m.__class__ = cls
        return m

    return replace


def plain(module, *classes):
    """`module` is exactly one of `classes` (torch.nn.Linear; torch's or tempo's LayerNorm,
    Dropout) with no hooks: its parameters are all it computes with, so a fused forward may
    read them instead of calling it. A module wrapped or replaced after tempo.optimize (peft's
    LoRA layers, parametrizations, quantized layers) is not, and is called as it is; so is one
    with a hook that calling it would run: its own forward or backward hooks (Opacus's
    per-sample gradients, Captum), or hooks on every module (torch.nn.modules.module's
    register_module_*_hook, as module trackers use)."""
    return type(module) in classes and not hooked(module)


def hooked(module):
    # the condition under which torch.nn.Module.__call__ runs hooks rather than forward alone
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or _nn_module._global_forward_hooks
        or _nn_module._global_forward_pre_hooks
        or _nn_module._global_backward_hooks
        or _nn_module._global_backward_pre_hooks
    )


def original_forward(self, *args, **kwargs):
    return type(self).__mro__[1].forward(self, *args, **kwargs)

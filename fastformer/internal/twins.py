"""Turning torch modules into their fastformer twins without copying a parameter."""
from typing import Dict

import torch

#: torch class -> fastformer twin class, filled by :func:`twin_of`.
TWINS: Dict[type, type] = {}
_OWN_CONTAINERS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def drop_activation_shadow(module: torch.nn.Module) -> None:
    """Undo torch's ``Transformer{En,De}coderLayer.__setstate__`` (deepcopy, pickle) on ``module``: when
    the activation is a module, kept in ``_modules``, it is missing from the state that method sees,
    so it stores ``F.relu`` as an instance attribute, which shadows the module (relu is computed)."""
    if "activation" in module._modules and "activation" in module.__dict__:
        del module.__dict__["activation"]


def twin_of(torch_cls: type):
    """Class decorator: register the decorated class as the twin of ``torch_cls``."""
    def register(cls):
        TWINS[torch_cls] = cls
        return cls
    return register


def share_state(cls, module: torch.nn.Module):
    """A new ``cls`` object holding ``module``'s attributes, parameters, buffers, children and hooks.

    The twin classes subclass the torch classes and keep their attribute layout, so the
    twin's state is the torch module's state: the parameter objects are shared (not
    copied), the training flag is kept, and ``state_dict`` keys are identical. The
    parameter, buffer and child containers are copied so that swapping the twin's
    children does not rewire the torch module; the hook dicts are shared, so handles
    returned by ``register_*_hook`` on the torch module still remove their hooks.
    """
    twin = cls.__new__(cls)
    twin.__dict__.update({key: value.copy() if key in _OWN_CONTAINERS else value
                          for key, value in module.__dict__.items()})
    check = getattr(twin, "_check_twin", None)
    if check is not None:
        check()
    return twin


def swap_children(module: torch.nn.Module) -> None:
    """Replace, in place and recursively, every child of ``module`` that has a twin."""
    for name, child in list(module.named_children()):
        new = swap_tree(child)
        if new is not child:
            setattr(module, name, new)


def swap_tree(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every torch module of a twinned class (itself included) swapped for its twin."""
    twin_cls = TWINS.get(type(module))
    if twin_cls is not None:
        module = share_state(twin_cls, module)
    swap_children(module)
    return module

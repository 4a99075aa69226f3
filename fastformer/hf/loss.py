"""The LM head + cross-entropy of transformers' seq2seq models as one fused ``linear_cross_entropy``.

:func:`fuse_lm_loss` makes a ``*ForConditionalGeneration`` (in place) an instance of a subclass of its
own class whose ``forward``, in training mode with ``labels``, runs the base model and then
``fastformer.ops.linear_cross_entropy(hidden, lm_head.weight, labels, linear_bias=final_logits_bias)``:
the ``(B, T, V)`` logits are never materialised (nor the rows of ignored labels), so the output's ``logits`` is None (and absent from
the tuple of ``return_dict=False``, as transformers drops None fields). Everywhere else (evaluation,
generation, no labels, an output projection that is not a plain hook-free ``nn.Linear``) it is the
model's own forward, logits included.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) the fused loss reads the head's full weight: a
head sharded with a parent unit (the root, say: tied heads must be) is a plain ``nn.Linear`` whose
weight the parent's forward has unsharded; a head sharded on its own (``FSDPLinear``, whose only
hooks are FSDP's) is called with its forward redirected to the fused loss (:func:`_call_as_forward`),
so FSDP's hooks unshard the weight before, reshard it after and reduce-scatter its gradient in the
backward. That redirection runs in eager mode only: under ``torch.compile`` such a head takes the
model's own (unfused) forward.
"""
import functools
import importlib
import inspect
import logging
import sys
import warnings

import torch
from torch import nn

from .. import ops
from ..nn.packing import may_pack
from .attention import _PARTS, NAME, ROWS_UNUSED, fastformer_mask
from .layers import fsdp_unit, fused_subclass, plain

logger = logging.getLogger("fastformer.hf")
IGNORE_INDEX = -100  # transformers' CrossEntropyLoss default, what its seq2seq models pad labels with

SMOOTHING_ADVICE = (
    "a transformers Trainer with label_smoothing_factor > 0 takes the labels away from the model and "
    "smooths the loss from the full logits, so fastformer's fused loss (linear_cross_entropy: the LM head "
    "and cross-entropy without materialising the logits) does not run. Set label_smoothing_factor=0 in "
    "the TrainingArguments and pass the smoothing to fastformer instead: "
    "fastformer.convert(model, label_smoothing=0.1)")


def _trainer_smooths(max_depth=40) -> bool:
    """True if a transformers ``Trainer`` whose ``args.label_smoothing_factor > 0`` is on the call stack
    (looked up only when transformers' trainer module is already imported: nothing is imported here)."""
    trainer_mod = sys.modules.get("transformers.trainer")
    trainer_cls = getattr(trainer_mod, "Trainer", None)
    if trainer_cls is None:
        return False
    f = sys._getframe(1)
    for _ in range(max_depth):
        if f is None:
            return False
        obj = f.f_locals.get("self")
        if isinstance(obj, trainer_cls):
            return getattr(getattr(obj, "args", None), "label_smoothing_factor", 0) > 0
        f = f.f_back
    return False


def _flat_arguments(bound):
    """``bound.arguments`` without ``self``, the ``**kwargs`` dict merged in."""
    a = {}
    for name, value in bound.arguments.items():
        param = bound.signature.parameters[name]
        if param.kind is param.VAR_KEYWORD:
            a.update(value)
        elif name != "self":
            a[name] = value
    return a


def _unused_target_tail(labels, config):
    """The decoder's causal mask (B, 1, T, T), built as transformers builds it from a 2-D padding mask
    that is True up to each row's last label that is not ignored; None where every row ends in one, or
    where the model's attention is not fastformer's. Decoding is causal, so the positions after that
    label feed no loss term: marked ``ROWS_UNUSED``, they are masked keys and the decoder layers skip
    their rows. Built here as 4-D, which transformers passes to the layers as it is (it would copy a
    2-D mask, and a copy traced by torch.compile loses the mark)."""
    if getattr(config, "_attn_implementation", None) != NAME or not getattr(config, "is_causal", True):
        return None
    keep = labels.ne(IGNORE_INDEX)  # (B, T)
    if not torch.compiler.is_compiling() and bool(keep[:, -1].all()):  # traced: no branch on the data
        return None
    B, T = labels.shape
    cols = torch.arange(1, T + 1, device=labels.device)  # (T,) one past each column
    real = cols.le((keep * cols).amax(dim=1, keepdim=True))  # (B, T): column < one past the last kept
    mask = fastformer_mask(batch_size=B, q_length=T, kv_length=T, attention_mask=real, allow_is_causal_skip=False,
                           device=labels.device)
    if getattr(mask, _PARTS, (None,))[0] is None:
        return None  # a mask without its parts packs nothing: leave the decoder to transformers
    setattr(mask, ROWS_UNUSED, True)
    return mask


def _fsdp_head(head) -> bool:
    """Whether ``head`` is an ``nn.Linear`` that FSDP2's ``fully_shard`` made a unit of its own (alone or
    in a group), its forward ``nn.Linear``'s and its only forward hooks FSDP's."""
    if not fsdp_unit(head) or not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return False
    hooks = [*head._forward_pre_hooks.values(), *head._forward_hooks.values()]
    return all(getattr(h, "__module__", "").startswith("torch.distributed.fsdp.") for h in hooks)


def _call_as_forward(module, fn, *args):
    """``fn(*args)`` run as ``module``'s forward: ``module(*args)`` with ``module.forward`` swapped for
    ``fn`` during the call, so the module's hooks run around it (FSDP2's: unshard the parameters
    before, reshard after, and the backward hooks on the inputs and the output that unshard again and
    reduce-scatter the gradients), as PyTorch Lightning's ``_ForwardRedirection`` does."""
    own = module.__dict__.get("forward")  # an instance attribute forward, to put back

    def restore():
        if own is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = own

    def forward(*a):
        restore()  # a call of the module from inside fn gets its own forward
        return fn(*a)

    module.forward = forward
    try:
        return module(*args)
    finally:
        restore()


def _fused_loss_forward(model, spec, modeling, a, label_smoothing, sharded_head=False):
    """The model's own forward with labels, its ``lm_head(h) + final_logits_bias`` and
    ``CrossEntropyLoss`` replaced by one ``linear_cross_entropy``; returns ``Seq2SeqLMOutput`` with
    ``logits=None`` (or its tuple when ``return_dict`` is False). ``sharded_head``: the head is an
    FSDP2 unit of its own (:func:`_fsdp_head`), the loss computed as its forward."""
    from transformers.modeling_outputs import Seq2SeqLMOutput

    labels = a.pop("labels")
    return_dict = a.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    if spec.max_target_check and labels.shape[1] > model.max_target_positions:
        raise ValueError(f"Labels' sequence length {labels.shape[1]} cannot exceed the maximum allowed length of "
                         f"{model.max_target_positions} tokens.")
    if a.get("decoder_input_ids") is None and (spec.shift_ignores_embeds or a.get("decoder_inputs_embeds") is None):
        a["decoder_input_ids"] = spec.shift(modeling, labels, model)
    if spec.no_cache_with_labels:
        if a.get("use_cache"):
            logger.warning("The `use_cache` argument is changed to `False` since `labels` is provided.")
        a["use_cache"] = False
    elif a.get("use_cache") is None:
        a["use_cache"] = False  # nothing decodes from a training forward's cache, which would hold every position
    if a.get("decoder_attention_mask") is None and not a["use_cache"] and may_pack():
        a["decoder_attention_mask"] = _unused_target_tail(labels, model.config)
    if spec.base_forward is not None:
        outputs = spec.base_forward(modeling, model, a)
    else:
        outputs = getattr(model, model.base_model_prefix)(**a, return_dict=True)
    hidden = outputs.last_hidden_state
    head = model.get_output_embeddings()
    extra = getattr(model, "final_logits_bias", None) if spec.final_logits_bias else None
    if extra is not None:
        extra = extra.reshape(-1).to(hidden.device)
    labels = labels.to(hidden.device)
    keep = labels.ne(IGNORE_INDEX)  # (B, T): the head's GEMMs skip the ignored (padded) target rows
    # traced: no branch on the data, and the row count is data, a size only where dynamo may capture it
    select = may_pack() if torch.compiler.is_compiling() else not bool(keep.all()) and bool(keep.any())
    if select:
        hidden, labels = hidden[keep], labels[keep]  # (n, E), (n,)
    scale = spec.head_scale(model) if spec.head_scale is not None else None
    if scale is not None:  # T5's tied head: the decoder output scaled first (on the kept rows only)
        hidden = hidden * scale

    def head_loss(hidden, labels, extra):  # the head's parameters read here: under FSDP, once unsharded
        bias = head.bias if extra is None else extra if head.bias is None else head.bias + extra
        return ops.linear_cross_entropy(hidden, head.weight, labels, linear_bias=bias,
                                        label_smoothing=label_smoothing)

    if sharded_head:
        loss = _call_as_forward(head, head_loss, hidden, labels, extra)
    else:
        loss = head_loss(hidden, labels, extra)
    out = Seq2SeqLMOutput(
        loss=loss, logits=None, cache=outputs.cache,
        decoder_hidden_states=outputs.decoder_hidden_states, decoder_attentions=outputs.decoder_attentions,
        cross_attentions=outputs.cross_attentions, encoder_last_hidden_state=outputs.encoder_last_hidden_state,
        encoder_hidden_states=outputs.encoder_hidden_states, encoder_attentions=outputs.encoder_attentions)
    return out if return_dict else out.to_tuple()


def _make_forward(cls, spec):
    """The fused ``forward`` for transformers class ``cls`` (its signature, for generate() and the
    Trainer, is ``cls.forward``'s)."""
    orig = cls.forward
    sig = inspect.signature(orig)
    modeling = importlib.import_module(spec.module)  # here, not in forward: an import breaks a compiled graph

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        a = _flat_arguments(bound)
        labels = a.get("labels")
        ls = getattr(self, "_fastformer_label_smoothing", 0.0)
        if labels is not None and self.training:
            head = self.get_output_embeddings()
            if plain(head, nn.Linear):
                return _fused_loss_forward(self, spec, modeling, a, ls)
            if not torch.compiler.is_compiling() and _fsdp_head(head):  # the redirection runs in eager only
                return _fused_loss_forward(self, spec, modeling, a, ls, sharded_head=True)
        if labels is None and self.training and not getattr(self, "_fastformer_trainer_warned", False) \
                and _trainer_smooths():
            self._fastformer_trainer_warned = True
            warnings.warn("fastformer: " + SMOOTHING_ADVICE, stacklevel=2)
        out = orig(self, *args, **kwargs)
        if labels is not None and ls > 0:
            # evaluation with labels: the loss smoothed as in training, from the logits computed anyway
            logits = out["logits"] if isinstance(out, dict) else out[1]
            loss = ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.to(logits.device).reshape(-1),
                                     label_smoothing=ls)
            if isinstance(out, dict):
                out["loss"] = loss
            else:
                out = (loss,) + tuple(out[1:])
        return out

    return forward


def fuse_lm_loss(model, spec, label_smoothing: float) -> None:
    """Make ``model`` (a ``*ForConditionalGeneration``, in place: same object, parameters, buffers and
    hooks) compute its training loss with ``linear_cross_entropy`` and ``label_smoothing``.

    Without labels, or in eval mode, it is the model's own forward (logits materialised, as generation
    and evaluation need them), except that with ``label_smoothing > 0`` the loss returned with labels
    in eval mode is smoothed too, so training and evaluation losses agree.
    """
    model._fastformer_label_smoothing = float(label_smoothing)
    cls = type(model)
    if getattr(cls, "_fastformer_original_class", None) is None:
        model.__class__ = fused_subclass(cls, _make_forward(cls, spec))
        try:  # transformers keys the outputs it records (output_hidden_states=...) on the class
            from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
            _CAN_RECORD_REGISTRY[model] = model._can_record_outputs
        except (ImportError, AttributeError):
            pass

"""Fingerprints of the transformers code that fastformer's Hugging Face integration mirrors or relies on.

The fused layer forwards (``layers.py``), the fused LM loss (``loss.py``) and the attention interface
(``attention.py``) each repeat what a transformers function does. When a transformers release changes one
of those functions, the fused model could silently differ from the plain one. So ``convert()`` and
``register()`` do not compare version numbers: they compare the code. A fingerprint is a hash of a
function's syntax tree (docstring and decorators left out, so formatting, comments and documentation
changes do not count); ``_fingerprints.RECORDED`` holds, for each transformers release the test suite ran
on, the fingerprint of every watched function. A release is accepted for a family when its functions
have the fingerprints of one recorded release; otherwise the error names each function whose code is
not one fastformer was checked against.

Read from the source files, never by importing or calling the code, so ``tools/hf_fingerprints.py``
computes the same fingerprints from the wheels of any release without installing it.
"""
import ast
import hashlib
import importlib.util
import os
from typing import Dict, Iterable, Mapping, Optional, Tuple

_M = "transformers.models."

# What each family's fused code mirrors: "module:Class.method" or "module:function".
SHARED = (
    "transformers.masking_utils:sdpa_mask",                    # fastformer_mask calls it and reads its result
    "transformers.masking_utils:causal_mask_function",         # the masks it recognises as causal ...
    "transformers.masking_utils:bidirectional_mask_function",  # ... or as padding only
    "transformers.integrations.sdpa_attention:sdpa_attention_forward",  # the contract the interface keeps
    # the activations convert() maps to feed_forward's (patch.activation_name)
    "transformers.activations:GELUActivation.__init__",
    "transformers.activations:GELUActivation.forward",
    "transformers.activations:GELUTanh.__init__",
    "transformers.activations:GELUTanh.forward",
    "transformers.activations:NewGELUActivation.forward",
    "transformers.activations:SiLUActivation.forward",
)


def _family(module: str, prefix: str, lm: str, extra: Tuple[str, ...] = ()) -> Tuple[str, ...]:
    mod = _M + module
    names = [f"{mod}:{prefix}{cls}.{meth}" for cls in ("Attention", "EncoderLayer", "DecoderLayer")
             for meth in ("__init__", "forward")]
    names += [f"{mod}:{prefix}{cls}.forward" for cls in ("Encoder", "Decoder", "Model")]
    names += [f"{mod}:{lm}.__init__", f"{mod}:{lm}.forward"]
    return tuple(names) + tuple(f"{mod}:{name}" for name in extra)


def _t5_family(name: str, prefix: str) -> Tuple[str, ...]:
    """What t5.py mirrors of a T5-shaped family: the block and its sub-layers (inlined), the attention
    (its bias computed as the table), the stack and model forwards around them, the LM forward (head,
    scaling, shift) and the config's derived settings (gated act, scale_decoder_outputs)."""
    mod = f"{_M}{name}.modeling_{name}"
    init_and_forward = ("LayerNorm", "DenseActDense", "DenseGatedActDense", "LayerFF", "Attention",
                        "LayerSelfAttention", "LayerCrossAttention", "Block")
    names = [f"{mod}:{prefix}{cls}.{meth}" for cls in init_and_forward for meth in ("__init__", "forward")]
    names += [f"{mod}:{prefix}Attention.{meth}" for meth in ("compute_bias", "_relative_position_bucket")]
    names += [f"{mod}:{prefix}{cls}.forward" for cls in ("Stack", "Model", "EncoderModel")]
    names += [f"{mod}:{prefix}ForConditionalGeneration.{meth}" for meth in ("__init__", "forward")]
    names += [f"{mod}:{prefix}PreTrainedModel._shift_right",
              f"{_M}{name}.configuration_{name}:{prefix}Config.__post_init__"]
    return tuple(names)


FAMILIES: Dict[str, Tuple[str, ...]] = {
    "bart": _family("bart.modeling_bart", "Bart", "BartForConditionalGeneration", ("shift_tokens_right",)),
    "marian": _family("marian.modeling_marian", "Marian", "MarianMTModel", ("shift_tokens_right",)),
    "mbart": _family("mbart.modeling_mbart", "MBart", "MBartForConditionalGeneration", ("shift_tokens_right",)),
    "m2m_100": _family("m2m_100.modeling_m2m_100", "M2M100", "M2M100ForConditionalGeneration",
                       ("shift_tokens_right",)),
    "whisper": _family("whisper.modeling_whisper", "Whisper", "WhisperForConditionalGeneration",
                       ("shift_tokens_right",)),
    "pegasus": _family("pegasus.modeling_pegasus", "Pegasus", "PegasusForConditionalGeneration",
                       ("shift_tokens_right",)),
    "t5": _t5_family("t5", "T5"),
    "mt5": _t5_family("mt5", "MT5"),
    "umt5": _t5_family("umt5", "UMT5"),
}


def _strip(node):
    """The function's tree without its docstring and decorators (documentation, not behaviour)."""
    node = ast.parse(ast.unparse(node)).body[0]  # a copy
    node.decorator_list = []
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        node.body = body[1:] or [ast.Pass()]
    return node


def _find(tree: ast.Module, qualname: str):
    """The ``def`` of ``Class.method`` or ``function`` at the top of ``tree``, or None."""
    scope = tree.body
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if last else (ast.ClassDef,)
        found = [n for n in scope if isinstance(n, kinds) and n.name == part]
        if not found:
            return None
        node = found[-1]  # a later definition wins, as at import
        if last:
            return node
        scope = node.body
    return None


def of_source(source: str, qualnames: Iterable[str]) -> Dict[str, Optional[str]]:
    """``{qualname: fingerprint}`` for functions of one module's ``source``; None where the module has no
    such ``def`` (a method the class inherits, or a function that is gone)."""
    tree = ast.parse(source)
    out = {}
    for q in qualnames:
        node = _find(tree, q)
        out[q] = None if node is None else hashlib.sha256(
            ast.dump(_strip(node), include_attributes=False).encode()).hexdigest()[:16]
    return out


def of_names(names: Iterable[str], read) -> Dict[str, Optional[str]]:
    """``{"module:qualname": fingerprint}``; ``read(module)`` returns the module's source, or None
    where there is no such module (then every name in it has fingerprint None)."""
    by_module: Dict[str, list] = {}
    for name in names:
        module, qualname = name.split(":")
        by_module.setdefault(module, []).append(qualname)
    out = {}
    for module, qualnames in by_module.items():
        source = read(module)
        prints = of_source(source, qualnames) if source is not None else dict.fromkeys(qualnames)
        out.update({f"{module}:{q}": fp for q, fp in prints.items()})
    return out


def _installed_source(module: str) -> Optional[str]:
    """The source of an importable module, read from its file without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not os.path.isfile(spec.origin):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


_cache: Dict[Tuple[str, str], Dict[str, Optional[str]]] = {}


def installed(names: Tuple[str, ...]) -> Dict[str, Optional[str]]:
    """The fingerprints of ``names`` in the installed transformers (read once per process)."""
    import transformers
    key = (transformers.__file__, names)
    if key not in _cache:
        _cache[key] = of_names(names, _installed_source)
    return _cache[key]


def _short(name: str) -> str:
    module, qualname = name.split(":")
    return f"{module.rsplit('.', 1)[-1]}.{qualname}"


def changed(current: Mapping[str, Optional[str]], recorded: Mapping[str, Mapping[str, str]]) -> Optional[Tuple[str, ...]]:
    """None when ``current`` equals the fingerprints of one recorded release on every name; else the names
    that differ from the newest recorded release (the one a user most likely came from)."""
    newest = None
    for version, prints in recorded.items():
        if all(prints.get(n) == fp for n, fp in current.items()):
            return None
        if newest is None or _key(version) > _key(newest):
            newest = version
    if newest is None:
        return tuple(current)
    return tuple(n for n, fp in current.items() if recorded[newest].get(n) != fp)


def _key(version: str):
    return tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[:3])


def check(family: Optional[str] = None) -> None:
    """Raise ``RuntimeError`` unless the installed transformers' code that fastformer mirrors for model type
    ``family`` (None: only what the attention interface relies on) is code fastformer was tested with."""
    import transformers

    from ._fingerprints import RECORDED
    from ._version import TESTED
    names = SHARED + (FAMILIES[family] if family is not None else ())
    bad = changed(installed(names), RECORDED)
    if not bad:
        return
    tested = ", ".join(sorted(RECORDED, key=_key))
    listed = ", ".join(_short(n) for n in bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
    what = f"the {family!r} model code" if family is not None else "its attention and mask code"
    raise RuntimeError(
        f"fastformer: transformers {transformers.__version__} is not supported: {what} differs from every release fastformer "
        f"was tested with ({tested}) in {listed}. fastformer's fused layers mirror that code, so a "
        f"converted model could silently differ from the original. Install a tested release, e.g. "
        f"pip install 'transformers=={TESTED}'.")


__all__ = ["SHARED", "FAMILIES", "of_source", "of_names", "installed", "changed", "check"]

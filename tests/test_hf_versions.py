"""Which transformers releases convert() takes: decided by the code fastformer mirrors (fingerprints of
its syntax trees, fastformer/hf/fingerprint.py), not by the version number. The installed release's code
is the recorded one; another version number with that code is taken; a change in any watched function
is refused naming it, and leaves the model as it was; documentation-only changes are not changes."""
import ast
import re

import pytest

transformers = pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

import fastformer  # noqa: E402
from fastformer.hf import _version, fingerprint  # noqa: E402
from fastformer.hf._fingerprints import RECORDED  # noqa: E402
import hf_models as H  # noqa: E402

BART = "transformers.models.bart.modeling_bart"


def test_the_installed_release_has_the_recorded_fingerprints():
    """The suite runs on TESTED; the fingerprints recorded for it are those of the files installed now
    (read by the same function tools/hf_fingerprints.py applies to a wheel)."""
    assert transformers.__version__ == _version.TESTED
    names = fingerprint.SHARED + tuple(n for f in fingerprint.FAMILIES.values() for n in f)
    got = fingerprint.installed(names)
    assert None not in got.values(), [n for n, fp in got.items() if fp is None]
    assert got == RECORDED[_version.TESTED]
    assert set(fingerprint.FAMILIES) == set(fastformer.hf.SUPPORTED_MODEL_TYPES)


def test_another_version_number_with_the_same_code_is_taken(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    model = fastformer.convert(H.build("bart"))
    assert model.config._attn_implementation == "fastformer"


def _edited(module, edit, monkeypatch):
    """The installed source of every module, with ``edit`` applied to ``module``'s."""
    real = fingerprint._installed_source
    monkeypatch.setattr(fingerprint, "_installed_source",
                        lambda m: edit(real(m)) if m == module else real(m))
    monkeypatch.setattr(fingerprint, "_cache", {})


def _in_method(source, cls, method, line):
    """``source`` with ``line`` inserted before the first statement of ``cls.method``."""
    node = next(n for c in ast.parse(source).body if isinstance(c, ast.ClassDef) and c.name == cls
                for n in c.body if isinstance(n, ast.FunctionDef) and n.name == method)
    first = node.body[0]
    lines = source.splitlines(keepends=True)
    lines.insert(first.lineno - 1, " " * first.col_offset + line + "\n")
    return "".join(lines)


def test_changed_layer_code_is_refused_by_name(monkeypatch):
    _edited(BART, lambda s: _in_method(s, "BartDecoderLayer", "forward", "hidden_states = hidden_states * 1.0"),
            monkeypatch)
    model = H.build("bart")
    cls = type(model)
    v = re.escape(transformers.__version__)
    with pytest.raises(RuntimeError, match=rf"transformers {v} is not supported: the 'bart' model code .* "
                                           rf"in modeling_bart\.BartDecoderLayer\.forward\. .*5\.24\.0"):
        fastformer.convert(model)
    assert type(model) is cls and model.config._attn_implementation == "sdpa"
    # the other families do not read modeling_bart
    assert fastformer.convert(H.build("whisper")).config._attn_implementation == "fastformer"


def test_changed_mask_code_refuses_every_family_and_the_attention(monkeypatch):
    _edited("transformers.masking_utils",
            lambda s: s.replace("def causal_mask_function(batch_idx", "def causal_mask_function(batch_idx_renamed", 1),
            monkeypatch)
    monkeypatch.setattr(fastformer.hf.attention, "_registered", False)
    with pytest.raises(RuntimeError, match=r"its attention and mask code .* masking_utils\.causal_mask_function"):
        fastformer.hf.register()
    for model_type in ("marian", "m2m_100"):
        with pytest.raises(RuntimeError, match=r"masking_utils\.causal_mask_function"):
            fastformer.convert(H.build(model_type))


def test_a_method_the_class_no_longer_defines_is_a_change(monkeypatch):
    def edit(source):  # BartAttention.forward renamed: the class would inherit nn.Module's
        start = source.index("class BartAttention(")
        at = source.index("def forward(", start)
        return source[:at] + "def forward_renamed(" + source[at + len("def forward("):]
    _edited(BART, edit, monkeypatch)
    with pytest.raises(RuntimeError, match=r"modeling_bart\.BartAttention\.forward"):
        fastformer.convert(H.build("bart"))


def test_documentation_and_formatting_are_not_changes(monkeypatch):
    def edit(s):
        s = s.replace('class BartDecoderLayer(GradientCheckpointingLayer):\n',
                      'class BartDecoderLayer(GradientCheckpointingLayer):\n    # a comment\n', 1)
        return _in_method(s, "BartDecoderLayer", "forward", '"""A new docstring."""  # and a comment')
    _edited(BART, edit, monkeypatch)
    assert fastformer.convert(H.build("bart")).config._attn_implementation == "fastformer"


def test_changed_compares_with_every_recorded_release_and_names_against_the_newest():
    recorded = {"5.9.0": {"a": "1", "b": "1"}, "5.10.0": {"a": "2", "b": "2"}}
    assert fingerprint.changed({"a": "1", "b": "1"}, recorded) is None
    assert fingerprint.changed({"a": "2", "b": "2"}, recorded) is None
    assert fingerprint.changed({"a": "1", "b": "2"}, recorded) == ("a",)  # 5.10 (newest, not by string order)
    assert fingerprint.changed({"a": "1"}, {}) == ("a",)


def test_the_pip_requirement_covers_the_tested_release():
    major, minor = (int(p) for p in _version.TESTED.split(".")[:2])
    assert (major, minor) in _version.MINORS
    lo, hi = _version.MINORS[0], _version.MINORS[-1]
    assert _version.requirement() == f"transformers>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}"

"""The transformers version fastformer's Hugging Face integration is tested with: written here
once. ``make setup`` installs ``TESTED`` (the Makefile reads it from this file), setup.py's ``hf``
extra asks for ``requirement()``, and ``convert()`` refuses a version outside the range."""
import re

# The release the tests run on. The fused layer forwards mirror that release's layer code, so a
# minor version outside (major, minor) of it is refused rather than risk a silently different model.
TESTED = "5.24.0"
MIN_VERSION = MAX_VERSION = tuple(int(part) for part in TESTED.split(".")[:2])


def requirement() -> str:
    """The pip requirement of the supported range, e.g. ``transformers>=5.24,<5.25``."""
    lo, hi = MIN_VERSION, MAX_VERSION
    return f"transformers>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}"


def supported_range() -> str:
    lo, hi = MIN_VERSION, MAX_VERSION
    return f"{lo[0]}.{lo[1]}" if lo == hi else f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"


def check_version(version: str) -> None:
    """Raise ``RuntimeError`` naming ``version`` and the supported range when it is outside it."""
    m = re.match(r"(\d+)\.(\d+)", version)
    mm = (int(m.group(1)), int(m.group(2))) if m else None
    if mm is None or not (MIN_VERSION <= mm <= MAX_VERSION):
        raise RuntimeError(
            f"fastformer.convert(): transformers {version} is not supported; fastformer's Hugging Face "
            f"integration supports transformers {supported_range()}.x (the fused layers mirror that "
            f"version's layer code). Install a supported version: pip install 'transformers=="
            f"{MAX_VERSION[0]}.{MAX_VERSION[1]}.*'")

"""The transformers versions fastformer's Hugging Face integration is tested with."""
import re

# (major, minor) inclusive range the integration was written and tested against. The fused layer
# forwards mirror transformers' own layer code, so a version outside this range is refused rather
# than risk a silently different model.
MIN_VERSION = (5, 24)
MAX_VERSION = (5, 24)


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

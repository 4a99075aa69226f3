"""Which transformers fastformer's Hugging Face integration takes, written here once.

``TESTED`` is the release the tests run on (``make setup`` installs it; the Makefile reads it from
this file). ``MINORS`` are the minor releases whose mirrored code has the fingerprints of a release
the suite passed on (``tools/hf_fingerprints.py`` finds them): setup.py's ``hf`` extra asks for
``requirement()``. At ``convert()`` the version number decides nothing: ``fingerprint.check`` compares the
code, so a release outside these minors whose code is unchanged is taken too, and one
whose code changed is refused by name."""

# The release the tests run on.
TESTED = "5.24.0"
# The minor releases found equal to a recorded one (5.25's watched code is 5.24's).
MINORS = ((5, 24), (5, 25))


def requirement() -> str:
    """The pip requirement of the minors above, e.g. ``transformers>=5.24,<5.26``."""
    (lo_major, lo_minor), (hi_major, hi_minor) = MINORS[0], MINORS[-1]
    return f"transformers>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"


"""Compare the transformers code fastformer mirrors across releases, without installing any of them.

    python tools/hf_fingerprints.py                       # every 5.x release the registry serves
    python tools/hf_fingerprints.py 5.23.0 5.25.0         # chosen releases
    python tools/hf_fingerprints.py --record 5.25.0       # add a release the test suite passed on

For each release it downloads the wheel (pip download --no-deps, cached in $HF_WHEELS or
/tmp/hf_wheels), reads the watched functions' source from the wheel (fastformer/hf/fingerprint.py)
and prints, per family, "same" when every watched function has the fingerprints of a recorded
release (fastformer/hf/_fingerprints.py), else the functions that differ. ``convert()`` accepts exactly
the "same" ones. ``--record`` writes the release's fingerprints into _fingerprints.py: do that only
for a release the Hugging Face tests passed on (`make test` with that transformers installed).
"""
import argparse
import glob
import os
import pprint
import re
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fastformer.hf import fingerprint as fp  # noqa: E402

RECORD_FILE = os.path.join(ROOT, "fastformer", "hf", "_fingerprints.py")
WHEELS = os.environ.get("HF_WHEELS", "/tmp/hf_wheels")
ALL_NAMES = fp.SHARED + tuple(n for names in fp.FAMILIES.values() for n in names)


def registry_versions(major="5"):
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers"],
                         capture_output=True, text=True, check=True).stdout
    listed = re.search(r"Available versions: (.*)", out).group(1).split(", ")
    return sorted((v for v in listed if v.startswith(major + ".") and re.fullmatch(r"[\d.]+", v)), key=fp._key)


def wheel(version):
    found = glob.glob(os.path.join(WHEELS, f"transformers-{version}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"transformers=={version}",
                        "-d", WHEELS], check=True)
        found = glob.glob(os.path.join(WHEELS, f"transformers-{version}-*.whl"))
    return found[0]


def fingerprints(version):
    with zipfile.ZipFile(wheel(version)) as z:
        files = set(z.namelist())

        def read(module):
            path = module.replace(".", "/")
            for name in (path + ".py", path + "/__init__.py"):
                if name in files:
                    return z.read(name).decode("utf-8")
            return None
        return fp.of_names(ALL_NAMES, read)


def record(version, prints):
    """Add ``version`` to _fingerprints.py. Releases with the same fingerprints share one entry of
    ``PRINTS`` (most releases change little of the watched code)."""
    from fastformer.hf._fingerprints import RECORDED
    recorded = dict(RECORDED)
    recorded[version] = {n: prints[n] for n in ALL_NAMES}
    versions = sorted(recorded, key=fp._key)
    distinct = []
    for v in versions:
        if recorded[v] not in distinct:
            distinct.append(recorded[v])
    with open(RECORD_FILE) as f:
        head = f.read().split("PRINTS = ")[0]
    body = "PRINTS = " + pprint.pformat(distinct, width=110, sort_dicts=False) + "\n\n"
    body += "RECORDED = {\n" + "".join(f"    {v!r}: PRINTS[{distinct.index(recorded[v])}],\n" for v in versions) + "}\n"
    with open(RECORD_FILE, "w") as f:
        f.write(head + body)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("versions", nargs="*")
    parser.add_argument("--record", metavar="VERSION")
    args = parser.parse_args()
    if args.record:
        record(args.record, fingerprints(args.record))
        print(f"recorded transformers {args.record} in {os.path.relpath(RECORD_FILE, ROOT)}")
        return
    from fastformer.hf._fingerprints import RECORDED
    for version in args.versions or registry_versions():
        prints = fingerprints(version)
        row = []
        for family, names in fp.FAMILIES.items():
            bad = fp.changed({n: prints[n] for n in fp.SHARED + names}, RECORDED)
            row.append(f"{family} same" if not bad else f"{family} {len(bad)} changed")
        print(f"{version:8} " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()

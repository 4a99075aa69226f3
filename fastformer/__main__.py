"""``python -m fastformer``: the command line, :mod:`fastformer.jobs.cli`."""
from fastformer.jobs.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

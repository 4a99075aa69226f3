"""Helpers shared by the library's subpackages (ops, nn, models, convert): importable from any of
them, not part of the public API. Nothing here imports the jobs (``fastformer.jobs``)."""

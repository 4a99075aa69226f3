"""The jobs built on the library: ``python -m fastformer train | translate | bench | check``.

``cli`` parses the command line; ``config`` holds the training configuration and its presets,
``devices`` the device, thread, dtype and backend choices every job shares; ``train``,
``translate``, ``check`` and ``bench`` are the jobs, ``data``, ``checkpoint`` and
``distributed`` what training needs. This package imports the library (``fastformer.ops``,
``nn``, ``models``, ...); the library never imports it (``tests/test_layout.py``).
"""

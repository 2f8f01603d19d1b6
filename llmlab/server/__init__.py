"""Front ends: the OpenAI-compatible HTTP server (``app.py`` routes, ``serving.py``,
``protocol.py``, ``metrics.py``), the command line (``cli.py``: ``llmlab generate``,
``serve``, ``bench serve``, ``components``) and the load-test client (``bench.py``)."""

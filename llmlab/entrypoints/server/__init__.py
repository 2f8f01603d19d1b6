"""The OpenAI-compatible HTTP server that ``llmlab serve`` runs: ``app.py`` (the FastAPI app,
its routes, errors and API key), ``serving.py`` (:class:`OpenAIServing`: requests into the
engine), ``responses.py`` and ``logprobs.py`` (engine outputs into responses and SSE
streams), ``request_params.py`` (request fields as engine arguments), ``errors.py``
(:class:`APIError`), ``protocol.py`` (the pydantic request and response models) and
``metrics.py`` (Prometheus metrics from the engine's step events). The command line is
``llmlab/entrypoints/cli.py``; the load-test client is ``llmlab/loadtest/``."""

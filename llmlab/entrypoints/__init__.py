"""Entry points: ``LLM``, the async engine, engine args, the OpenAI server and the CLI."""

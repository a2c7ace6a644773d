"""`speculative serve`: an OpenAI-compatible HTTP server on the step engine.

- protocol.py     request bodies checked field by field; OpenAI's error object
- text_stream.py  tokens to text as it becomes final, stop strings across token boundaries
- engine_loop.py  the thread that owns the Engine; handlers only send it commands
- metrics.py      Prometheus counters, gauges and histograms
- app.py          the FastAPI app: routes, server-sent events, errors
- command.py      the command's options, and uvicorn with a graceful SIGTERM

Only command.py is imported by the CLI; the rest needs the serve extra
(pip install 'speculative[serve]').
"""

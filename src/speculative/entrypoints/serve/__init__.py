"""`speculative serve`: an OpenAI-compatible HTTP server on the step engine.

- protocol.py     request bodies checked field by field; OpenAI's error object
- text_stream.py  tokens to text as it becomes final, stop strings across token boundaries
- engine_loop.py  the thread that owns the Engine; handlers only send it commands
- metrics.py      Prometheus counters, gauges and histograms
- reply.py        OpenAI's response, chunk and usage objects of one request
- http.py         access log, API keys, request bodies, errors as OpenAI's error object
- handlers.py     the routes, over one request-to-engine function (Routes.generate)
- app.py          the FastAPI app: wires the routes, errors and access log together
- command.py      the command's options, and uvicorn with a graceful SIGTERM
- ray_app.py      `serve --ray`: the app, engine replicas and metrics board on Ray Serve
- ray_remote.py   the ingress's engine loop over replicas (retries, errors, merged metrics)
- ray_router.py   prefix-aware routing of replicas on the prompt's leading tokens

Only command.py is imported by the CLI; the rest needs the serve extra
(pip install 'speculative[serve]'), and ray_*.py the ray extra too.
"""

"""The HTTP server under serve.py: HTTP/1.1 on the standard library, the OpenAI API, the engine on its own thread,
the live page's step events and /metrics. README.md here documents every route, field, error and flag."""

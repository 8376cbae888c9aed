"""The OpenAI-compatible HTTP server: an aiohttp app over the async engine, grouped by concern: api/ (the
handlers, one module per API family), requests/ (bodies -> typed requests), tools/ (output constraints, tool
choice, server-side MCP tools), runtime/ (state, residency, limits, metrics); at the top what every request crosses.

`create_app(state)` (app.py) builds the application; `serve(...)` (run.py) runs it with signal handling
and draining. Nothing here imports torch: the state holds an engine built elsewhere.
"""

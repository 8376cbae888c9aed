"""The OpenAI-compatible HTTP server: an aiohttp app over the async engine, one module per API family.

`create_app(state)` (app.py) builds the application; `serve(...)` (run.py) runs it with signal handling
and draining. Nothing here imports torch: the state holds an engine built elsewhere.
"""

"""What the running server holds beside the handlers: its shared state, the resident model and the ones loaded on
demand (chat, speech, embeddings), stores, limits per connection and per request, threads, metrics and telemetry."""

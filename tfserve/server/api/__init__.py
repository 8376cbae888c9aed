"""The HTTP handlers, one module per API family (OpenAI's chat, completions, Responses, conversations, audio,
embeddings and models; TGI; Ollama; tokenize; admin and health), with the modules that shape their replies."""

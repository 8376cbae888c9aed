"""Sentence embeddings: an encoder model (BERT-like) pooled as its sentence-transformers config says, and a batcher
that runs the requests of many callers in one forward.

    encoder = Encoder.from_spec("all-minilm-l6-v2")          # tfserve.embeddings.encoder
    batcher = EncoderBatcher(encoder).start()                 # tfserve.embeddings.batcher
    result = await batcher.embed(["hello", "world"])          # Embeddings(vectors [2, 384], num_tokens=6)

Nothing here imports torch at import time.
"""

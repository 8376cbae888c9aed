"""Speech in: audio decoding and resampling (PyAV), for transcription."""

"""Reading data for models: the audio front end (``audio``: WAV, log-mel features, a
user's .wav/.flac), tokenizers (``tokenizer``: a checkpoint's tokenizer.json, or UTF-8
bytes), a user's training data (``datasets``: .npz, .npy folders, checks against a
model's inputs, the validation hold-out; ``text``: .txt/.jsonl documents, token windows).
Imports only ``engine.errors``.
"""

"""Reading data for models: today the audio front end (``audio``: WAV, log-mel features).
Imports only ``engine.errors``.
"""

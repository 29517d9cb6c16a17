"""Whisper's log-mel front end in numpy, and synthetic tones.

16 kHz audio -> 400-point STFT (periodic Hann window, hop 160, centred frames with
reflect padding) -> power spectrum -> 80 mel bins (Slaney mel scale, Slaney area
normalisation, as librosa and Whisper) -> log10 clamped at 1e-10 -> at most 8
below the clip's maximum -> (x + 4) / 4. As in Whisper, the last STFT frame is
dropped, so ``samples`` samples give ``samples // 160`` frames (30 s -> 3000).

User audio (``read_audio``, ``audio_clips``): any file ``soundfile`` reads (WAV, FLAC...),
channels averaged, resampled to 16 kHz with ``scipy.signal.resample_poly``; ``clip_features``
pads or cuts a clip to ``mel_len`` frames as WhisperFeatureExtractor pads to 30 s.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ..errors import DataError, MeganeuraError
from ..files import write_atomically

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
N_MELS = 80
CHUNK_SECONDS = 30
CHUNK_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS

# Slaney mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above.
_F_SP = 200.0 / 3.0
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOG_STEP = math.log(6.4) / 27.0


def hz_to_mel(hz):
    hz = np.asarray(hz, dtype=np.float64)
    log_part = _MIN_LOG_MEL + np.log(np.maximum(hz, _MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOG_STEP
    return np.where(hz >= _MIN_LOG_HZ, log_part, hz / _F_SP)


def mel_to_hz(mel):
    mel = np.asarray(mel, dtype=np.float64)
    log_part = _MIN_LOG_HZ * np.exp(_LOG_STEP * (np.maximum(mel, _MIN_LOG_MEL) - _MIN_LOG_MEL))
    return np.where(mel >= _MIN_LOG_MEL, log_part, mel * _F_SP)


@lru_cache(maxsize=8)
def mel_filters(n_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] triangular filters, each of unit area (Slaney norm)."""
    fft_hz = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges_hz = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2))
    widths = np.diff(edges_hz)
    offsets = edges_hz[:, None] - fft_hz[None, :]
    rising = -offsets[:-2] / widths[:-1, None]
    falling = offsets[2:] / widths[1:, None]
    tri = np.maximum(0.0, np.minimum(rising, falling))
    area_norm = 2.0 / (edges_hz[2:] - edges_hz[:-2])
    return tri * area_norm[:, None]


def hann_window(n: int) -> np.ndarray:
    """The periodic Hann window (as torch.hann_window's default)."""
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)


def power_spectrum(audio: np.ndarray) -> np.ndarray:
    """|STFT|^2 of a 1-D signal: [n_fft // 2 + 1, frames], last frame dropped."""
    pad = N_FFT // 2
    if audio.shape[-1] <= pad:
        raise MeganeuraError(f"audio of {audio.shape[-1]} samples is too short: need more than {pad}")
    padded = np.pad(audio.astype(np.float64), (pad, pad), mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP]
    spectrum = np.fft.rfft(frames * hann_window(N_FFT), axis=-1)
    return (np.abs(spectrum) ** 2).T[:, :-1]


def log_mel_spectrogram(audio: np.ndarray, n_mels: int = N_MELS) -> np.ndarray:
    """Whisper's log-mel features: [samples] -> [n_mels, samples // 160],
    [batch, samples] -> [batch, n_mels, samples // 160] (each clip scaled on its own)."""
    audio = np.asarray(audio)
    if audio.ndim == 2:
        return np.stack([log_mel_spectrogram(a, n_mels) for a in audio])
    if audio.ndim != 1:
        raise MeganeuraError(f"audio must be [samples] or [batch, samples], found shape {list(audio.shape)}")
    mel = mel_filters(n_mels) @ power_spectrum(audio)
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def pad_or_trim(audio: np.ndarray, samples: int = CHUNK_SAMPLES) -> np.ndarray:
    """Zero-pad or cut the last axis to ``samples`` (Whisper works on 30 s chunks)."""
    audio = np.asarray(audio)
    n = audio.shape[-1]
    if n >= samples:
        return audio[..., :samples]
    width = [(0, 0)] * (audio.ndim - 1) + [(0, samples - n)]
    return np.pad(audio, width)


def tone(freq_hz: float, seconds: float, rng: np.random.Generator | None = None,
         harmonic: float = 0.5, noise: float = 0.01, amplitude: float = 0.5) -> np.ndarray:
    """A sine at ``freq_hz`` plus its second harmonic at ``harmonic`` of the amplitude,
    plus Gaussian noise of std ``noise`` (relative to the amplitude); float32 at 16 kHz."""
    t = np.arange(int(round(seconds * SAMPLE_RATE))) / SAMPLE_RATE
    wave = np.sin(2 * np.pi * freq_hz * t) + harmonic * np.sin(4 * np.pi * freq_hz * t)
    if noise and rng is not None:
        wave = wave + rng.normal(0.0, noise, t.shape)
    return (amplitude * wave).astype(np.float32)


def write_wav(path, audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """Mono PCM16 WAV (samples clipped to [-1, 1]), written whole or not at all."""
    import wave

    pcm = (np.clip(np.asarray(audio, np.float64), -1.0, 1.0) * 32767).round().astype("<i2")

    def write(f) -> None:
        with wave.open(f, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(sample_rate)
            w.writeframes(pcm.tobytes())

    write_atomically(path, write)


def read_wav(path) -> tuple[np.ndarray, int]:
    """A PCM16 WAV as float32 in [-1, 1] (channels averaged) and its sample rate."""
    import wave

    try:
        with wave.open(str(path), "rb") as w:
            if w.getsampwidth() != 2:
                raise MeganeuraError(f"{path}: only 16-bit PCM WAV is supported, "
                                     f"found {8 * w.getsampwidth()}-bit samples")
            frames = np.frombuffer(w.readframes(w.getnframes()), "<i2").reshape(-1, w.getnchannels())
            return (frames.mean(axis=1) / 32768.0).astype(np.float32), w.getframerate()
    except (OSError, EOFError, wave.Error) as exc:
        raise MeganeuraError(f"{path}: cannot read it as a WAV file ({exc})") from None


def read_audio(path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A sound file as float32 mono at ``sample_rate`` (channels averaged; resampled by a
    polyphase filter where the file's rate differs)."""
    import soundfile
    from scipy.signal import resample_poly

    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises LibsndfileError, RuntimeError or TypeError on bad files
        raise DataError(f"audio {path}: cannot read it ({str(exc).strip() or type(exc).__name__})") from None
    if data.shape[0] == 0:
        raise DataError(f"audio {path}: holds no samples")
    wave = data.mean(axis=1)
    if rate != sample_rate:
        common = math.gcd(int(rate), sample_rate)
        wave = resample_poly(wave.astype(np.float64), sample_rate // common, int(rate) // common)
    return np.asarray(wave, dtype=np.float32)


def audio_clips(path, transcripts: bool = False):
    """(name, 16 kHz samples, transcript) of a sound file or of a folder's .wav/.flac files,
    by name, read as they are asked for; the transcript is ``NAME.txt`` beside the audio
    (required with ``transcripts``)."""
    from pathlib import Path

    from .datasets import AUDIO_SUFFIXES, files_of

    path = Path(path)
    files = [path] if path.is_file() else files_of(path, AUDIO_SUFFIXES)
    if not files:
        raise DataError(f"data {path}: the dataset is empty (no .wav or .flac files)")
    for file in files:
        text_file = file.with_suffix(".txt")
        if transcripts and not text_file.is_file():
            raise DataError(f"audio {file}: no transcript {text_file.name} beside it (this model trains on audio "
                            f"with its text)")
        text = text_file.read_text(encoding="utf-8").strip() if text_file.is_file() else None
        yield file.stem, read_audio(file), text


def clip_features(wave: np.ndarray, mel_len: int) -> np.ndarray:
    """[80, mel_len] log-mel features of a clip zero-padded or cut to ``mel_len`` frames
    (what WhisperFeatureExtractor gives with max_length = mel_len * 160)."""
    return log_mel_spectrogram(pad_or_trim(wave, mel_len * HOP))[..., :mel_len]

"""The log-mel front end against an independent implementation: torch.stft and a
mel filterbank built here from the Slaney formulas with np.interp."""

import math

import numpy as np
import pytest
import torch

from engine.data import audio
from engine.errors import MeganeuraError


def slaney_hz_to_mel(f):
    return 3 * f / 200 if f < 1000 else 15 + 27 * math.log(f / 1000) / math.log(6.4)


def slaney_mel_to_hz(m):
    return 200 * m / 3 if m < 15 else 1000 * 6.4 ** ((m - 15) / 27)


def independent_filterbank(n_mels=80, n_fft=400, sr=16000):
    """Each band a triangle over three consecutive mel-spaced edges, of area one
    (height 2 / base), sampled at the FFT bin frequencies."""
    top = slaney_hz_to_mel(sr / 2)
    edges = [slaney_mel_to_hz(top * i / (n_mels + 1)) for i in range(n_mels + 2)]
    bins = np.arange(n_fft // 2 + 1) * sr / n_fft
    bank = np.zeros((n_mels, len(bins)))
    for m in range(n_mels):
        lo, mid, hi = edges[m:m + 3]
        bank[m] = np.interp(bins, [lo, mid, hi], [0, 2 / (hi - lo), 0], left=0, right=0)
    return bank


def independent_log_mel(wave: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(wave.astype(np.float64))
    stft = torch.stft(x, 400, 160, window=torch.hann_window(400, dtype=torch.float64), center=True,
                      pad_mode="reflect", return_complex=True)
    power = stft[..., :-1].abs() ** 2
    mel = torch.from_numpy(independent_filterbank()) @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).numpy()


def chirp_with_silence(seconds=1.0):
    """A rising chirp, then silence (to reach the 1e-10 clamp and the max-8 floor)."""
    t = np.arange(int(seconds * 16000)) / 16000
    wave = 0.3 * np.sin(2 * np.pi * (100 + 3000 * t) * t)
    wave[len(t) // 2:] = 0.0
    return wave.astype(np.float32)


def test_mel_scale_conversions_follow_slaney():
    for hz in (0.0, 440.0, 1000.0, 3000.0, 8000.0):
        assert audio.hz_to_mel(hz) == pytest.approx(slaney_hz_to_mel(hz))
        assert audio.mel_to_hz(audio.hz_to_mel(hz)) == pytest.approx(hz)


def test_filterbank_matches_the_independent_one():
    np.testing.assert_allclose(audio.mel_filters(), independent_filterbank(), atol=1e-12)


@pytest.mark.parametrize("make_wave", [
    chirp_with_silence,
    lambda: audio.tone(440.0, 0.5, np.random.default_rng(0)),
])
def test_log_mel_matches_torch_stft_implementation(make_wave):
    wave = make_wave()
    found = audio.log_mel_spectrogram(wave)
    expected = independent_log_mel(wave)
    assert found.shape == expected.shape == (80, len(wave) // 160)
    np.testing.assert_allclose(found, expected, atol=1e-5)


def test_silence_floor_is_eight_below_the_max():
    found = audio.log_mel_spectrogram(chirp_with_silence())
    assert found.min() == pytest.approx(found.max() - 2.0, abs=1e-6)  # 8 in log10 units, / 4


def test_batched_clips_are_scaled_each_on_their_own():
    rng = np.random.default_rng(0)
    quiet, loud = audio.tone(330, 0.2, rng, amplitude=0.01), audio.tone(330, 0.2, rng, amplitude=0.9)
    both = audio.log_mel_spectrogram(np.stack([quiet, loud]))
    np.testing.assert_array_equal(both[0], audio.log_mel_spectrogram(quiet))
    np.testing.assert_array_equal(both[1], audio.log_mel_spectrogram(loud))


def test_thirty_seconds_give_three_thousand_frames():
    assert audio.pad_or_trim(np.ones(1000)).shape == (audio.CHUNK_SAMPLES,)
    assert audio.pad_or_trim(np.ones((2, 600_000))).shape == (2, audio.CHUNK_SAMPLES)
    assert audio.power_spectrum(np.zeros(audio.CHUNK_SAMPLES)).shape == (201, 3000)


def test_bad_audio_is_a_user_error():
    with pytest.raises(MeganeuraError, match="too short"):
        audio.log_mel_spectrogram(np.zeros(100))
    with pytest.raises(MeganeuraError, match="samples"):
        audio.log_mel_spectrogram(np.zeros((1, 2, 3000)))

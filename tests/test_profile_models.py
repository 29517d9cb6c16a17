"""Every built-in model profiles on the GPU, forward and training step (issue 7: each
model works with optimize, train and profile)."""

import json

import pytest

from engine.cli import main

SMALL = {"mlp": ["batch=4"], "whisper-tiny": ["mel_len=16", "batch=1"], "gpt-tiny": ["seq=8", "batch=1", "depth=2"],
         "audio-align": ["mel_len=16", "seq=6", "batch=2", "depth=2"]}


@pytest.mark.parametrize("name", list(SMALL))
def test_profile_each_builtin_model(name, capsys):
    sets = [arg for s in SMALL[name] for arg in ("--set", s)]
    for train in ([], ["--train"]):
        # no warm-up step: lavapipe takes seconds a training step of audio-align
        code = main(["profile", name, *sets, "--steps", "1", "--warmup", "0", "--json", *train])
        out, err = capsys.readouterr()
        assert code == 0, err
        r = json.loads(out)
        assert r["model"] == name and r["timestamps"] is True and r["train"] == bool(train)
        assert len(r["dispatches"]) == r["dispatches_per_step"] > 0
        assert all(d["gpu_ns"] > 0 for d in r["dispatches"])
        if train:
            assert r["step_details"][0]["loss"] > 0


def test_warmup_steps_run_untimed_before_the_profiled_ones(capsys):
    """``--warmup N``: N steps in a "warmup" span before the profiled ones (none at 0);
    a negative count is a usage error."""
    spans = {}
    for warmup in (0, 2):
        assert main(["profile", "mlp", "--set", "batch=4", "--steps", "1", "--warmup", str(warmup), "--json"]) == 0
        spans[warmup] = [s["name"] for s in json.loads(capsys.readouterr().out)["cpu_spans"]]
    assert "warmup" not in spans[0] and spans[2].count("warmup") == 1
    assert spans[0].count("step 0") == spans[2].count("step 0") == 1
    assert main(["profile", "mlp", "--warmup", "-1"]) == 2
    assert "--warmup must be 0 or more, found -1" in capsys.readouterr().err

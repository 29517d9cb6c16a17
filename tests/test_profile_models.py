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
        code = main(["profile", name, *sets, "--steps", "1", "--json", *train])
        out, err = capsys.readouterr()
        assert code == 0, err
        r = json.loads(out)
        assert r["model"] == name and r["timestamps"] is True and r["train"] == bool(train)
        assert len(r["dispatches"]) == r["dispatches_per_step"] > 0
        assert all(d["gpu_ns"] > 0 for d in r["dispatches"])
        if train:
            assert r["step_details"][0]["loss"] > 0

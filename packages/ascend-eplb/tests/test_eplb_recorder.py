import pytest
import torch

from ascend_eplb.recorder import ExpertLoadRecorder


def test_counts_per_layer_and_expert():
    recorder = ExpertLoadRecorder(num_layers=2, num_experts=4, window_steps=3)
    recorder.record(0, torch.tensor([[0, 1], [1, 3]]))
    recorder.record(1, torch.tensor([[2, 2], [3, -1]]))  # -1: a dropped choice, ignored
    assert recorder.end_step()
    assert recorder.window_load().tolist() == [[1, 2, 0, 1], [0, 0, 2, 1]]
    assert recorder.steps_in_window == 1


def test_the_window_slides():
    recorder = ExpertLoadRecorder(1, 3, window_steps=2)
    for expert in (0, 1, 2):
        recorder.record(0, torch.tensor([[expert]]))
        recorder.end_step()
    # Step 0 left the window; steps 1 and 2 remain.
    assert recorder.window_load().tolist() == [[0, 1, 1]]
    assert recorder.steps_committed == 3 and recorder.steps_in_window == 2


@pytest.mark.parametrize("phase, expected", [
    ("all", [[1, 1, 1, 1]]),
    ("prefill", [[1, 1, 0, 0]]),
    ("decode", [[0, 0, 1, 1]]),
])
def test_phases(phase, expected):
    recorder = ExpertLoadRecorder(1, 4, window_steps=4, phase=phase)
    # Tokens 0-1 are prefill tokens (experts 0 and 1), tokens 2-3 decode tokens.
    recorder.record(0, torch.tensor([[0], [1], [2], [3]]),
                    prefill_mask=torch.tensor([True, True, False, False]))
    recorder.end_step()
    assert recorder.window_load().tolist() == expected


def test_steps_without_tokens_of_the_phase_do_not_flush_the_window():
    recorder = ExpertLoadRecorder(1, 2, window_steps=1, phase="decode")
    recorder.record(0, torch.tensor([[1]]), prefill_mask=torch.tensor([False]))
    assert recorder.end_step()
    recorder.record(0, torch.tensor([[0]]), prefill_mask=torch.tensor([True]))  # prefill only
    assert not recorder.end_step()
    recorder.record(0, torch.tensor([[0]]))  # phase unknown: not counted for decode
    assert not recorder.end_step()
    assert recorder.window_load().tolist() == [[0, 1]]
    assert recorder.steps_seen == 3 and recorder.steps_committed == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="phase must be one of all, prefill, decode, got 'warmup'"):
        ExpertLoadRecorder(1, 2, 1, phase="warmup")
    with pytest.raises(ValueError, match="window_steps must be a positive integer"):
        ExpertLoadRecorder(1, 2, 0)
    recorder = ExpertLoadRecorder(2, 2, 1)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\), got 2"):
        recorder.record(2, torch.tensor([[0]]))

"""The npu worker's sleep pool on the reference torch_npu: what it tags, the bytes it gives
back and takes again (read from torch.npu's memory numbers), the contents it restores, and
its errors.

The pool inside a vLLM engine (LLM(enable_sleep_mode=True)): tests/e2e/test_npu_sleep.py.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from npu_reference import reference_on_path

KV_SHAPE = (2, 16, 4, 32)  # float32: 16 KiB


@pytest.fixture(scope="module")
def reference_npu():
    with reference_on_path(forget=("ascend_core.worker.npu_sleep",)):
        yield importlib.import_module("torch_npu")


@pytest.fixture
def sleep_module(reference_npu):
    reference_npu._reference.reset_state()
    yield importlib.import_module("ascend_core.worker.npu_sleep")
    reference_npu._reference.reset_state()


def _model_and_cache(pool):
    """A small model loaded under "weights" (through a CPU copy, as a loader would) and a KV
    cache allocated under "kv_cache"; returns them with their exact byte counts."""
    torch.manual_seed(0)
    with pool.allocating("weights"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 16)).to("npu")
        scratch = torch.randn(4096, device="npu")  # a loading temporary, freed at once
        del scratch
    with pool.allocating("kv_cache"):
        kv_cache = torch.zeros(KV_SHAPE, device="npu")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return model, kv_cache, weight_bytes, kv_cache.numel() * 4


def _used():
    return torch.npu.memory_allocated(), torch.npu.mem_get_info()[0]


def test_the_pool_tags_what_is_allocated_inside_its_contexts(sleep_module):
    pool = sleep_module.NPUSleepPool()
    outside = torch.ones(100, device="npu")
    model, kv_cache, weight_bytes, kv_bytes = _model_and_cache(pool)
    with pool.allocating("weights"):
        outside.mul_(2)  # in place: not an allocation
        view = outside[:10]  # a view: not an allocation
    assert pool.resident_bytes("weights") == weight_bytes == (64 * 128 + 128 + 128 * 16 + 16) * 4
    assert pool.resident_bytes("kv_cache") == kv_bytes
    assert len(pool.storages("weights")) == 4 and len(pool.storages("kv_cache")) == 1
    assert view.untyped_storage().data_ptr() not in {
        s.data_ptr() for s in pool.storages("weights")}
    del model  # a tagged tensor that dies is forgotten with it
    assert pool.resident_bytes("weights") == 0 and pool.resident_bytes("kv_cache") == kv_bytes


def test_level_1_gives_back_weights_and_cache_and_wake_up_restores_the_weights(sleep_module):
    pool = sleep_module.NPUSleepPool()
    model, kv_cache, weight_bytes, kv_bytes = _model_and_cache(pool)
    kv_cache.fill_(7.0)
    inputs = torch.randn(8, 64, device="npu")
    expected = model(inputs).cpu()
    torch.npu.empty_cache()
    allocated, free = _used()

    report = pool.sleep(level=1)

    assert report.released == {"weights": weight_bytes, "kv_cache": kv_bytes}
    assert report.kept_on_host == pool.host_bytes == weight_bytes
    allocated_asleep, free_asleep = _used()
    assert allocated - allocated_asleep == weight_bytes + kv_bytes
    assert free_asleep - free == weight_bytes + kv_bytes
    assert pool.asleep_tags == ("weights", "kv_cache")
    assert pool.asleep_bytes("weights") == weight_bytes and pool.resident_bytes("weights") == 0

    assert pool.wake_up() == {"weights": weight_bytes, "kv_cache": kv_bytes}
    assert _used()[0] == allocated and pool.asleep_tags == () and pool.host_bytes == 0
    assert torch.equal(model(inputs).cpu(), expected)  # the same weights, bit for bit
    assert torch.count_nonzero(kv_cache).item() == 0  # the cache comes back empty


def test_level_2_keeps_nothing_and_the_weights_are_reloaded(sleep_module):
    pool = sleep_module.NPUSleepPool()
    model, kv_cache, weight_bytes, kv_bytes = _model_and_cache(pool)
    checkpoint = {name: value.cpu().clone() for name, value in model.state_dict().items()}
    inputs = torch.randn(8, 64, device="npu")
    expected = model(inputs).cpu()
    allocated = _used()[0]

    report = pool.sleep(level=2)

    assert report.released == {"weights": weight_bytes, "kv_cache": kv_bytes}
    assert report.kept_on_host == pool.host_bytes == 0
    assert allocated - _used()[0] == weight_bytes + kv_bytes
    pool.wake_up(["weights"])  # partial: the KV cache stays released
    assert pool.asleep_tags == ("kv_cache",) and _used()[0] == allocated - kv_bytes
    assert all(torch.count_nonzero(p).item() == 0 for p in model.parameters())
    model.load_state_dict(checkpoint)  # the reload a level-2 sleeper owes
    assert torch.equal(model(inputs).cpu(), expected)
    pool.wake_up(["kv_cache"])
    assert pool.asleep_tags == () and _used()[0] == allocated


def test_discard_releases_a_tag_without_a_copy(sleep_module):
    pool = sleep_module.NPUSleepPool()
    model, kv_cache, weight_bytes, kv_bytes = _model_and_cache(pool)
    allocated = _used()[0]
    assert pool.discard(("kv_cache",)).released == {"kv_cache": kv_bytes}
    assert allocated - _used()[0] == kv_bytes and pool.host_bytes == 0
    report = pool.sleep(1)  # the discarded cache stays discarded
    assert report.released == {"weights": weight_bytes}
    pool.wake_up()
    assert _used()[0] == allocated


@pytest.mark.parametrize("level", [0, 3, -1, True, "1", 1.0])
def test_a_level_other_than_1_or_2_is_refused(sleep_module, level):
    pool = sleep_module.NPUSleepPool()
    model, *_ = _model_and_cache(pool)
    with pytest.raises(ValueError, match=r"Sleep level .* 1 \(weights to host.*or 2"):
        pool.sleep(level)
    assert pool.asleep_tags == () and pool.resident_bytes("weights") > 0


def test_sleeping_twice_is_refused_and_the_first_sleep_stands(sleep_module):
    pool = sleep_module.NPUSleepPool()
    model, kv_cache, weight_bytes, _ = _model_and_cache(pool)
    pool.sleep(1)
    with pytest.raises(RuntimeError, match=r"already asleep \(tags \['weights', 'kv_cache'\]\)"):
        pool.sleep(2)
    assert pool.host_bytes == weight_bytes  # level 1's copies are still there


def test_bad_tags_and_untimely_wake_ups_are_clear_errors(sleep_module):
    pool = sleep_module.NPUSleepPool()
    model, *_ = _model_and_cache(pool)
    with pytest.raises(RuntimeError, match="not asleep; call sleep"):
        pool.wake_up()
    with pytest.raises(ValueError, match=r"Unknown sleep tag\(s\) \['workspace'\].*'weights', "
                                         r"'kv_cache'"):
        with pool.allocating("workspace"):
            pass
    pool.sleep(1)
    with pytest.raises(ValueError, match=r"Unknown sleep tag\(s\) \['scheduling'\]"):
        pool.wake_up(["weights", "scheduling"])
    assert pool.asleep_tags == ("weights", "kv_cache")  # nothing woke
    with pytest.raises(RuntimeError, match="while it is asleep"):
        with pool.allocating("kv_cache"):
            pass
    pool.wake_up(["kv_cache"])
    with pytest.raises(ValueError, match=r"Tags \['kv_cache'\] are awake.*\['weights'\]"):
        pool.wake_up(["kv_cache"])
    with pytest.raises(ValueError, match="Unknown sleep tag"):
        pool.discard(["cudagraph"])


def test_a_weight_replaced_while_asleep_is_not_restored(sleep_module):
    pool = sleep_module.NPUSleepPool()
    model, kv_cache, weight_bytes, kv_bytes = _model_and_cache(pool)
    pool.sleep(1)
    model[0].weight = torch.nn.Parameter(torch.zeros(128, 64, device="npu"))
    restored = pool.wake_up()
    assert restored["weights"] == weight_bytes - 128 * 64 * 4

"""MooncakeConnectorV1's algorithmic parts: cache layouts and read plans, the
kv_transfer_params and kv_connector_extra_config it accepts, and the prefill leases."""

from __future__ import annotations

import pytest
import torch

from ascend_core.distributed.kv_transfer.layout import (
    KVLayout,
    KVLayoutError,
    check_block_ids,
    check_compatible,
    describe_kv_caches,
    layer_planes,
    memory_regions,
    read_plan,
)
from ascend_core.distributed.kv_transfer.leases import LeaseTable, prompt_digest
from ascend_core.distributed.kv_transfer.params import (
    DEFAULT_LEASE_TIMEOUT_S,
    KVTransferParamsError,
    check_parallel_sizes,
    check_role,
    parse_options,
    parse_remote_prefill,
    remote_prefill_params,
)


def block_bytes(tensor: torch.Tensor, plane, block: int) -> bytes:
    """The bytes one plane holds for one block, read through its address arithmetic."""
    storage = tensor.untyped_storage()
    start = plane.base + block * plane.block_stride - storage.data_ptr()
    return bytes(storage[start:start + plane.run_bytes].tolist())


@pytest.mark.parametrize("shape, permute, planes_per_layer", [
    ((10, 2, 4, 16, 8), None, 1),  # [B, K/V, H, N, C]: a block is one run
    ((2, 10, 4, 16, 8), None, 2),  # [K/V, B, ...]: two runs per block
    ((10, 4, 16, 8), (0, 2, 1, 3), 1),  # a permuted view whose block is still one run
    ((4, 10, 16, 8), None, 4),  # heads outside blocks: one run per head
])
def test_planes_address_exactly_each_blocks_bytes(shape, permute, planes_per_layer):
    base = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    tensor = base.permute(permute) if permute else base
    block_dim = shape.index(10) if not permute else permute.index(0)
    planes = layer_planes("layer.0", tensor, num_blocks=10)
    assert len(planes) == planes_per_layer
    for block in (0, 3, 9):
        expected = tensor.select(block_dim, block).contiguous().flatten()
        got = b"".join(block_bytes(tensor, p, block) for p in planes)
        # Same bytes (the planes' order is memory order, the block's values all present).
        assert sorted(torch.frombuffer(bytearray(got), dtype=torch.float32).tolist()) == \
            sorted(expected.tolist())


def test_block_dimension_found_first_or_unique_or_regrouped():
    with pytest.raises(KVLayoutError, match=r"expected blocks \(num_blocks=4\) in dimension 0"):
        layer_planes("layer.0", torch.zeros(3, 5, 8), num_blocks=4)
    with pytest.raises(KVLayoutError, match=r"shape \(2, 4, 4\)"):
        layer_planes("layer.0", torch.zeros(2, 4, 4), num_blocks=4)
    # Blocks first wins over another dimension of the same size.
    (plane,) = layer_planes("layer.0", torch.zeros(4, 4, 8), num_blocks=4)
    assert plane.block_stride == plane.run_bytes == 4 * 8 * 4
    # Kernel blocks of a quarter of a manager block: four of them make one block.
    (plane,) = layer_planes("layer.0", torch.zeros(16, 2, 8), num_blocks=4)
    assert plane.block_stride == plane.run_bytes == 4 * 2 * 8 * 4


def test_mla_tuple_caches_give_one_plane_each_and_regions_merge_overlaps():
    latent, rope = torch.zeros(6, 16, 32), torch.zeros(6, 16, 8)
    whole = torch.zeros(6, 2, 16, 8)
    layout = describe_kv_caches({"a": (latent, rope), "b": whole[:, 0], "c": whole[:, 1]},
                                num_blocks=6, block_size=16)
    assert [p.layer for p in layout.planes] == ["a[0]", "a[1]", "b", "c"]
    assert [p.run_bytes for p in layout.planes] == [16 * 32 * 4, 16 * 8 * 4, 512, 512]
    regions = memory_regions({"b": whole[:, 0], "c": whole[:, 1], "a": latent})
    assert (whole.data_ptr(), whole.nbytes) in regions and len(regions) == 2


def test_read_plan_merges_runs_consecutive_on_both_sides():
    cache = torch.zeros(8, 64, dtype=torch.uint8)
    layout = describe_kv_caches({"l": cache}, num_blocks=8, block_size=16)
    local, remote, lengths = read_plan(layout, layout, [2, 3, 4, 7], [5, 6, 0, 1])
    base = cache.data_ptr()
    assert local == [base + 2 * 64, base + 4 * 64, base + 7 * 64]
    assert remote == [base + 5 * 64, base + 0, base + 64]
    assert lengths == [128, 64, 64]


def test_two_prefill_ranks_fill_the_halves_of_a_head_major_block():
    # vLLM's CPU cache: [blocks, kv heads, 2 * block_size (K rows, then V rows), head size].
    decode = torch.zeros(4, 2, 32, 8)
    ranks = [torch.full((4, 1, 32, 8), float(r + 1)) for r in range(2)]
    local = describe_kv_caches({"l": decode}, 4, 16, num_kv_heads=2)
    assert local.planes[0].head_major
    for index, cache in enumerate(ranks):
        remote = describe_kv_caches({"l": cache}, 4, 16, num_kv_heads=1)
        check_compatible(local, remote, "p:1", tp_ratio=2)
        addrs, remote_addrs, lengths = read_plan(local, remote, [1, 2], [3, 0], 2, index)
        half = 32 * 8 * 4
        assert addrs == [decode[1].data_ptr() + index * half, decode[2].data_ptr() + index * half]
        assert remote_addrs == [cache[3].data_ptr(), cache[0].data_ptr()]
        assert lengths == [half, half]
    # Without the ratio the halves do not fit; a layout whose heads are inner does not split.
    remote = describe_kv_caches({"l": ranks[0]}, 4, 16, num_kv_heads=1)
    with pytest.raises(KVLayoutError, match="TP ratio 1"):
        check_compatible(local, remote, "p:1")
    token_major = describe_kv_caches({"l": torch.zeros(4, 32, 2, 8)}, 4, 16, num_kv_heads=2)
    assert not token_major.planes[0].head_major
    with pytest.raises(KVLayoutError, match="serves a different model"):
        check_compatible(token_major, describe_kv_caches({"l": torch.zeros(4, 32, 1, 8)}, 4, 16,
                                                         num_kv_heads=1), "p:1", tp_ratio=2)


def test_replicated_planes_are_read_from_the_first_prefill_rank_only():
    latent = torch.zeros(4, 16, 40)  # MLA: one latent "head", the same on every rank
    layout = describe_kv_caches({"l": latent}, 4, 16, num_kv_heads=1)
    check_compatible(layout, layout, "p:1", tp_ratio=2)
    assert read_plan(layout, layout, [0], [1], 2, 0)[2] == [16 * 40 * 4]
    assert read_plan(layout, layout, [0], [1], 2, 1) == ([], [], [])


def test_layouts_that_differ_are_refused_with_what_to_change():
    caches = {"l0": torch.zeros(8, 2, 16, 8), "l1": torch.zeros(8, 2, 16, 8)}
    mine = describe_kv_caches(caches, 8, 16)
    other_block = KVLayout(32, 8, mine.dtype, mine.planes)
    with pytest.raises(KVLayoutError, match=r"block_size 32, this decode node 16: serve both "
                                            r"with the same --block-size"):
        check_compatible(mine, other_block, "p:1")
    bf16 = describe_kv_caches({k: v.bfloat16() for k, v in caches.items()}, 8, 16)
    with pytest.raises(KVLayoutError, match=r"bfloat16, this decode node in float32"):
        check_compatible(mine, bf16, "p:1")
    deeper = describe_kv_caches({**caches, "l2": torch.zeros(8, 2, 16, 8)}, 8, 16)
    with pytest.raises(KVLayoutError, match=r"serves a different model: its KV cache has 3 "
                                            r"planes, this node's 2"):
        check_compatible(mine, deeper, "p:1")
    check_compatible(mine, describe_kv_caches(caches, 8, 16), "p:1")


def test_block_ids_outside_the_cache_are_named():
    with pytest.raises(KVLayoutError, match=r"holds block id 8, outside the cache's 8 blocks "
                                            r"\(ids 0 to 7\)"):
        check_block_ids([1, 8], 8, "remote_block_ids")
    with pytest.raises(KVLayoutError, match="block id -1"):
        check_block_ids([-1], 8, "remote_block_ids")


def good_params(**changes):
    params = remote_prefill_params(engine_id="prefill-0", request_id="cmpl-1", host="127.0.0.1",
                                   port=18200, block_ids=[4, 5], tp_size=1)
    params.update(changes)
    return params


def test_remote_prefill_params_round_trip():
    remote = parse_remote_prefill(good_params(), num_prompt_tokens=20, block_size=16)
    assert (remote.engine_id, remote.request_id, remote.port, remote.block_ids) == \
        ("prefill-0", "cmpl-1", 18200, (4, 5))


@pytest.mark.parametrize("changes, message", [
    ({"remote_host": None}, r"remote_host=None is not a str"),
    ({"remote_block_ids": "4,5"}, r"remote_block_ids='4,5' is not a list"),
    ({"remote_block_ids": [4, -5]}, r"expected non-negative integers"),
    ({"remote_block_ids": [4, 5, 6]}, r"has 3 blocks, but this 20-token prompt fills 2 blocks"),
    ({"remote_port": 70000}, r"remote_port=70000 is not a port"),
    ({"remote_tp_size": True}, r"remote_tp_size=True is not a int"),
])
def test_bad_kv_transfer_params_are_one_line_errors(changes, message):
    with pytest.raises(KVTransferParamsError, match=message) as err:
        parse_remote_prefill(good_params(**changes), num_prompt_tokens=20, block_size=16)
    assert "\n" not in str(err.value)


def test_missing_kv_transfer_params_field_says_to_pass_them_unchanged():
    params = good_params()
    del params["remote_engine_id"]
    with pytest.raises(KVTransferParamsError, match=r"no 'remote_engine_id': pass the "
                                                    r"kv_transfer_params the prefill node"):
        parse_remote_prefill(params, 20, 16)


def test_extra_config_defaults_and_refusals():
    options = parse_options({"prefill": {"dp_size": 1, "tp_size": 1},
                             "decode": {"dp_size": 1, "tp_size": 1}}, "tcp")
    assert (options.protocol, options.lease_timeout_s) == ("tcp", DEFAULT_LEASE_TIMEOUT_S)
    assert parse_options({"protocol": "ascend", "lease_timeout_s": 2}, "tcp").lease_timeout_s == 2
    with pytest.raises(KVTransferParamsError, match=r"unknown key 'lease_timeout'.*Did you "
                                                    r"mean 'lease_timeout_s'\?"):
        parse_options({"lease_timeout": 3}, "tcp")
    with pytest.raises(KVTransferParamsError, match=r"protocol='nvlink': expected one of tcp"):
        parse_options({"protocol": "nvlink"}, "tcp")
    with pytest.raises(KVTransferParamsError, match=r"prefill.tp_size=0: expected an integer"):
        parse_options({"prefill": {"tp_size": 0}}, "tcp")
    with pytest.raises(KVTransferParamsError, match=r"decode has unknown key 'tp'"):
        parse_options({"decode": {"tp": 1}}, "tcp")
    with pytest.raises(KVTransferParamsError, match=r"lease_timeout_s=-1: expected a number"):
        parse_options({"lease_timeout_s": -1}, "tcp")


def test_roles_and_parallel_sizes():
    assert check_role("kv_both") == "kv_both"
    with pytest.raises(KVTransferParamsError, match=r"kv_role='kv_prodcer'.*Did you mean "
                                                    r"'kv_producer'\?"):
        check_role("kv_prodcer")
    options = parse_options({"prefill": {"tp_size": 2}, "decode": {"tp_size": 2}}, "tcp")
    check_parallel_sizes(options, "kv_consumer", tp_size=2, dp_size=1)
    with pytest.raises(KVTransferParamsError, match=r"prefill.tp_size=2 but this kv_producer "
                                                    r"instance runs with tp_size 1: set it to 1"):
        check_parallel_sizes(options, "kv_producer", tp_size=1, dp_size=1)
    wider_prefill = parse_options({"prefill": {"tp_size": 2}, "decode": {"tp_size": 1}}, "tcp")
    check_parallel_sizes(wider_prefill, "kv_consumer", tp_size=1, dp_size=1)
    check_parallel_sizes(wider_prefill, "kv_producer", tp_size=2, dp_size=1)
    wider_decode = parse_options({"prefill": {"tp_size": 1}, "decode": {"tp_size": 2}}, "tcp")
    with pytest.raises(KVTransferParamsError, match=r"prefill tp_size 1 is not a multiple of "
                                                    r"decode tp_size 2"):
        check_parallel_sizes(wider_decode, "kv_consumer", tp_size=2, dp_size=1)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_lease_lifecycle_claim_release_and_expiry():
    clock = Clock()
    leases = LeaseTable(timeout_s=10, clock=clock)
    unknown = leases.claim("r1", [1], "p")  # never prefilled here: refused at once
    assert unknown.status == "refused" and "no request 'r1' is or was prefilled here" in \
        unknown.message
    leases.expect("r1")
    assert leases.claim("r1", [1], "p").status == "pending"  # still being prefilled here
    leases.add("r1", [1, 2], "p")
    leases.add("r2", [3], "p")
    assert leases.held_blocks() == 3
    assert leases.claim("r1", [2], "p").status == "ok"
    refused = leases.claim("r1", [2, 9], "p")
    assert refused.status == "refused" and "block id 9 is not one of the 2 blocks" in \
        refused.message
    assert leases.release("r1")
    clock.now += 11  # r2 was never claimed
    released, expired = leases.take_finished()
    assert (released, expired) == ({"r1"}, {"r2"})
    assert leases.held_blocks() == 0
    assert "already pulled" in leases.claim("r1", [1], "p").message
    late = leases.claim("r2", [3], "p")
    assert late.status == "refused" and "lease expired after 10 s" in late.message
    assert leases.take_finished() == (set(), set())


def test_an_expected_request_that_ends_without_a_lease_is_refused_with_why():
    leases = LeaseTable(timeout_s=10, clock=Clock())
    leases.expect("r")
    leases.drop("r", "the prefill request ended finished_aborted and kept no blocks")
    refused = leases.claim("r", [0], "p")
    assert refused.status == "refused" and "finished_aborted" in refused.message
    leases.drop("other", "never expected: nothing to remember")
    assert "no request 'other'" in leases.claim("other", [0], "p").message
    leases.expect("r")  # a late duplicate of the metadata does not revive it
    assert leases.claim("r", [0], "p").status == "refused"


def test_a_claim_renews_the_lease_so_a_read_in_progress_does_not_expire():
    clock = Clock()
    leases = LeaseTable(timeout_s=10, clock=clock)
    leases.add("r", [0], "p")
    clock.now += 8
    assert leases.claim("r", [0], "p").status == "ok"
    clock.now += 8  # 16 s after the start, 8 after the claim
    assert leases.take_finished() == (set(), set())
    clock.now += 3
    assert leases.take_finished() == (set(), {"r"})


def test_a_lease_is_claimed_only_for_the_prompt_its_blocks_hold():
    digest = prompt_digest([5, 6, 7])
    assert digest == prompt_digest((5, 6, 7)) and len(digest) == 32
    assert len({digest, prompt_digest([5, 6, 8]), prompt_digest([5, 6]),
                prompt_digest([6, 5, 7])}) == 4
    assert prompt_digest(None) is None  # a prompt given as embeddings
    leases = LeaseTable(timeout_s=10)
    leases.add("r", [4], digest)
    for other in (prompt_digest([5, 6, 8]), None):
        refused = leases.claim("r", [4], other)
        assert refused.status == "refused" and "another prompt" in refused.message
    assert leases.claim("r", [4], digest).status == "ok"

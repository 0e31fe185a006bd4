import json

import pytest
import torch

from ascend_eplb.expert_map import (
    ExpertMapError,
    expert_map_from_dict,
    expert_map_to_dict,
    load_expert_map,
    save_expert_map,
)

PHY2LOG = torch.tensor([[0, 5, 1, 2, 3, 4, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0]])


def write(tmp_path, data, name="map.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def good():
    return expert_map_to_dict(expert_map_from_dict(
        {
            "moe_layer_count": 2,
            "layer_list": [
                {"device_list": [{"device_expert": row[g * 2 : g * 2 + 2]} for g in range(4)]}
                for row in PHY2LOG.tolist()
            ],
        }
    ))


def test_round_trip(tmp_path):
    path = tmp_path / "placement.json"
    written = save_expert_map(path, PHY2LOG, 4, num_experts=8, metadata={"policy": "swift"})
    loaded = load_expert_map(path)
    assert torch.equal(loaded.phy2log, PHY2LOG)
    assert (loaded.num_gpus, loaded.num_experts, loaded.slots_per_gpu) == (4, 8, 2)
    assert loaded.metadata == {"policy": "swift"} == written.metadata
    assert loaded.logcnt.tolist() == [[1] * 8, [1] * 8]
    data = json.loads(path.read_text())
    assert data["moe_layer_count"] == 2 and data["num_experts"] == 8
    assert data["layer_list"][1]["device_list"][3] == {"device_id": 3, "device_expert": [1, 0]}
    assert [p.name for p in tmp_path.iterdir()] == ["placement.json"]  # no temporary left


def test_every_expert_needs_a_replica_in_every_layer(tmp_path):
    lacking = torch.tensor([[0, 5, 1, 2, 3, 4, 5, 0], [7, 6, 5, 4, 3, 2, 1, 0]])
    with pytest.raises(ValueError, match="no replica to 2 .* expert 6 in layer 0"):
        save_expert_map(tmp_path / "m.json", lacking, 4, num_experts=8)


def test_vllm_ascend_layout_without_optional_keys(tmp_path):
    data = {
        "moe_layer_count": 1,
        "layer_list": [
            {"device_count": 2, "device_list": [{"device_expert": [0, 1]}, {"device_expert": [2, 3]}]}
        ],
    }
    loaded = load_expert_map(write(tmp_path, data))
    assert loaded.phy2log.tolist() == [[0, 1, 2, 3]]
    assert loaded.num_gpus == 2 and loaded.num_experts == 4
    assert loaded.log2phy.tolist() == [[[0], [1], [2], [3]]]


def mutate(change):
    data = {
        "moe_layer_count": 2,
        "num_experts": 4,
        "layer_list": [
            {
                "layer_id": i,
                "device_count": 2,
                "device_list": [
                    {"device_id": 0, "device_expert": [0, 1]},
                    {"device_id": 1, "device_expert": [2, 3]},
                ],
            }
            for i in range(2)
        ],
    }
    change(data)
    return data


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: d.pop("layer_list"), "top level: missing required key 'layer_list'"),
        (lambda d: d.pop("moe_layer_count"), "missing required key 'moe_layer_count'"),
        (lambda d: d.update(moe_layer_count=3), "has 2 layers but moe_layer_count is 3"),
        (lambda d: d.update(moe_layer_count=-1), "moe_layer_count: must be an integer >= 0"),
        (lambda d: d.update(layer_list={}), "layer_list: must be a list, got an object"),
        (lambda d: d.update(num_experts=0), "num_experts: must be an integer >= 1"),
        (lambda d: d.update(metadata=[1]), "metadata: must be a JSON object"),
        (lambda d: d["layer_list"][1].pop("device_list"), r"layer_list\[1\]: missing required key 'device_list'"),
        (lambda d: d["layer_list"][1].update(layer_id=5), r"layer_list\[1\].layer_id: is 5, expected 1"),
        (lambda d: d["layer_list"][0].update(device_count=3), r"device_count: is 3 but device_list has 2"),
        (lambda d: d["layer_list"][0].update(device_list=[]), "must be a non-empty list"),
        (
            lambda d: (
                d["layer_list"][1].pop("device_count"),
                d["layer_list"][1]["device_list"].append({"device_expert": [0, 1]}),
            ),
            r"layer_list\[1\].device_list: has 3 ranks but layer_list\[0\] has 2",
        ),
        (
            lambda d: d["layer_list"][1]["device_list"][1].update(device_expert=[2, 3, 1]),
            r"device_list\[1\].device_expert: has 3 slots but every rank must have 2",
        ),
        (
            lambda d: d["layer_list"][0]["device_list"][0].pop("device_expert"),
            r"device_list\[0\]: missing required key 'device_expert'",
        ),
        (
            lambda d: d["layer_list"][0]["device_list"][1].update(device_id=0),
            r"device_list\[1\].device_id: is 0, expected 1",
        ),
        (
            lambda d: d["layer_list"][0]["device_list"][1].update(device_expert=[2, 4]),
            r"device_expert\[1\]: expert id 4 is out of range \[0, 4\)",
        ),
        (
            lambda d: d["layer_list"][0]["device_list"][1].update(device_expert=[2, -1]),
            r"device_expert\[1\]: must be an expert id \(integer >= 0\), got -1",
        ),
        (
            lambda d: d["layer_list"][0]["device_list"][1].update(device_expert=[2, 1.5]),
            "must be an expert id",
        ),
        (
            lambda d: d["layer_list"][0]["device_list"][1].update(device_expert=[2, True]),
            "must be an expert id",
        ),
        (
            lambda d: d["layer_list"][0]["device_list"][1].update(device_expert=[2, 2]),
            "no replica to 1 .* expert 3 in layer 0",
        ),
        (lambda d: d["layer_list"].__setitem__(0, [0, 1]), r"layer_list\[0\]: must be a JSON object, got a list"),
    ],
)
def test_malformed_maps(tmp_path, change, match):
    with pytest.raises(ExpertMapError, match=match):
        load_expert_map(write(tmp_path, mutate(change)))


def test_not_json_and_not_an_object(tmp_path):
    with pytest.raises(ExpertMapError, match=r"not valid JSON: .* line 1, column 2"):
        load_expert_map(write(tmp_path, "{oops"))
    with pytest.raises(ExpertMapError, match="top level: must be a JSON object, got a list"):
        load_expert_map(write(tmp_path, "[1, 2]"))
    with pytest.raises(FileNotFoundError):
        load_expert_map(tmp_path / "missing.json")


def test_errors_name_the_file(tmp_path):
    path = write(tmp_path, mutate(lambda d: d.pop("layer_list")), "named.json")
    with pytest.raises(ExpertMapError, match=r"named\.json: top level"):
        load_expert_map(path)


def test_save_rejects_bad_placements(tmp_path):
    with pytest.raises(ValueError, match=r"not divisible by num_gpus \(3\)"):
        save_expert_map(tmp_path / "m.json", PHY2LOG, 3)
    with pytest.raises(TypeError, match="metadata must be a dict"):
        save_expert_map(tmp_path / "m.json", torch.arange(4)[None], 2, metadata=[1])
    with pytest.raises(TypeError):
        save_expert_map(tmp_path / "m.json", torch.arange(4)[None], 2, metadata={"x": object()})
    assert list(tmp_path.iterdir()) == []


def test_good_helper_round_trips():
    data = good()
    assert expert_map_from_dict(data).phy2log.tolist() == PHY2LOG.tolist()

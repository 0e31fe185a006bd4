"""config.json of Medusa heads: vLLM's field names, its key renaming, the start-up checks."""

import json

import pytest

from ascend_specdec.medusa import MedusaConfigError, MedusaHeadsConfig


def test_round_trip_writes_vllms_fields(tmp_path):
    config = MedusaHeadsConfig(hidden_size=128, vocab_size=2048, num_heads=4,
                               truncated_vocab_size=512, original_lm_head=True)
    config.save(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["MedusaModel"]
    assert raw["model_type"] == "medusa"
    assert {k: raw[k] for k in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers",
                                "truncated_vocab_size", "original_lm_head", "medusa_fc_bias")} == {
        "hidden_size": 128, "vocab_size": 2048, "num_heads": 4, "num_hidden_layers": 1,
        "truncated_vocab_size": 512, "original_lm_head": True, "medusa_fc_bias": False}
    assert MedusaHeadsConfig.load(tmp_path) == config


def test_an_absent_medusa_fc_bias_means_no_bias_as_in_vllm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["MedusaModel"], "hidden_size": 8, "vocab_size": 10, "num_heads": 2}))
    assert MedusaHeadsConfig.load(tmp_path).medusa_fc_bias is False


def test_truncated_vocab_defaults_to_the_whole_vocabulary():
    config = MedusaHeadsConfig(hidden_size=8, vocab_size=100, num_heads=2)
    assert config.truncated_vocab_size == 100 and not config.is_truncated


def test_faster_decoding_keys_are_renamed_like_vllm_does():
    # FasterDecoding's medusa configs say medusa_num_heads / medusa_num_layers; vLLM's
    # MedusaConfig.from_pretrained maps every "num...heads" / "num...layers" key.
    config = MedusaHeadsConfig.from_json_dict({"hidden_size": 64, "vocab_size": 32000,
                                               "medusa_num_heads": 5, "medusa_num_layers": 2,
                                               "base_model_name_or_path": "x"})
    assert (config.num_heads, config.num_hidden_layers) == (5, 2)
    assert config.extra == {"base_model_name_or_path": "x"}


def test_extra_keys_that_vllm_would_misread_are_refused():
    config = MedusaHeadsConfig(hidden_size=8, vocab_size=10, num_heads=2,
                               extra={"num_attention_heads": 4})
    with pytest.raises(MedusaConfigError, match="num_attention_heads"):
        config.to_json_dict()


@pytest.mark.parametrize("fields, message", [
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"num_heads": 2.5}, "num_heads must be a positive integer"),
    ({"truncated_vocab_size": 11}, "truncated_vocab_size=11 must be between 1 and vocab_size=10"),
])
def test_bad_fields(fields, message):
    values = {"hidden_size": 8, "vocab_size": 10, "num_heads": 2, **fields}
    with pytest.raises(MedusaConfigError, match=message):
        MedusaHeadsConfig(**values)


def test_not_a_medusa_folder(tmp_path):
    with pytest.raises(MedusaConfigError, match="has no config.json"):
        MedusaHeadsConfig.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "model_type": "llama"}))
    with pytest.raises(MedusaConfigError, match="not Medusa heads"):
        MedusaHeadsConfig.load(tmp_path)


CONFIG = MedusaHeadsConfig(hidden_size=128, vocab_size=2048, num_heads=3)


def test_matching_base_passes():
    CONFIG.check_against_base(hidden_size=128, vocab_size=2048, num_speculative_tokens=3)
    CONFIG.check_against_base(hidden_size=128, vocab_size=2048, num_speculative_tokens=1)


def test_hidden_size_mismatch_names_both_sizes():
    with pytest.raises(MedusaConfigError, match=r"hidden_size=128, but the base model's hidden "
                                                r"size is 256"):
        CONFIG.check_against_base(hidden_size=256, vocab_size=2048)


def test_vocabulary_mismatch_names_both_sizes():
    with pytest.raises(MedusaConfigError, match=r"vocab_size=2048, but the base model's "
                                                r"vocabulary has 32000 tokens"):
        CONFIG.check_against_base(hidden_size=128, vocab_size=32000)


def test_more_speculative_tokens_than_heads():
    with pytest.raises(MedusaConfigError, match=r"num_speculative_tokens=4 is more than the 3 "
                                                r"Medusa heads.*<= 3"):
        CONFIG.check_against_base(hidden_size=128, vocab_size=2048, num_speculative_tokens=4)

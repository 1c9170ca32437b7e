"""The speculative settings: the short flags and vLLM's JSON make one speculative_config."""

from __future__ import annotations

import pytest

from tokenmill.engine import EngineConfig
from tokenmill.engine.speculative import SpeculativeMethod, speculative_config, speculative_settings
from tokenmill.settings import SettingError


def test_the_flags_fill_what_the_json_leaves_out() -> None:
    assert speculative_config(None, None, None) is None
    assert speculative_config("off", None, None) is None
    assert speculative_config("ngram", 3, None) == {"method": "ngram", "num_speculative_tokens": 3}
    assert speculative_config("suffix", None, {"suffix_decoding_min_token_prob": 0.2}) == {
        "method": "suffix", "suffix_decoding_min_token_prob": 0.2}
    settings = speculative_settings(speculative_config(None, None, {"method": "ngram", "prompt_lookup_max": 3}))
    assert settings is not None and settings.method is SpeculativeMethod.NGRAM
    assert (settings.num_speculative_tokens, settings.prompt_lookup_max) == (8, 3)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"speculative_method": "ngram", "speculative_config": {"method": "suffix"}},
     "speculative_method 'ngram' contradicts speculative_config's method 'suffix'"),
    ({"num_speculative_tokens": 4}, "num_speculative_tokens and speculative_config need a method"),
    ({"speculative_config": {"method": "eagle", "model": "x"}}, "method 'eagle': the embedded engine speculates"),
    ({"speculative_config": {"method": "ngram", "prompt_lookup_maxx": 3}}, "does not know prompt_lookup_maxx"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
    ({"speculative_config": {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}},
     r"prompt_lookup_min \(4\) is above prompt_lookup_max \(2\)"),
])
def test_an_engine_config_refuses_what_it_cannot_run_naming_the_setting(kwargs: dict, message: str) -> None:
    with pytest.raises(SettingError, match=message):
        EngineConfig(**kwargs)

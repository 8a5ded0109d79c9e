"""Fuzzing the configuration surfaces: any value either validates or raises one ConfigError --
never another exception type (issue #7)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinypipe
from tinypipe import cli

values = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(-2, 9), max_size=5), st.lists(st.text(max_size=6), max_size=3),
)
FIELDS = ["devices", "micro_batch_size", "backward_micro_batch_size", "pack_size", "prefetch_window",
          "precision", "lr", "eps", "weight_decay", "max_grad_norm", "stash", "pin_memory",
          "head_chunk_tokens", "grad_slots", "nonfinite", "host_grad_buffers", "stall_timeout_s",
          "optimizer_threads"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), values, max_size=5))
def test_config_validates_or_raises_config_error(kwargs: dict) -> None:
    try:
        tinypipe.Config(**kwargs)
    except tinypipe.ConfigError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200), st.sampled_from([".toml", ".yaml", ".yml"]))
def test_config_files_parse_or_raise_config_error(tmp_path: Path, text: str, suffix: str) -> None:
    path = tmp_path / f"settings{suffix}"
    path.write_text(text, encoding="utf-8")
    try:
        cli.load_config_file(str(path))
    except tinypipe.ConfigError as exc:
        assert "\n" not in str(exc)

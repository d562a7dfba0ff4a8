"""Every enum option of `simulate` lists its accepted values when given a bad one, and a
comma list names the bad item and what it accepts."""

from __future__ import annotations

import pytest

from pagedkv.__main__ import main
from pagedkv.config import HASH_ALGOS
from pagedkv.sim.models import MODELS
from pagedkv.sim.tier_cli import CODECS
from pagedkv.sim.workloads import WORKLOADS


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", *argv])
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "values"),
    [
        ("--hash-algo", HASH_ALGOS),
        ("--workload", tuple(WORKLOADS)),
        ("--model", tuple(MODELS)),
        ("--compress", CODECS),
    ],
)
def test_enum_errors_list_the_values(
    capsys: pytest.CaptureFixture[str], option: str, values: tuple[str, ...]
) -> None:
    err = _usage_error(capsys, option, "md5")
    assert f"argument {option}: invalid choice" in err and "md5" in err
    for v in values:
        assert v in err, (option, v)


def test_a_bad_item_in_a_list_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(capsys, "--hash-algo", "sha256,md5")
    assert "bad item 'md5' in 'sha256,md5': invalid choice 'md5' (choose from sha256" in err
    err = _usage_error(capsys, "--block-size", "16,x")
    assert "argument --block-size: bad item 'x' in '16,x': bad number 'x'" in err
    assert "64k = 64000" in err
    err = _usage_error(capsys, "--cache-tokens", "16,,32")
    assert "expected a comma-separated list, got '16,,32' (an empty item)" in err
